"""Where an attempt lives on disk and in Ray: the job folder, the run request, the record spool, the
Ray submission id — shared by the scheduler, the ingest and the workers' sink."""

from __future__ import annotations

from pathlib import Path

from service.settings import Settings

INGEST_PATH = "/v1/internal/jobs/{job_id}/ingest"


def submission_id(job_id: str, attempt: int) -> str:
    return f"memfit-{job_id}-{attempt}"


def job_dir(settings: Settings, job_id: str) -> Path:
    """The job's output folder: checkpoints, artifacts, the run's spool. Tenants read a part of it
    (service.jobs.artifacts' allowlist), so nothing secret is written here."""
    return settings.storage_dir / "jobs" / job_id


def request_path(settings: Settings, job_id: str, attempt: int) -> Path:
    """Where an attempt's run request lies — it holds the ingest token, so outside the job's output
    folder, in an operator-only folder of the shared storage (every Ray node must read it)."""
    return settings.storage_dir / "requests" / job_id / f"request-attempt-{attempt}.json"


def spool_path(settings: Settings, job_id: str, attempt: int) -> Path:
    """The attempt's record spool (service/store/spool.py), which its metrics sink writes and delivers."""
    return job_dir(settings, job_id) / f"metrics-attempt-{attempt}.jsonl"


