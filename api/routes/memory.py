"""Memory truth over HTTP (issue 5): plan a job without creating it, and predicted vs measured for a job.

- ``POST /v1/memory/plan`` takes the job-creation body (``training_file`` optional: given, the plan is
  for that file's rows, with the bound at ``max_seq_length`` beside it; another tenant's file is 404) and answers the
  plan (service.memory.preflight.plan_for_spec; its schema: service.domain.plan.Plan): ``fits``,
  parameter counts, per-rank device/host bytes by category, capacity, margin, assumptions and the
  ranked ``suggestions`` that fit. The GPU planned
  against is the query parameter ``gpu`` (a catalogue name such as ``a100-40gb``) when given, else the
  body's ``training.resources.gpu_type``; with neither, a CPU worker (its host memory budget, if any).
  The body stays exactly a create body, so the same JSON can be POSTed to /v1/fine_tuning/jobs.
- ``GET /v1/fine_tuning/jobs/{id}/memory``: the job's plan, its memory samples per rank over steps,
  the steady-state peak per category per rank over the whole run and the signed error of each
  predicted category. However long the job, each rank's ``samples`` are at most ~500: its last steps in
  full, older steps as buckets (``phase: "rollup"``, each byte field the bucket's max, ``rollup`` its
  steps, count, min and last; service/jobs/series.py). Another tenant's job is 404.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request

from api.deps import PrincipalDep, ReadSessionDep, SettingsDep
from api.errors import BY_ID, problems
from service.domain.plan import Plan
from service.jobs import crud
from service.jobs.crud import get_job_memory

router = APIRouter(tags=["memory"])


@router.post("/v1/memory/plan", summary="Predict a job's per-rank memory without creating it", response_model=Plan,
             responses=problems(400, 401, 404, 413, 422, 429, 503),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/JobSpec"}}}}})  # api/app.py adds JobSpec
def plan_memory(
    request: Request,
    session: ReadSessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    body: Annotated[Any, Body(description="The job-creation body (JobSpec); training_file is optional.")],
    gpu: Annotated[str | None, Query(description="Plan for this GPU (catalogue name, e.g. a100-40gb) "
                                                 "instead of training.resources.gpu_type.")] = None,
) -> Plan:
    return crud.plan_memory(session, principal, settings, body, gpu=gpu, known_gpus=request.app.state.known_gpus)


@router.get("/v1/fine_tuning/jobs/{job_id}/memory", tags=["fine-tuning"], responses=problems(*BY_ID),
            summary="Predicted vs measured memory per rank and category")
def job_memory(job_id: str, session: ReadSessionDep, principal: PrincipalDep) -> dict[str, Any]:
    return get_job_memory(session, principal, job_id)
