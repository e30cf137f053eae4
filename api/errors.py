"""The one exception handler: every error leaves as RFC 9457 ``application/problem+json``.

Body: ``type, title, status, detail, instance`` plus memfit's ``code``, ``param`` and ``errors[]``
(every problem when several are reported together), and OpenAI's ``error: {message, type, param,
code}`` so the openai client raises the matching exception class.

Status codes: 400 the request could not be read (malformed JSON body or multipart, a dataset file
that is not valid JSONL, ``json_too_deep``: a body nested past MEMFIT_MAX_JSON_DEPTH); 401
missing/invalid/revoked key; 404 unknown or another tenant's object;
409 illegal state transition or an Idempotency-Key still in flight; 413 upload or body over its limit;
422 a well-formed request whose values are wrong (spec fields, unknown fields, cross-field rules,
model, purpose, limit, cursor, Idempotency-Key reused with another body; a job predicted not to fit
its memory under memory_policy=reject: ``insufficient_memory`` with ``breakdown``, ``suggestions`` and
``plan`` members, from service.memory.preflight.DoesNotFit); 429 a quota (``*_quota_exceeded``,
service.jobs.quotas) or the rate limit (``rate_limit_exceeded`` with ``Retry-After``, api/limits.py);
431 too many or too large headers (api/limits.py); 503 ``database_unavailable`` with
``Retry-After`` while the database cannot be reached (restarting, failing over): retryable, so the
workers' ingest sink and clients try again instead of dropping the request; 507 ``storage_full``
when the storage volume has no space left for an upload (nothing is stored). A value the database
cannot store (a NUL character in a text field) is a 422 ``invalid_value``, not a 500. A 405 names in
``Allow`` every method the path serves.

Each route documents the statuses it can answer with ``responses=problems(...)``, all as
``application/problem+json`` with the ``Problem`` schema (tests/test_schemathesis.py holds the app to
its document).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from pydantic import BaseModel, Field
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.domain.errors import DatabaseUnavailable, DomainError

log = logging.getLogger("memfit.api")
PROBLEM_BASE = "https://memfit.dev/problems/"
DATABASE_RETRY_AFTER_S = DatabaseUnavailable.RETRY_AFTER_S
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}


class ProblemItem(BaseModel):
    param: str | None = None
    message: str
    code: str


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class Problem(BaseModel):
    """An error body (RFC 9457 problem details plus OpenAI's ``error`` object). Some carry more
    members (``insufficient_memory``: ``breakdown``, ``suggestions``, ``plan``)."""

    type: str
    title: str
    status: int
    detail: str
    instance: str
    code: str
    param: str | None = None
    errors: list[ProblemItem] = Field(default_factory=list)
    error: OpenAIError


_WHEN = {
    400: "The request could not be read (malformed JSON or multipart, a file that is not valid JSONL)",
    401: "Missing, invalid or revoked API key",
    403: "Not permitted on this object (a base model cannot be deleted)",
    404: "No such object for this tenant (another tenant's id is a 404 too)",
    409: "Illegal state transition, or an Idempotency-Key whose first request is still in flight",
    413: "Request body over the limit",
    422: "Well-formed request with wrong values; `errors[]` names every field at fault",
    429: "Too many requests (retry after Retry-After)",
    503: "The database or the model serving is unavailable (retryable, with Retry-After)",
    504: "The generation took longer than its limit (MEMFIT_SERVE_REQUEST_TIMEOUT_S)",
    507: "The storage volume is full (`storage_full`): nothing was stored",
}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for the error statuses a route can answer, each an application/problem+json
    Problem (registered in the document by ``install``)."""
    return {status: {"description": _WHEN[status], "content": {
        "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}} for status in statuses}


# The statuses every tenant-authenticated route can answer, and those of one addressed by id.
AUTHED = (401, 422, 429, 503)
BY_ID = (401, 404, 422, 429, 503)


def problem_response(
    request: Request,
    *,
    status: int,
    code: str,
    title: str,
    detail: str,
    param: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    openai_type: str | None = None,
    headers: dict[str, str] | None = None,
    retryable: bool = False,
    extensions: dict[str, Any] | None = None,
) -> JSONResponse:
    body = {
        **(extensions or {}),  # a domain error's own members (DoesNotFit: breakdown, suggestions, plan)
        "type": PROBLEM_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        "code": code,
        "param": param,
        "errors": errors or [],
        "error": {
            "message": detail,
            "type": openai_type or _OPENAI_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        },
    }
    out = {"x-should-retry": "true" if retryable else "false", **(headers or {})}
    if status == 401:
        out["WWW-Authenticate"] = 'Bearer realm="memfit"'
    return JSONResponse(body, status_code=status, headers=out, media_type="application/problem+json")


async def _domain(request: Request, exc: DomainError) -> JSONResponse:
    if isinstance(exc, DatabaseUnavailable):
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc.__cause__ or exc)
    return problem_response(
        request, status=exc.status, code=exc.code, title=exc.title, detail=exc.message, param=exc.param,
        errors=exc.errors, openai_type=exc.openai_type, headers=exc.headers, retryable=exc.retryable,
        extensions=getattr(exc, "extensions", None),  # service.memory.preflight.DoesNotFit (422 insufficient_memory)
    )


def _loc_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or None


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    raw = exc.errors()
    if any(e.get("type") == "json_invalid" for e in raw):
        detail = "The request body is not valid JSON"
        ctx = next(e for e in raw if e.get("type") == "json_invalid").get("ctx") or {}
        if ctx.get("error"):
            detail += f": {ctx['error']}"
        return problem_response(request, status=400, code="invalid_json", title="Bad request", detail=detail)
    problems = []
    for e in raw:
        unknown = e.get("type") == "extra_forbidden"
        problems.append({
            "param": _loc_param(tuple(e.get("loc", ()))) or "body",
            "message": "unknown field" if unknown else e.get("msg", "invalid value"),
            "code": "unknown_field" if unknown else "invalid_value",
        })
    detail = "; ".join(f"{p['param']}: {p['message']}" for p in problems)
    return problem_response(
        request, status=422, code=problems[0]["code"] if len(problems) == 1 else "invalid_value",
        title="Unprocessable entity", detail=detail, param=problems[0]["param"], errors=problems,
    )


def _allowed_methods(request: Request) -> str | None:
    """Every method some route serves at this path. Starlette's 405 names only the first route whose
    path matched (GET /v1/files/{id} and DELETE /v1/files/{id} are two routes), so Allow was short."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):  # through the included routers
        regex = getattr(route, "path_regex", None)
        if route.methods and regex is not None and regex.match(request.url.path):
            methods |= route.methods
    return ", ".join(sorted(methods)) if methods else None


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and (allowed := _allowed_methods(request)):
        headers["Allow"] = allowed
    code, detail = codes.get(exc.status_code, f"http_{exc.status_code}"), str(exc.detail)
    if exc.status_code == 404 and request.url.path.startswith("/api/v1/"):  # Tinker's API (api/routes/tinker.py)
        code, detail = "unsupported_endpoint", (f"{request.url.path} is a part of the Tinker API memfit does not implement "
                                                "(docs/tinker.md lists what it does)")
    return problem_response(
        request, status=exc.status_code, code=code,
        title=str(exc.detail) if exc.status_code != 404 else "Not found",
        detail=detail, headers=headers,
    )


async def _database(request: Request, exc: Exception) -> JSONResponse:
    """The database is away (connection refused or closed by a restarting server, a pool that cannot
    hand out a connection): 503, retryable. A value it cannot store (DataError) is a 422; other DBAPI
    errors (integrity, programming) stay 500s."""
    if isinstance(exc, sa_exc.DataError):
        # A value the database cannot hold (a NUL character in a text field, an integer out of its
        # column's range) came from the request: the client's fault, not a server error.
        cause = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig).__name__
        return problem_response(
            request, status=422, code="invalid_value", title="Unprocessable entity",
            detail=f"A value in the request cannot be stored: {cause}",
        )
    away = isinstance(exc, (sa_exc.OperationalError, sa_exc.TimeoutError)) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
    if not away:
        return await _unhandled(request, exc)
    cause = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path,
                str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__)
    return problem_response(
        request, status=503, code="database_unavailable", title="Service unavailable",
        detail="The database is unavailable; retry shortly", retryable=True,
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(
        request, status=500, code="internal_error", title="Internal server error",
        detail="The server failed to process the request", retryable=True,
    )


def install(app: FastAPI) -> None:
    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            doc = build()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(problem.pop("$defs", {}))
            schemas["Problem"] = problem
        return app.openapi_schema

    app.openapi = openapi
    app.add_exception_handler(DomainError, _domain)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(sa_exc.DBAPIError, _database)
    app.add_exception_handler(sa_exc.TimeoutError, _database)
    app.add_exception_handler(Exception, _unhandled)
