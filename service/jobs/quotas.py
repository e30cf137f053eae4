"""Per-tenant quotas (OWASP API4): jobs waiting, jobs running at once, bytes stored (uploads, checkpoints, exports).

Each quota is a ``quota_*`` setting (0 turns it off). Creating a job or uploading a file past its
quota is :class:`QuotaExceeded` (429, the quota's name, limit and current use in the message); the
running cap is not an error but a rule of the scheduler's claim (:func:`claimable`, :func:`may_start`):
a tenant's jobs past it stay queued, and the claim moves on to other tenants' jobs.

On Postgres each check takes a transaction-scoped advisory lock on (quota, tenant), so two API
replicas (or two schedulers) cannot both see "one below the limit" and both go past it; the lock
ends with the caller's commit. SQLite has one writer at a time and needs none.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import ColumnElement, func, select, text, true
from sqlalchemy.orm import Session, aliased

from service.domain.disk import folder_bytes
from service.domain.errors import DomainError
from service.domain.states import JobStatus
from service.domain.storage import object_store
from service.settings import Settings
from service.store.models import File, Job

RESULTS_PURPOSE = "fine-tune-results"
# Not terminal and not running: what a tenant has waiting for the cluster (a paused job resumes to queued).
WAITING = (JobStatus.validating_files.value, JobStatus.queued.value, JobStatus.paused.value)


class QuotaExceeded(DomainError):
    """429: the tenant is at one of its quotas. ``quota`` names it; ``limit`` and ``used`` are numbers."""

    status, code, title, openai_type = 429, "quota_exceeded", "Quota exceeded", "rate_limit_error"

    def __init__(self, quota: str, *, limit: int, used: int, message: str, param: str | None = None):
        super().__init__(message, param=param, code=f"{quota}_quota_exceeded")
        self.quota, self.limit, self.used = quota, limit, used
        self.extensions = {"quota": {"name": quota, "limit": limit, "used": used}}


def _lock(session: Session, quota: str, tenant_id: str, *, wait: bool = True) -> bool:
    """Postgres: the (quota, tenant) advisory lock until the transaction ends. ``wait=False`` tries
    once and says whether it got it (the scheduler's claim skips a tenant it cannot lock)."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    key = int.from_bytes(hashlib.sha256(f"memfit-quota:{quota}:{tenant_id}".encode()).digest()[:8], "big", signed=True)
    if wait:
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        return True
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": key}))


def check_queued(session: Session, tenant_id: str, settings: Settings) -> None:
    """Before a new job is stored: QuotaExceeded when the tenant already has quota_queued_jobs waiting."""
    limit = settings.quota_queued_jobs
    if not limit:
        return
    _lock(session, "queued_jobs", tenant_id)
    used = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status.in_(WAITING))
    ) or 0
    if used >= limit:
        raise QuotaExceeded(
            "queued_jobs", limit=limit, used=used,
            message=f"queued jobs quota exceeded: the tenant has {used} of at most {limit} jobs waiting "
                    f"(validating_files, queued or paused; MEMFIT_QUOTA_QUEUED_JOBS); "
                    "cancel one or wait for one to start",
        )


def storage_used(session: Session, tenant_id: str, settings: Settings) -> int:
    """What the tenant keeps on the shared volume: its uploaded files, and everything its jobs wrote
    (checkpoints of every attempt, exported models, results) measured on disk."""
    uploads = session.scalar(select(func.coalesce(func.sum(File.bytes), 0)).where(
        File.tenant_id == tenant_id, File.purpose != RESULTS_PURPOSE)) or 0  # results.json lies in the job's folder
    seen: set[tuple[int, int]] = set()
    jobs = session.scalars(select(Job.id).where(Job.tenant_id == tenant_id)).all()
    store = object_store(settings)
    if store is not None:  # in the bucket (a staged resume is a copy there, counted as such)
        return int(uploads) + sum(store.bytes_under(f"jobs/{job_id}") for job_id in jobs)
    return int(uploads) + sum(folder_bytes(settings.storage_dir / "jobs" / job_id, seen) for job_id in jobs)


def check_storage(session: Session, tenant_id: str, settings: Settings, *, adding_bytes: int) -> None:
    """Before an upload of ``adding_bytes`` is recorded: QuotaExceeded when the tenant's storage (its
    files and its jobs' checkpoints and exports) would then hold more than quota_storage_bytes."""
    limit = settings.quota_storage_bytes
    if not limit:
        return
    _lock(session, "storage", tenant_id)
    used = storage_used(session, tenant_id, settings)
    if used + adding_bytes > limit:
        raise QuotaExceeded(
            "storage", limit=limit, used=int(used), param="file",
            message=f"storage quota exceeded: the tenant's files, checkpoints and exports hold {used} of at most "
                    f"{limit} bytes (MEMFIT_QUOTA_STORAGE_BYTES) and this file adds {adding_bytes}; delete files "
                    "or finished jobs' outputs to make room",
        )


def storage_budget(session: Session, tenant_id: str, settings: Settings) -> int | None:
    """How many bytes a new attempt of one of the tenant's jobs may write (its checkpoints and exports)
    before the tenant passes quota_storage_bytes; None without a quota. The scheduler gives it to the
    run (MEMFIT_STORAGE_BUDGET_BYTES), whose workers check it before each checkpoint and export."""
    limit = settings.quota_storage_bytes
    if not limit:
        return None
    return max(0, limit - storage_used(session, tenant_id, settings))


def claimable(settings: Settings) -> ColumnElement[bool]:
    """The claim's filter on queued jobs: not of a tenant already running quota_running_jobs, so a
    tenant at its cap does not keep other tenants' jobs out of the claim's batch."""
    limit = settings.quota_running_jobs
    if not limit:
        return true()
    running = aliased(Job)
    at_cap = (
        select(running.tenant_id)
        .where(running.status == JobStatus.running.value)
        .group_by(running.tenant_id)
        .having(func.count() >= limit)
    )
    return Job.tenant_id.not_in(at_cap)


def may_start(session: Session, tenant_id: str, settings: Settings) -> bool:
    """In the claim's transaction, before one of ``tenant_id``'s queued jobs becomes running: whether
    the tenant is below quota_running_jobs, counting the jobs this transaction already claimed.
    False also when another claimer holds the tenant's lock: its job waits for the next claim."""
    limit = settings.quota_running_jobs
    if not limit:
        return True
    if not _lock(session, "running_jobs", tenant_id, wait=False):
        return False
    running = session.scalar(
        select(func.count()).select_from(Job)
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.running.value)
    ) or 0
    return running < limit
