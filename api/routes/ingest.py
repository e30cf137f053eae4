"""POST /v1/internal/jobs/{job_id}/ingest: the Ray job's metrics sink reports here.

Authenticated by the job's own ingest token (Bearer), not by a tenant API key: the token opens this
one job's ingest endpoint and nothing else. The route is as careful with its caller as any other:

1. the token, from the header, before a byte of the body is read: none is 401, another job's (or
   a made-up one) 404 — and such a refusal is charged to the client's address, as a refused API key is
   (api/limits.py), so guessing tokens costs what guessing keys costs;
2. its own rate limit, per attempt (MEMFIT_RATE_LIMIT_INGEST_PER_S): 429 with Retry-After, which the
   sink honours by trying again later — nothing is dropped;
3. the body, read up to MEMFIT_MAX_INGEST_BODY_BYTES (what one batch of a run legitimately is; the
   sink splits a batch refused as too large) and refused past MEMFIT_MAX_JSON_DEPTH nesting before
   anything parses it.

Everything else is in service.jobs.ingest.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.errors import problems
from api.limits import RateLimited, client_address, json_depth_exceeds
from service.domain.errors import BadRequest, DomainError
from service.domain.records import IngestBatch
from service.jobs import ingest

router = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])

_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}}}}


class IngestTooLarge(DomainError):
    status, code, title = 413, "body_too_large", "Payload too large"


@router.post("/{job_id}/ingest", summary="Records from a running job (metrics, memory, checkpoints, result)",
             responses=problems(400, 401, 404, 409, 413, 422, 429, 503), openapi_extra={"requestBody": _BODY})
async def ingest_records(job_id: str, request: Request) -> dict[str, Any]:
    app = request.app
    settings = app.state.settings
    limiter = app.state.limiter
    token = ingest.bearer_token(request.headers.get("authorization"))
    ip_key, ip_rate = f"ip:{client_address(request.scope)}", (settings.rate_limit_ip_per_s, settings.rate_limit_ip_burst)
    limited = settings.rate_limit_enabled
    if limited and (wait := await limiter.wait(ip_key, per_s=ip_rate[0], burst=ip_rate[1])):
        # This address's refusals used up its allowance: no more token checks for it until it refills.
        raise RateLimited(wait, whose="this client address (refused ingest tokens)", per_s=ip_rate[0],
                          burst=ip_rate[1], setting="MEMFIT_RATE_LIMIT_IP_PER_S")
    try:
        attempt = await run_in_threadpool(_authorize, app, job_id, token)
    except DomainError:
        if limited:
            await limiter.take(ip_key, per_s=ip_rate[0], burst=ip_rate[1])
        raise
    per_s, burst = settings.rate_limit_ingest_per_s, settings.rate_limit_ingest_burst
    if limited and (wait := await limiter.take(f"ingest:{job_id}:{attempt}", per_s=per_s, burst=burst)):
        raise RateLimited(wait, whose="this job attempt's ingest", per_s=per_s, burst=burst,
                          setting="MEMFIT_RATE_LIMIT_INGEST_PER_S")
    body = await _read_capped(request, settings.max_ingest_body_bytes)
    if json_depth_exceeds(body, settings.max_json_depth):
        raise BadRequest(f"JSON body nests arrays/objects deeper than the limit of {settings.max_json_depth} levels "
                         "(MEMFIT_MAX_JSON_DEPTH)", code="json_too_deep")
    try:
        batch = IngestBatch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    return (await run_in_threadpool(_store, app, job_id, token, batch)).as_dict()


def _authorize(app, job_id: str, token: str | None) -> int:
    with app.state.read_sessions() as session:
        return ingest.authorize(session, job_id, token)


def _store(app, job_id: str, token: str | None, batch: IngestBatch) -> ingest.IngestResult:
    with app.state.sessions() as session:  # ingest commits, or raises and changes nothing
        return ingest.ingest(session, app.state.settings, job_id, token, batch)


async def _read_capped(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes, declared or chunked."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> IngestTooLarge:
    return IngestTooLarge(f"request body is larger than the limit of {limit} bytes for one ingest batch "
                          "(MEMFIT_MAX_INGEST_BODY_BYTES)")


def document(app) -> None:
    """The route reads its body itself (after the token): put IngestBatch's JSON schema, which FastAPI
    cannot see, into the OpenAPI document's components."""
    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            doc = build()
            schema = IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components["IngestBatch"] = schema
        return app.openapi_schema

    app.openapi = openapi
