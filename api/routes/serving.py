"""OpenAI's inference API on the tenant's models: /v1/models (list, get, delete), /v1/chat/completions and
/v1/completions (whole answers, or server-sent events with ``stream``), and the dashboard's model pages.

Every route is tenant-scoped (another tenant's model is a 404 ``model_not_found``) and answers errors in
the problem + OpenAI ``error`` shape (api/errors.py). A generation is bounded per tenant: generations at
once (429 ``concurrency_limit_exceeded``), tokens per minute on the API's rate limiter (429
``rate_limit_exceeded``), ``max_tokens`` (400 ``max_tokens_too_large``), its time (504 ``timeout``); a
client that goes away cancels it (the connection to the replica is closed, and the replica drops it).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.errors import problems
from api.limits import RateLimited, take
from api.web_auth import WebPrincipalDep
from service.domain.serving import (
    Assembler,
    ChatCompletionRequest,
    CompletionRequest,
    check_max_tokens,
    engine_request,
)
from service.jobs import models as catalogue
from service.store.auth import Principal

router = APIRouter(tags=["inference"])
MODEL_PATH = "/v1/models/{model_id:path}"
GEN = problems(400, 401, 404, 422, 429, 503)


def inference(request: Request):
    return request.app.state.inference


@router.get("/v1/models", responses=problems(401, 429, 503), summary="The models this tenant can call")
def list_models(session: ReadSessionDep, principal: WebPrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [m.public() for m in catalogue.tenant_models(session, principal, settings)]}


@router.get(MODEL_PATH, responses=problems(401, 404, 429, 503), summary="One model")
def get_model(model_id: str, session: ReadSessionDep, principal: WebPrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    return catalogue.find_model(session, principal, settings, model_id).public()


@router.delete(MODEL_PATH, responses=problems(401, 403, 404, 429, 503),
               summary="Delete a fine-tuned or checkpoint model (its job stays)")
async def delete_model(model_id: str, request: Request, session: SessionDep, principal: WebPrincipalDep,
                       settings: SettingsDep) -> dict[str, Any]:
    model = await run_in_threadpool(catalogue.delete_model, session, principal, settings, model_id)
    serving = inference(request)
    if model.kind == "merged" and serving.apps is not None:
        await serving.apps.remove(serving.spec_for(model))  # its own application goes; an adapter leaves at the replica's sweep
    return {"id": model_id, "object": "model", "deleted": True}


async def _charge_tokens(request: Request, principal: Principal, tokens: int) -> None:
    settings = request.app.state.settings
    per_minute = settings.serve_tokens_per_minute
    if not per_minute:
        return
    wait = await take(request.app, f"tokens:{principal.tenant_id}", per_s=per_minute / 60, burst=per_minute,
                      cost=min(tokens, per_minute))
    if wait:
        raise RateLimited(wait, whose="this tenant's tokens", per_s=per_minute / 60, burst=per_minute,
                          setting="MEMFIT_SERVE_TOKENS_PER_MINUTE")


async def _generate(request: Request, session, principal: Principal, req: ChatCompletionRequest | CompletionRequest):
    settings = request.app.state.settings
    model = await run_in_threadpool(catalogue.find_model, session, principal, settings, req.model)
    chat = isinstance(req, ChatCompletionRequest)
    wanted = req.wanted_tokens(settings.serve_max_tokens)
    param = ("max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens")
    check_max_tokens(wanted, settings.serve_max_tokens, param)
    prompt_guess = len(json.dumps([m.plain() for m in req.messages]) if chat else req.text) // 4
    await _charge_tokens(request, principal, prompt_guess + wanted * req.n)
    serving = inference(request)
    body = engine_request(req, wanted, model.adapter_path, model.adapter_config_from)
    assembler = Assembler(req, req.model)
    slot = serving.slot(principal.tenant_id)
    await slot.__aenter__()
    try:
        events = serving.events(model, body)
        first = await events.__anext__()  # errors before the first token are this request's status (4xx/5xx)
        assembler.feed(first)
    except BaseException:
        await slot.__aexit__(None, None, None)
        raise
    if req.stream:
        return StreamingResponse(_sse(request, events, assembler, slot), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        task = asyncio.ensure_future(_collect(events, assembler))
        while not task.done():  # a client that leaves cancels the generation
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        return JSONResponse(task.result())
    finally:
        await events.aclose()
        await slot.__aexit__(None, None, None)


async def _collect(events, assembler: Assembler) -> dict[str, Any]:
    async for event in events:
        assembler.feed(event)
    return assembler.whole()


def _sse_data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(request: Request, events, assembler: Assembler, slot):
    """OpenAI's stream: one chunk per delta and per finished choice, the usage chunk when asked, ``[DONE]``.
    Starlette cancels this generator when the client disconnects: the finally closes the replica's stream."""
    try:
        try:
            async for event in events:
                for chunk in assembler.feed(event):
                    yield _sse_data(chunk)
            if assembler.include_usage:
                yield _sse_data(assembler.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - mid-stream: the error goes in the stream, as OpenAI's does
            code = getattr(exc, "code", "internal_error")
            yield _sse_data({"error": {"message": getattr(exc, "message", str(exc)), "type": "server_error",
                                       "param": None, "code": code}})
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()
        await slot.__aexit__(None, None, None)


@router.post("/v1/chat/completions", responses=GEN, summary="A chat completion from one of this tenant's models")
async def chat_completions(body: ChatCompletionRequest, request: Request, session: ReadSessionDep,
                           principal: WebPrincipalDep):
    return await _generate(request, session, principal, body)


@router.post("/v1/completions", responses=GEN, summary="A text completion from one of this tenant's models")
async def completions(body: CompletionRequest, request: Request, session: ReadSessionDep, principal: WebPrincipalDep):
    return await _generate(request, session, principal, body)


# --- the dashboard's model pages ---------------------------------------------------------------------


@router.get("/ui/models", response_class=HTMLResponse, include_in_schema=False)
def models_page(request: Request, session: ReadSessionDep, settings: SettingsDep):
    from api.routes.pages import _login_redirect, _page_principal, templates

    principal = _page_principal(request, session)
    if principal is None:
        return _login_redirect(request)
    rows = [m.public() | {"kind": m.kind} for m in catalogue.tenant_models(session, principal, settings)]
    return templates.TemplateResponse(request, "models.html", {"rows": rows, "page_data": {"models": rows}})


@router.get("/ui/models/{model_id:path}/view.json", include_in_schema=False)
async def model_view_json(model_id: str, request: Request, session: ReadSessionDep, principal: WebPrincipalDep):
    return await model_view(request, session, principal, model_id)


@router.get("/ui/models/{model_id:path}", response_class=HTMLResponse, include_in_schema=False)
async def model_page(model_id: str, request: Request, session: ReadSessionDep, settings: SettingsDep):
    from api.routes.pages import _login_redirect, _page_principal, templates

    principal = await run_in_threadpool(_page_principal, request, session)
    if principal is None:
        return _login_redirect(request)
    view = await model_view(request, session, principal, model_id)
    return templates.TemplateResponse(request, "model.html", {"v": view, "page_data": view})


async def model_view(request: Request, session, principal: Principal, model_id: str) -> dict[str, Any]:
    """A model's page data: what it is, its serving plan (predicted) and its running replica's figures (measured)."""
    settings = request.app.state.settings
    model = await run_in_threadpool(catalogue.find_model, session, principal, settings, model_id)
    serving = inference(request)
    plan = serving.plan_for(model)
    measured = await serving.replica_stats(model)
    rows = []
    if plan is not None:
        p = plan.to_dict()
        rows = [{"part": "weights", "predicted": p["weights_bytes"], "measured": (measured or {}).get("weights_bytes")},
                {"part": f"adapters ({p['adapters_resident']} resident at most; measured: those loaded now)",
                 "predicted": p["adapters_bytes"], "measured": (measured or {}).get("adapters_bytes")},
                {"part": f"KV cache ({p['concurrent_sequences']} × {p['context_length']} tokens)", "predicted": p["kv_cache_bytes"],
                 "measured": None},
                {"part": "activations", "predicted": p["activation_bytes"], "measured": None},
                {"part": "runtime (process)", "predicted": p["runtime_bytes"], "measured": None},
                {"part": "total", "predicted": p["total_bytes"], "measured": (measured or {}).get("rss_bytes")}]
    return {"model": model.public() | {"kind": model.kind, "base": model.base, "job_id": model.job_id},
            "plan": plan.to_dict() if plan else None, "measured": measured, "rows": rows,
            "error_pct": _error(plan.total_bytes if plan else None, (measured or {}).get("rss_bytes"))}


def _error(predicted: int | None, measured: int | None) -> float | None:
    if not predicted or not measured:
        return None
    value = (predicted - measured) / measured
    return value if math.isfinite(value) else None
