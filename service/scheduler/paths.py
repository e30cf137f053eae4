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


def attempt_dir(settings: Settings, job_id: str, attempt: int) -> Path:
    """Everything one attempt writes — Ray Train's run storage and checkpoints, the exported model,
    its failure records, the checkpoint it resumed from (``resume/``): a folder of its own, so that
    an earlier attempt still running somewhere (a Ray head restart that lost track of it) cannot
    overwrite or delete what the current one reads or serves. The job's ``output_dir`` points at the
    current attempt's folder, and only records of the current attempt are stored (ingest fencing):
    promoting an attempt's outputs is that one fenced database write."""
    return job_dir(settings, job_id) / "attempts" / str(attempt)


def request_path(settings: Settings, job_id: str, attempt: int) -> Path:
    """Where an attempt's run request lies — it holds the ingest token, so outside the job's output
    folder, in an operator-only folder of the shared storage (every Ray node must read it)."""
    return settings.storage_dir / "requests" / job_id / f"request-attempt-{attempt}.json"


def spool_path(settings: Settings, job_id: str, attempt: int) -> Path:
    """The attempt's record spool (service/store/spool.py), which its metrics sink writes and delivers."""
    return job_dir(settings, job_id) / f"metrics-attempt-{attempt}.jsonl"


