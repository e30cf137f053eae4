"""The dashboard: server-rendered HTML pages under /ui, their live-data JSON, and artifact downloads.

- ``/ui/login``: a key entered once opens a session whose token the ``memfit_session`` cookie holds
  (HttpOnly, SameSite=Strict, Secure over https; never the key itself); every page and data call
  authenticates it through its key (api.web_auth), so a page never shows another tenant's objects
  (their ids are a 404 here too). Every page is sent with a Content-Security-Policy (scripts and
  styles from this origin only, no framing) and the headers that go with it (:class:`PageHeaders`).
- ``/ui/jobs``: the jobs list, filterable by status. ``/ui/jobs/{id}``: the job page; its chart data
  is embedded as JSON (``<script type="application/json" id="page-data">``) and updated live from the
  SSE stream (api/routes/stream.py) plus ``/ui/jobs/{id}/memory.json`` for new memory samples. What
  it embeds is bounded whatever the job's length (service/views/dashboard.py: the newest events, each
  rank's last steps in full and older ones as buckets).
- ``/ui/planner``: the memory planner as a form.
- ``/v1/fine_tuning/jobs/{id}/artifacts[/{path}]``: the job's model artefacts, by service.jobs.artifacts'
  allowlist (nothing else of its output folder: no Ray internals, spools or failure files; no
  ``..`` or symlinks), tenant-checked, with the API key or the cookie.

Charts are drawn by Chart.js, vendored in api/static (MIT) so the pages work with no internet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.errors import BY_ID, problems
from api.routes.files import download_response
from api.web_auth import COOKIE, WebPrincipalDep, clear_session_cookie, set_session_cookie, web_principal
from service.domain.errors import NotFound, Unauthorized
from service.domain.states import JobStatus
from service.domain.units import human_bytes
from service.jobs import artifacts
from service.jobs import crud as jobs
from service.store.web_sessions import close_session, open_session
from service.views import dashboard

HERE = Path(__file__).resolve().parent.parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
static = StaticFiles(directory=str(HERE / "static"))

router = APIRouter(tags=["dashboard"])


def _bytes(n: Any) -> str:
    return human_bytes(n, missing="—")


def _age(seconds: Any) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s // size} {unit}"
    return f"{s} s"


def _pct(x: Any) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


templates.env.filters["bytes"] = _bytes
templates.env.filters["age"] = _age
templates.env.filters["pct"] = _pct


def _json_for_script(data: Any) -> str:
    """JSON safe inside <script type="application/json">: no '</' can close the element."""
    return json.dumps(data, default=str).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


templates.env.filters["script_json"] = _json_for_script


def _login_redirect(request: Request) -> RedirectResponse:
    return RedirectResponse(f"/ui/login?next={request.url.path}", status_code=303)


def _page_principal(request: Request, session):
    """The tenant for a page, or None (→ the login page) when there is no valid key."""
    try:
        return web_principal(request, session)
    except Unauthorized:
        return None


@router.get("/ui", include_in_schema=False)
def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/ui/login", response_class=HTMLResponse, include_in_schema=False)
def login_form(request: Request, next: str = "/ui/jobs", error: str | None = None):
    return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next), "error": error},
                                      status_code=401 if error else 200)


def _safe_next(next: str) -> str:
    # Only same-site paths: no open redirect to another origin.
    return next if next.startswith("/ui") and not next.startswith("//") else "/ui/jobs"


@router.post("/ui/login", include_in_schema=False)
def login(request: Request, session: SessionDep, api_key: Annotated[str, Form()],
          next: Annotated[str, Form()] = "/ui/jobs"):
    try:
        token = open_session(session, api_key.strip())
    except Unauthorized as exc:
        return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next), "error": exc.message},
                                          status_code=401)
    response = RedirectResponse(_safe_next(next), status_code=303)
    set_session_cookie(request, response, token)  # a session token, never the key
    return response


@router.post("/ui/logout", include_in_schema=False)
def logout(request: Request, session: SessionDep) -> RedirectResponse:
    close_session(session, request.cookies.get(COOKIE))
    response = RedirectResponse("/ui/login", status_code=303)
    clear_session_cookie(request, response)
    return response


@router.get("/ui/jobs", response_class=HTMLResponse, include_in_schema=False)
def jobs_page(request: Request, session: ReadSessionDep, status: str | None = None):
    principal = _page_principal(request, session)
    if principal is None:
        return _login_redirect(request)
    if status and status not in {s.value for s in JobStatus}:
        status = None
    rows = dashboard.job_rows(session, principal, status=status)
    return templates.TemplateResponse(request, "jobs.html", {
        "rows": rows, "status": status, "statuses": [s.value for s in JobStatus],
        "page_data": {"jobs": rows, "status": status},
    })


@router.get("/ui/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def job_page(job_id: str, request: Request, session: ReadSessionDep, settings: SettingsDep):
    principal = _page_principal(request, session)
    if principal is None:
        return _login_redirect(request)
    view = dashboard.job_view(session, principal, settings, job_id)  # JobNotFound → 404 problem
    return templates.TemplateResponse(request, "job.html", {"v": view, "page_data": view})


@router.get("/ui/jobs/{job_id}/memory.json", include_in_schema=False)
def job_memory_json(job_id: str, session: ReadSessionDep, principal: WebPrincipalDep,
                    after_id: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
    """Memory samples newer than ``after_id`` and the job's status line (the page's live updates)."""
    job = jobs.get_job(session, principal, job_id)
    samples = dashboard.memory_samples_after(session, job_id, after_id, job=job)
    return {"samples": samples, "status": job.status,
            "trained_tokens": job.trained_tokens,
            "estimated_finish": job.estimated_finish.timestamp() if job.estimated_finish else None}


# --- artifacts ---------------------------------------------------------------------------------


@router.get("/v1/fine_tuning/jobs/{job_id}/artifacts", tags=["fine-tuning"], responses=problems(*BY_ID),
            summary="The job's model artefacts: adapter, merged, model, checkpoints' metrics")
def list_artifacts(job_id: str, session: ReadSessionDep, principal: WebPrincipalDep, settings: SettingsDep):
    job = jobs.get_job(session, principal, job_id)
    files = artifacts.list_artifacts(job, settings)
    return {"object": "list", "data": [{**f, "url": f"/v1/fine_tuning/jobs/{job_id}/artifacts/{f['path']}"}
                                       for f in files], "has_more": len(files) >= artifacts.MAX_FILES}


@router.get("/v1/fine_tuning/jobs/{job_id}/artifacts/{path:path}", tags=["fine-tuning"], responses=problems(*BY_ID),
            summary="Download one of the job's model artefacts", response_class=FileResponse)
def download_artifact(job_id: str, path: str, session: ReadSessionDep, principal: WebPrincipalDep,
                      settings: SettingsDep) -> Response:
    job = jobs.get_job(session, principal, job_id)
    try:
        target = artifacts.artifact_file(job, settings, path)
    except artifacts.FileNotInJob:
        raise NotFound(f"No artefact {path!r} in job {job_id}", param="path", code="file_not_found") from None
    return download_response(target, filename=target.name, media_type="application/octet-stream")


# --- planner -----------------------------------------------------------------------------------


@router.get("/ui/planner", response_class=HTMLResponse, include_in_schema=False)
def planner_page(request: Request, session: ReadSessionDep):
    principal = _page_principal(request, session)
    if principal is None:
        return _login_redirect(request)
    return _planner(request, None)


@router.post("/ui/planner", response_class=HTMLResponse, include_in_schema=False)
async def planner_submit(request: Request, session: ReadSessionDep):
    principal = _page_principal(request, session)
    if principal is None:
        return _login_redirect(request)
    form = dict((await request.form()).items())
    return _planner(request, {k: str(v) for k, v in form.items()})


def _planner(request: Request, form: dict[str, str] | None):
    from service.views import plan_page

    ctx = plan_page.evaluate(form, known_gpus=request.app.state.known_gpus, settings=request.app.state.settings)
    return templates.TemplateResponse(request, "planner.html", {**ctx, "page_data": ctx.get("result")},
                                      status_code=200 if not ctx.get("errors") else 422)


def install(app) -> None:
    """Mount the static files (Chart.js, the dashboard script and stylesheet); the pages' security headers."""
    app.mount("/ui/static", static, name="ui-static")
    app.add_middleware(PageHeaders)


# Scripts only from this origin (the page's data is JSON in a non-executed <script type="application/json">,
# its handlers in dashboard.js); the bars' widths are inline style attributes, hence 'unsafe-inline' for
# styles alone. No framing by any origin (clickjacking), no <base> or plugin tricks, forms post here only.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PAGE_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-frame-options", b"DENY"),
                (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]


class PageHeaders:
    """The dashboard's security headers on every /ui response (pages, their JSON, static files, redirects)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/ui"):
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in PAGE_HEADERS if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, with_headers)



@router.get("/ui/jobs/{job_id}/view.json", include_in_schema=False)
def job_view_json(job_id: str, session: ReadSessionDep, principal: WebPrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    """The job page's data as JSON (what `memfit jobs memory` falls back to)."""
    return dashboard.job_view(session, principal, settings, job_id)
