"""The one function that writes a job status change: a fenced UPDATE plus the status event, following
the moves :data:`service.domain.states.ALLOWED` permits (see service/domain/states.py for why it is
race-free and keeps event ids in commit order)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from service.domain.errors import InvalidTransition, JobNotFound, LeaseLost, StaleAttempt
from service.domain.states import EVENT_MESSAGES, JobStatus, sources_of
from service.store.models import Job, JobEvent, utcnow


def transition(
    session: Session,
    job_id: str,
    to: JobStatus | str,
    *,
    expected_attempt: int | None = None,
    expected_owner: str | None = None,
    event: bool = True,
    event_data: dict[str, Any] | None = None,
    **fields: Any,
) -> Job:
    """Move ``job_id`` to ``to`` and set ``fields`` (Job attribute names) in the same UPDATE.

    Raises JobNotFound, StaleAttempt (attempt moved on), LeaseLost (``expected_owner`` — a
    scheduler — no longer holds the job's lease: another adopted it) or InvalidTransition (the
    current status cannot become ``to``). ``finished_at`` is set on a terminal status unless given. Appends a
    status event unless ``event=False``. The caller commits.
    """
    to = JobStatus(to)
    columns = Job.__mapper__.attrs.keys()
    unknown = [k for k in fields if k not in columns or k in ("id", "status", "tenant_id")]
    if unknown:
        raise TypeError(f"transition() cannot set {unknown}")
    now = utcnow()
    values: dict[str, Any] = {"status": to.value, "updated_at": now, **fields}
    if to.terminal:
        values.setdefault("finished_at", now)
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(sources_of(to)))
    if expected_attempt is not None:
        stmt = stmt.where(Job.attempt == expected_attempt)
    if expected_owner is not None:
        stmt = stmt.where(Job.lease_owner == expected_owner)
    result = session.execute(stmt.values(**values).execution_options(synchronize_session=False))
    if result.rowcount != 1:
        job = session.get(Job, job_id, populate_existing=True)
        if job is None:
            raise JobNotFound(job_id)
        if expected_attempt is not None and job.attempt != expected_attempt:
            raise StaleAttempt(job_id, expected_attempt, job.attempt)
        if expected_owner is not None and job.lease_owner != expected_owner and job.status in sources_of(to):
            raise LeaseLost(job_id, expected_owner, job.lease_owner, job.attempt)
        raise InvalidTransition(job_id, job.status, to.value)
    job = session.get(Job, job_id, populate_existing=True)
    if event:
        # Added after the UPDATE above, which holds the job's row lock: the id comes in commit order.
        data = {"status": to.value, **(event_data or {})}
        session.add(
            JobEvent(
                job_id=job_id,
                level="error" if to == JobStatus.failed else "info",
                type="message",
                message=EVENT_MESSAGES[to],
                data=data,
                attempt=job.attempt,
                created_at=now,
            )
        )
    return job
