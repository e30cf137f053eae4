"""POST /v1/internal/jobs/{job_id}/ingest: the Ray job's metrics sink reports here.

Authenticated by the job's own ingest token (Bearer), not by a tenant API key: the token opens this
one job's ingest endpoint and nothing else. Everything else is in service.jobs.ingest.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.deps import SessionDep, SettingsDep
from api.errors import problems
from service.domain.records import IngestBatch
from service.jobs import ingest

router = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])


@router.post("/{job_id}/ingest", summary="Records from a running job (metrics, memory, checkpoints, result)",
             responses=problems(400, 401, 404, 409, 413, 422, 503))
def ingest_records(job_id: str, batch: IngestBatch, request: Request, session: SessionDep,
                   settings: SettingsDep) -> dict[str, Any]:
    token = ingest.bearer_token(request.headers.get("authorization"))
    return ingest.ingest(session, settings, job_id, token, batch).as_dict()
