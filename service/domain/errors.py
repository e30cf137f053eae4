"""Domain errors. Service functions raise these; api/errors.py maps each to one HTTP answer.

Every error carries what the HTTP layer needs and nothing HTTP-specific beyond the status number:
a stable machine-readable ``code``, the offending ``param`` (dotted path, or None), optional
``errors`` (several problems reported together) and an OpenAI error ``type``.

:class:`ErrorInfo` is the structured error a failed job stores (``jobs.error``):
``{code, message, param, details}``; a worker's failure adds where it happened
(:class:`FailureInfo`: ``rank``, ``step``, ``phase``).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from service.domain.units import gib

if TYPE_CHECKING:
    from service.domain.plan import Plan


class ErrorInfo(BaseModel):
    """A job's structured error, as ``jobs.error`` stores it: ``error.model_dump(mode="json")``."""

    code: str = Field(description="Stable, machine-readable: insufficient_memory, invalid_file, …")
    message: str
    param: str | None = Field(None, description="The offending field (dotted path), or None.")
    details: dict[str, Any] = Field(default_factory=dict)


class FailureInfo(ErrorInfo):
    """A failure reported by the workers: an ErrorInfo and where it happened."""

    rank: int | None = None
    step: int | None = None
    phase: str | None = None


class DomainError(Exception):
    status: int = 400
    code: str = "invalid_request"
    title: str = "Bad request"
    openai_type: str = "invalid_request_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.errors = errors or []
        self.headers = headers or {}


class BadRequest(DomainError):
    status, code, title = 400, "invalid_request", "Bad request"


class InvalidFile(BadRequest):
    """An uploaded file that is not valid JSONL for fine-tuning; the message names the line."""

    code, title = "invalid_file", "Invalid file"


class Unauthorized(DomainError):
    status, code, title, openai_type = 401, "invalid_api_key", "Unauthorized", "authentication_error"


class NotFound(DomainError):
    status, code, title = 404, "not_found", "Not found"


class JobNotFound(NotFound):
    code, title = "job_not_found", "Job not found"

    def __init__(self, job_id: str, *, param: str | None = None):
        super().__init__(f"No fine-tuning job with id {job_id!r}", param=param)
        self.job_id = job_id


class FileNotFound(NotFound):
    code, title = "file_not_found", "File not found"

    def __init__(self, file_id: str, *, param: str | None = None):
        super().__init__(f"No file with id {file_id!r}", param=param)
        self.file_id = file_id


class Conflict(DomainError):
    status, code, title = 409, "conflict", "Conflict"


class InvalidTransition(Conflict):
    code, title = "invalid_transition", "Invalid state transition"

    def __init__(self, job_id: str, current: str | None, to: str, message: str | None = None):
        super().__init__(message or f"Job {job_id} is {current}; it cannot become {to}")
        self.job_id, self.current, self.to = job_id, current, to


class StaleAttempt(Conflict):
    """A writer holding an old attempt number tried to change a job that has moved on."""

    code, title = "stale_attempt", "Stale attempt"

    def __init__(self, job_id: str, expected: int, actual: int):
        super().__init__(f"Job {job_id} is on attempt {actual}, not {expected}")
        self.job_id, self.expected, self.actual = job_id, expected, actual


# The exit status of a run's driver (workers/run.py) when Ray lost the run under it (EX_TEMPFAIL):
# the scheduler resubmits the job instead of failing it.
RUN_LOST_EXIT_CODE = 75


class LeaseLost(StaleAttempt):
    """A scheduler whose lease on a job expired (and was taken by another) tried to change it: its
    view is out of date, so the write is refused even though the attempt has not moved on."""

    code, title = "lease_lost", "Lease lost"

    def __init__(self, job_id: str, owner: str, holder: str | None, attempt: int):
        Conflict.__init__(self, f"Job {job_id} is leased to {holder or 'nobody'}, not {owner}")
        self.job_id, self.expected, self.actual = job_id, attempt, attempt
        self.owner, self.holder = owner, holder


class IdempotencyInFlight(Conflict):
    code, title, retryable = "idempotency_key_in_use", "Request in progress", True

    def __init__(self, key: str):
        super().__init__(
            f"A request with Idempotency-Key {key!r} is still being processed; retry later",
            param="Idempotency-Key",
            headers={"Retry-After": "1"},
        )


class UnprocessableEntity(DomainError):
    status, code, title = 422, "invalid_value", "Unprocessable entity"


class SpecInvalid(UnprocessableEntity):
    """A job body with one or more problems; all of them are in ``errors``, the first in ``param``."""

    code, title = "invalid_spec", "Invalid job spec"

    def __init__(self, problems: list[dict[str, Any]]):
        first = problems[0] if problems else {"param": None, "message": "invalid job spec"}
        message = "; ".join(f"{p['param']}: {p['message']}" for p in problems) or first["message"]
        super().__init__(message, param=first.get("param"), errors=problems)
        if len(problems) == 1 and problems[0].get("code"):
            self.code = problems[0]["code"]


class IdempotencyMismatch(UnprocessableEntity):
    code, title = "idempotency_key_reused", "Idempotency-Key reused"

    def __init__(self, key: str):
        super().__init__(
            f"Idempotency-Key {key!r} was already used with a different request body",
            param="Idempotency-Key",
        )


class PayloadTooLarge(DomainError):
    status, code, title = 413, "file_too_large", "Payload too large"


class StorageFull(DomainError):
    """The storage volume (settings.storage_dir) has no room left (ENOSPC/EDQUOT) for what was being
    written; nothing half-written is kept. 507 Insufficient Storage, retryable once space is freed."""

    status, code, title, openai_type = 507, "storage_full", "Insufficient storage", "server_error"


class StorageUnavailable(DomainError):
    """The object store (MEMFIT_STORAGE_URL) did not answer or refused the request: 503, retryable;
    nothing was recorded."""

    status, code, title, openai_type, retryable = 503, "storage_unavailable", "Service unavailable", "server_error", True

    def __init__(self, message: str):
        super().__init__(message, headers={"Retry-After": "5"})


class DatabaseUnavailable(DomainError):
    """The database cannot be reached (refused, or closed by a restarting server) by a read that
    goes to the driver directly (service/store/reads.py): 503, retryable, as api/errors.py answers
    SQLAlchemy's disconnects."""

    status, code, title, openai_type, retryable = 503, "database_unavailable", "Service unavailable", "server_error", True
    RETRY_AFTER_S = 2  # a restart of Postgres takes about this long

    def __init__(self, message: str = "The database is unavailable; retry shortly"):
        super().__init__(message, headers={"Retry-After": str(self.RETRY_AFTER_S)})


STORAGE_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_storage_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an out-of-space error: an OSError with errno ENOSPC/EDQUOT, or (pyarrow's
    OSErrors, exceptions re-raised from other processes) one whose text carries strerror(ENOSPC)."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_FULL_ERRNOS:
        return True
    text = str(exc) if exc is not None else ""
    return any(os.strerror(n) in text for n in STORAGE_FULL_ERRNOS)


# Where wrappers keep the exception they wrap: Ray Train's WorkerGroupError (a dict rank → error),
# ControllerError and UserExceptionWithTraceback, Ray's RayTaskError.
_WRAPPED = ("worker_failures", "controller_failure", "_base_exc", "cause")


def find_storage_full(exc: BaseException | None) -> BaseException | None:
    """The first out-of-space error (:func:`is_storage_full`) in ``exc``, its causes and contexts and
    what wrappers hold (see _WRAPPED), OSErrors before texts that only mention one; or None."""
    seen: set[int] = set()
    queue, texts = [exc], []
    while queue:
        e = queue.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_FULL_ERRNOS:
            return e
        if is_storage_full(e):
            texts.append(e)
        queue += [e.__cause__, e.__context__]
        for name in _WRAPPED:
            held = getattr(e, name, None)
            queue += list(held.values()) if isinstance(held, dict) else [held]
    return texts[0] if texts else None


class DoesNotFit(UnprocessableEntity):
    """memory_policy=reject (or auto with nothing to apply) and the predicted per-rank peak is over
    the usable capacity. Carries the plan, its breakdown and the ranked changes that fit."""

    code, title = "insufficient_memory", "Insufficient memory"

    def __init__(self, plan: Plan, *, reason: str = ""):
        where = plan.gpu or "the host memory budget"
        host = plan.host_memory
        host_short = host is not None and host.fits is False
        device_short = plan.margin_bytes is not None and plan.margin_bytes < 0
        message = (f"predicted peak {gib(plan.peak_bytes)} per rank does not fit {where}: "
                   f"{gib(plan.usable_bytes)} usable of {gib(plan.capacity_bytes)} "
                   f"(safety margin {plan.safety_margin:.0%})") if device_short or not host_short else ""
        if host_short:  # service/memory/host.py: the fullest node's RAM
            message += ("; " if message else "") + (
                f"predicted host memory {gib(host.node_need_bytes)} on the fullest node ({host.ranks_on_node} rank(s), "
                f"at {host.node_peak_instant}) does not fit its {gib(host.node_memory_bytes)}: "
                f"{gib(host.node_usable_bytes)} usable (safety margin {plan.safety_margin:.0%}), "
                f"short by {gib(-host.node_margin_bytes)}")
        n = len(plan.suggestions)
        message += (f"; {n} change(s) that fit are in `suggestions`, cheapest first" if n
                    else "; no change the planner knows fits")
        super().__init__(message + reason, param="training")
        self.plan = plan
        stored = plan.model_dump(mode="json")
        details = {"breakdown": stored["per_rank"], "suggestions": stored["suggestions"], "plan": stored}
        # RFC 9457 extension members (api/errors.py adds them to the problem body).
        self.extensions = details
        # What the scheduler stores on the job when validation refuses it (ValidationFailed below).
        self.error = ErrorInfo(code=self.code, message=message, param="training", details=details)


class ValidationFailed(Exception):
    """A job in validating_files fails (service/scheduler/validate.py); ``error`` is what
    ``jobs.error`` stores: ErrorInfo's JSON."""

    def __init__(self, code: str, message: str, param: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, param=param, details=details or {})
        self.error = self.info.model_dump(mode="json")
