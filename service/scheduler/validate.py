"""A job in validating_files → queued or failed: its files exist and parse, its model resolves, the
memory pre-flight passes (the same one job creation runs)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from service.domain.errors import ErrorInfo, ValidationFailed
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.spec import JobSpec
from service.domain.storage import StorageEscape, local_path
from service.settings import Settings
from service.store.models import File, Job

# --- validation ---------------------------------------------------------------------------------


def memory_preflight(spec: JobSpec, settings: Settings, model_path: str | None,
                     training_path: str | None = None) -> dict | None:
    """THE MEMORY PRE-FLIGHT HOOK (issue "Memory"). Returns the plan to store on the job, or raises
    ValidationFailed(code="insufficient_memory", …) for a job that would not fit under memory_policy=reject.

    It calls ``service.memory.preflight.preflight`` — the same function job creation calls, so the two agree —
    now with the model directory resolved and the stored training file (the plan is for its rows); a
    refusal (DoesNotFit) carries an ``error`` dict.
    """
    from service.memory import preflight as memory  # the pre-flight, policy included

    try:
        plan = memory.preflight(spec, settings, model_path=model_path, training_path=training_path).plan
    except ValidationFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - the planner's refusal, whatever its class
        error = getattr(exc, "error", None)
        if isinstance(error, ErrorInfo):  # DoesNotFit: the breakdown, the suggestions and the plan
            raise ValidationFailed(error.code, error.message, error.param, error.details) from exc
        code = getattr(exc, "code", None) or "does_not_fit"
        raise ValidationFailed(code, str(exc), getattr(exc, "param", None),
                               {"errors": getattr(exc, "errors", None)} if getattr(exc, "errors", None) else None) from exc
    return plan


def validate_job(session: Session, job: Job, settings: Settings) -> tuple[JobSpec, dict | None]:
    """The validating_files stage. Returns (spec, plan); raises ValidationFailed naming file/line/field."""
    from service.domain.datafmt import DataError, validate_jsonl

    try:
        spec = JobSpec.model_validate(job.spec)
    except Exception as exc:  # noqa: BLE001 - a stored spec that no longer parses
        raise ValidationFailed("invalid_spec", str(exc)) from exc
    paths: dict[str, str] = {}
    for param, file_id in (("training_file", spec.training_file), ("validation_file", spec.validation_file)):
        if file_id is None:
            continue
        row = session.get(File, file_id)
        if row is None or row.tenant_id != job.tenant_id:
            raise ValidationFailed("file_not_found", f"no file {file_id!r}", param)
        try:
            local = local_path(settings, row.path)  # an upload in object storage: its local copy
        except (OSError, StorageEscape):
            local = None
        if local is None or not Path(local).is_file():
            raise ValidationFailed("file_missing", f"the content of {file_id!r} is missing from storage", param)
        try:
            validate_jsonl(local)
        except DataError as exc:
            raise ValidationFailed("invalid_file", f"{row.filename}: {exc}", param,
                                   {"file_id": file_id, "line": exc.line}) from exc
        paths[param] = local
    try:
        model_path = resolve_model(spec.model, settings.model_dirs).local_dir
    except ModelRefError as exc:
        raise ValidationFailed(exc.code, exc.message, exc.param) from exc
    plan = memory_preflight(spec, settings, model_path, paths.get("training_file"))
    return spec, plan


