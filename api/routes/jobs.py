"""/v1/fine_tuning/jobs: create (Idempotency-Key), list, get, cancel, pause, resume, events, checkpoints."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import JSONResponse, Response

from api.deps import PrincipalDep, ReadSessionDep, SessionDep, SettingsDep
from api.errors import AUTHED, BY_ID, problems
from api.schemas import (
    RENDERED_PAGES,
    SPEC_VIEWS,
    CheckpointPublic,
    EventPublic,
    JobPublic,
    ListPublic,
    checkpoint_public,
    event_public,
    job_public,
    job_json,
    job_public_dict,
    jobs_page_json,
    page_public,
)
from service.domain.errors import UnprocessableEntity
from service.jobs import crud as jobs
from service.jobs.artifacts import stored_location
from service.jobs.claimed_paths import located
from service.jobs.crud import spec_version
from service.scheduler.paths import attempt_dir

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])



class JSONBytes(Response):
    """An answer already serialized (api/schemas.py job_json): sent as it is, no second pass."""

    media_type = "application/json"


Limit = Annotated[int, Query(ge=1, le=jobs.MAX_LIMIT, description="Page size, 1 to 100.")]


@router.post("", response_model=JobPublic, responses=problems(400, 401, 404, 409, 413, 422, 429, 503))
def create_job(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    body: Annotated[Any, Body(description="OpenAI's create body plus memfit's `training` object (service.domain.spec.JobSpec).")],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
):
    created = jobs.create_job(
        session, principal, settings, body,
        render=job_public_dict, idempotency_key=idempotency_key, known_gpus=request.app.state.known_gpus,
    )
    headers = {"Idempotent-Replayed": "true"} if created.replayed else None
    return JSONResponse(created.body, status_code=created.status_code, headers=headers)


def _metadata_filter(request: Request) -> dict[str, str]:
    out = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            name = key[len("metadata["):-1]
            if not name:
                raise UnprocessableEntity("metadata filter needs a key: metadata[key]=value", param=key)
            out[name] = value
    return out


@router.get("", response_model=ListPublic[JobPublic], responses=problems(*AUTHED))
async def list_jobs(
    request: Request,
    principal: PrincipalDep,
    after: str | None = None,
    limit: Limit = 20,
    status: str | None = None,
):
    metadata = _metadata_filter(request)
    reads = request.app.state.reads
    versions = key = None
    if not metadata and not status:  # a plain page: answered again while its rows are the same versions
        versions = await jobs.read_page_versions(reads, principal, after=after, limit=limit)
        key = (principal.tenant_id, after, limit)
        if versions and (data := RENDERED_PAGES.get(key, versions)) is not None:
            return JSONBytes(data)
    page = await jobs.read_jobs(reads, principal, after=after, limit=limit, metadata=metadata, status=status,
                                specs_known=SPEC_VIEWS, versions=versions)
    views = [SPEC_VIEWS.get(row.id, page.specs.get(row.id), spec_version(row.attempt, row.status)) for row in page]
    if None in views:  # forgotten since the read (more than SpecViews.max_entries jobs seen meanwhile)
        specs = await jobs.read_specs(reads, principal, [row.id for row, view in zip(page, views) if view is None])
        views = [view or SPEC_VIEWS.get(row.id, specs[row.id], spec_version(row.attempt, row.status))
                 for row, view in zip(page, views)]
    data = jobs_page_json(page, views, page.has_more)
    if versions:  # an empty page is not kept: its cursor is checked on every read (422 once it is unknown)
        RENDERED_PAGES.put(key, versions, data)
    return JSONBytes(data)


@router.get("/{job_id}", response_model=JobPublic, responses=problems(*BY_ID))
async def get_job(job_id: str, request: Request, principal: PrincipalDep):
    view = SPEC_VIEWS.get(job_id)
    row = await jobs.read_job(request.app.state.reads, principal, job_id, with_spec=view is None)
    version = spec_version(row.attempt, row.status)
    if view is not None and SPEC_VIEWS.get(job_id, version=version) is None:  # the spec changed (a downshift)
        row = await jobs.read_job(request.app.state.reads, principal, job_id, with_spec=True)
        view, version = None, spec_version(row.attempt, row.status)
    return JSONBytes(job_json(row, view or SPEC_VIEWS.get(row.id, row.spec_json, version)))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=problems(401, 404, 409, 422, 429, 503))
def cancel_job(job_id: str, session: SessionDep, principal: PrincipalDep):
    return job_public(jobs.cancel_job(session, principal, job_id))


@router.post("/{job_id}/pause", response_model=JobPublic, responses=problems(401, 404, 409, 422, 429, 503))
def pause_job(job_id: str, session: SessionDep, principal: PrincipalDep):
    return job_public(jobs.pause_job(session, principal, job_id))


@router.post("/{job_id}/resume", response_model=JobPublic, responses=problems(401, 404, 409, 422, 429, 503))
def resume_job(job_id: str, session: SessionDep, principal: PrincipalDep):
    return job_public(jobs.resume_job(session, principal, job_id))


@router.get("/{job_id}/events", response_model=ListPublic[EventPublic], responses=problems(*BY_ID))
def list_events(job_id: str, session: ReadSessionDep, principal: PrincipalDep, after: str | None = None, limit: Limit = 20):
    page = jobs.list_events(session, principal, job_id, after=after, limit=limit)
    return page_public([event_public(e) for e in page], page.has_more)


@router.get("/{job_id}/checkpoints", response_model=ListPublic[CheckpointPublic], responses=problems(*BY_ID))
def list_checkpoints(
    job_id: str, session: ReadSessionDep, principal: PrincipalDep, settings: SettingsDep, after: str | None = None,
    limit: Limit = 10,
):
    job = jobs.get_job(session, principal, job_id)  # its model and suffix name each checkpoint's model
    page = jobs.list_checkpoints(session, principal, job_id, after=after, limit=limit)
    # The database holds a checkpoint's folder relative to its attempt's (service/jobs/claimed_paths.py).
    return page_public([checkpoint_public(c, job).model_copy(update={"path": stored_location(settings, located(
        attempt_dir(settings, job_id, c.attempt), c.path))}) for c in page], page.has_more)
