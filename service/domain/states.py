"""The job state machine: one enum, one table of allowed moves, one function that writes them.

Every status change in memfit goes through :func:`transition`. It is a single conditional UPDATE
(``… WHERE status IN (allowed sources) [AND attempt = expected]``), so two writers racing on the
same job cannot both win, a terminal status never changes (no move leaves one), and a late writer
holding an old attempt number (a zombie worker, a scheduler that lost its lease) gets
:class:`StaleAttempt` instead of overwriting newer state.

The UPDATE also takes the job's row lock, which the transaction holds until it commits, and the
status event is inserted only after it: like every writer of job events (service.jobs.crud.lock_job_events),
a transition gets its event id only once the job's previous event writer has committed, so a job's
event ids commit in increasing order and a stream following ``id > cursor`` never skips one.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any

from service.domain.errors import InvalidTransition, JobNotFound, StaleAttempt

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from service.store.models import Job


class JobStatus(str, Enum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def can_become(self, to: "JobStatus | str") -> bool:
        return JobStatus(to) in ALLOWED.get(self, frozenset())


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})

S = JobStatus
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    S.validating_files: frozenset({S.queued, S.failed, S.cancelled}),
    S.queued: frozenset({S.running, S.failed, S.cancelled, S.paused}),
    # running -> queued: the scheduler requeues a job whose lease expired or whose Ray job vanished.
    S.running: frozenset({S.succeeded, S.failed, S.cancelled, S.paused, S.queued}),
    S.paused: frozenset({S.queued, S.cancelled}),
    # Terminal statuses have no way out.
}


def sources_of(to: JobStatus) -> list[str]:
    return [s.value for s, targets in ALLOWED.items() if to in targets]


EVENT_MESSAGES = {
    S.queued: "Job queued",
    S.running: "Job started",
    S.paused: "Job paused",
    S.succeeded: "The job has successfully completed",
    S.failed: "The job failed",
    S.cancelled: "Job cancelled",
    S.validating_files: "Validating training file",
}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def transition(
    session: "Session",
    job_id: str,
    to: JobStatus | str,
    *,
    expected_attempt: int | None = None,
    event: bool = True,
    event_data: dict[str, Any] | None = None,
    **fields: Any,
) -> "Job":
    """Move ``job_id`` to ``to`` and set ``fields`` (Job attribute names) in the same UPDATE.

    Raises JobNotFound, StaleAttempt (attempt moved on) or InvalidTransition (the current status
    cannot become ``to``). ``finished_at`` is set on a terminal status unless given. Appends a
    status event unless ``event=False``. The caller commits.
    """
    from sqlalchemy import update

    from service.store.models import Job, JobEvent

    to = JobStatus(to)
    columns = Job.__mapper__.attrs.keys()
    unknown = [k for k in fields if k not in columns or k in ("id", "status", "tenant_id")]
    if unknown:
        raise TypeError(f"transition() cannot set {unknown}")
    now = _now()
    values: dict[str, Any] = {"status": to.value, "updated_at": now, **fields}
    if to.terminal:
        values.setdefault("finished_at", now)
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(sources_of(to)))
    if expected_attempt is not None:
        stmt = stmt.where(Job.attempt == expected_attempt)
    result = session.execute(stmt.values(**values).execution_options(synchronize_session=False))
    if result.rowcount != 1:
        job = session.get(Job, job_id, populate_existing=True)
        if job is None:
            raise JobNotFound(job_id)
        if expected_attempt is not None and job.attempt != expected_attempt:
            raise StaleAttempt(job_id, expected_attempt, job.attempt)
        raise InvalidTransition(job_id, job.status, to.value)
    job = session.get(Job, job_id, populate_existing=True)
    if event:
        # Added after the UPDATE above, which holds the job's row lock: the id comes in commit order.
        data = {"status": to.value, **(event_data or {})}
        session.add(
            JobEvent(
                job_id=job_id,
                level="error" if to == S.failed else "info",
                type="message",
                message=EVENT_MESSAGES[to],
                data=data,
                attempt=job.attempt,
                created_at=now,
            )
        )
    return job
