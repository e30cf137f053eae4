"""The job state machine: one enum and one table of allowed moves (:data:`ALLOWED`). The one
function that writes a move is :func:`service.store.transitions.transition` (it needs the ORM).

Every status change in memfit goes through that function. It is a single conditional UPDATE
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

from enum import Enum


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
