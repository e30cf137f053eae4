"""Ingest: what a running Ray job reports about itself, turned into job state.

The Ray job's HTTP sink posts :class:`service.domain.records.IngestBatch` bodies with the job's ingest
token (a per-attempt secret the scheduler generated at claim time; only its sha256 is stored on the
job). One batch is one transaction:

- the token must be the job's: no token is a 401; a token for job A on job B is a 404, exactly like an
  unknown job id, so a token reveals nothing about which other jobs exist;
- every record must belong to the job's current attempt and the job must be ``running`` (or
  ``paused``, whose run is winding down): otherwise 409 and nothing changes — a zombie worker from an
  old attempt, or a late post after ``succeeded``/``failed``/``cancelled``, is refused whole;
- storage is idempotent by (job, attempt, rank, step, kind[, phase]): metrics become job events
  (``type: "metrics"``) with a dedupe key, memory samples and checkpoints are insert-or-ignore, so a
  retried post stores nothing twice; what is new (and only that) is folded into the job's bounded
  series (service/jobs/series.py: buckets and whole-run peaks), so a replay counts nothing twice;
- ``trained_tokens`` and ``estimated_finish`` follow the latest metrics; a ``result`` record sets
  ``fine_tuned_model`` and ``result_files`` and moves the job to ``succeeded``; a ``failure`` record
  moves it to ``failed`` with the structured error (code, message, rank, step, phase, details).

:func:`replay` is the second way in: the scheduler stores what a run spooled but never delivered
(the API was away when it ended) under the same rules, without the token.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.domain.errors import (
    Conflict,
    DomainError,
    FailureInfo,
    JobNotFound,
    StaleAttempt,
)
from service.domain.records import (
    CheckpointRecord,
    EventRecord,
    FailureRecord,
    IngestBatch,
    MemoryRecord,
    MetricsRecord,
    Record,
    ResultRecord,
)
from service.domain.states import JobStatus
from service.jobs import metrics, series
from service.jobs.artifacts import output_root
from service.jobs.crud import add_checkpoint, add_event, store_events, store_memory_samples, update_job
from service.memory.compare import summary_fields as memory_summary_fields
from service.memory.downshift import DOWNSHIFT_EVENT
from service.memory.oom import oom_error
from service.settings import Settings
from service.store.models import File, Job, JobEvent, new_id
from service.store.tokens import ingest_token_matches
from service.store.transitions import transition

ACCEPTING = (JobStatus.running.value, JobStatus.paused.value)
_RECORD = TypeAdapter(Record)
log = logging.getLogger("memfit.ingest")


class InvalidIngestToken(DomainError):
    status, code, title, openai_type = 401, "invalid_ingest_token", "Unauthorized", "authentication_error"


class JobNotAccepting(Conflict):
    code, title = "job_not_accepting", "Job does not accept records"


@dataclass
class IngestResult:
    accepted: int
    duplicates: int
    status: str

    def as_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "duplicates": self.duplicates, "status": self.status}


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def ingest(session: Session, settings: Settings, job_id: str, token: str | None, batch: IngestBatch) -> IngestResult:
    """Store one batch for ``job_id`` (see the module docstring). Commits, or raises and changes nothing."""
    if token is None:
        raise InvalidIngestToken("ingest needs the job's ingest token: Authorization: Bearer <token>")
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    if job is None or not ingest_token_matches(token, job.ingest_token_hash):
        raise JobNotFound(job_id)  # another job's token: the same answer as an unknown id
    return _accept(session, settings, job, batch)


def replay(session: Session, settings: Settings, job_id: str, records: list[dict[str, Any]]) -> IngestResult:
    """Store records read back from a run's spool (service/store/spool.py): the scheduler's way in when the
    run ended before its sink could deliver them. No token — the scheduler is trusted and reads the
    attempt's own file — but otherwise exactly ``ingest``: records of another attempt, or for a job
    that accepts no more records, are refused whole (StaleAttempt, JobNotAccepting), and what is
    already stored is not stored again. A record that does not parse is skipped, as the API would."""
    valid = []
    for raw in records:
        try:
            valid.append(_RECORD.validate_python(raw))
        except ValidationError as exc:
            log.warning("job %s: skipping a spooled %s record that does not parse: %s", job_id,
                        raw.get("kind"), "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                   for e in exc.errors()[:3]))
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    if job is None:
        raise JobNotFound(job_id)
    return _accept(session, settings, job, IngestBatch.model_construct(records=valid))


def _accept(session: Session, settings: Settings, job: Job, batch: IngestBatch) -> IngestResult:
    """The fencing and the transaction both ways in share; ``job`` is locked FOR UPDATE."""
    job_id = job.id
    attempts = {r.attempt for r in batch.records}
    stale = sorted(a for a in attempts if a != job.attempt)
    if stale:
        raise StaleAttempt(job_id, stale[0], job.attempt)
    if job.status not in ACCEPTING:
        raise JobNotAccepting(f"Job {job_id} is {job.status}; it accepts no more records")

    try:
        result = _store(session, settings, job, batch)
        session.commit()
        metrics.count_ingested(batch.records)  # /metrics: ingest rate
    except BaseException:
        session.rollback()
        raise
    return result


def _store(session: Session, settings: Settings, job: Job, batch: IngestBatch) -> IngestResult:
    attempt = job.attempt
    new = dup = 0
    events: list[dict[str, Any]] = []
    memory: list[MemoryRecord] = []
    latest: MetricsRecord | None = None
    trained_tokens = job.trained_tokens
    ending: ResultRecord | FailureRecord | None = None

    for r in batch.records:
        if ending is not None:
            break  # nothing after the run's last word belongs to it
        if isinstance(r, MetricsRecord):
            events.append(_metrics_event(r))
            if r.rank == 0 and (latest is None or r.step >= latest.step):
                latest = r
            if r.trained_tokens is not None:
                trained_tokens = max(trained_tokens or 0, r.trained_tokens)
        elif isinstance(r, MemoryRecord):
            memory.append(r)
        elif isinstance(r, CheckpointRecord):
            if add_checkpoint(session, job.id, attempt=attempt, step=r.step, path=r.path, metrics=r.metrics):
                new += 1
                events.append({"message": f"Checkpoint created at step {r.step}", "attempt": attempt,
                               "data": {"step": r.step, "path": r.path, "metrics": r.metrics},
                               "dedupe_key": f"ckpt:{r.step}", "created_at": _ts(r.time)})
            else:
                dup += 1
        elif isinstance(r, EventRecord):
            events.append({"message": r.message, "level": r.level, "data": r.data, "attempt": attempt,
                           "dedupe_key": f"ev:{attempt}:{r.dedupe}" if r.dedupe else None,
                           "created_at": _ts(r.time)})
        elif isinstance(r, (ResultRecord, FailureRecord)):
            ending = r

    if events:
        stored_keys = store_events(session, job.id, events)
        new += len(stored_keys)
        dup += len(events) - len(stored_keys)
        fresh, keys = [], set(stored_keys)
        for e in events:  # a new key's first event is the one stored
            if e.get("type") == "metrics" and e["dedupe_key"] in keys:
                keys.discard(e["dedupe_key"])
                fresh.append(e)
        series.add(session, job.id, series.METRICS,
                   [series.metrics_sample(e["attempt"], e["data"]) for e in fresh if e["data"]["rank"] == 0])
    if memory:
        stored_rows = store_memory_samples(session, job.id, memory)
        new += len(stored_rows)
        dup += len(memory) - len(stored_rows)
        series.add(session, job.id, series.MEMORY, [series.memory_sample(_Row(r)) for r in stored_rows])

    fields: dict[str, Any] = {}
    if memory:
        fields.update(memory_summary_fields(job, memory))  # the job's short predicted-vs-measured summary
    if trained_tokens != job.trained_tokens:
        fields["trained_tokens"] = trained_tokens
    if latest is not None and latest.total_steps:
        fields["estimated_finish"] = _estimate(session, job, latest)

    status = job.status
    if isinstance(ending, ResultRecord):
        if ending.trained_tokens is not None:
            fields["trained_tokens"] = ending.trained_tokens
        results = _write_results_file(session, settings, job, ending)
        transition(
            session, job.id, JobStatus.succeeded, expected_attempt=attempt,
            fine_tuned_model=ending.fine_tuned_model, result_files=[results.id],
            lease_owner=None, desired_state=None, estimated_finish=None,
            **{k: v for k, v in fields.items() if k != "estimated_finish"},
            event_data={"fine_tuned_model": ending.fine_tuned_model,
                        "artifacts": resolve_artifacts(output_root(job, settings), ending.artifacts),
                        "result_files": [results.id]},
        )
        status, new = JobStatus.succeeded.value, new + 1
    elif isinstance(ending, FailureRecord):
        error = FailureInfo(code=ending.code, message=ending.message, param=ending.param, rank=ending.rank,
                            step=ending.step, phase=ending.phase, details=ending.details).model_dump(mode="json")
        if ending.code == "out_of_memory":  # + dominant category and the planner's suggestions
            error = oom_error(job, error, settings)
        if ending.code == "out_of_memory" and downshifts_on_oom(job.spec):
            # training.on_oom: downshift — the run stays ``running`` until Ray says it ended; then the
            # scheduler (service/scheduler/loop.py: _downshift) requeues it with a smaller footprint
            # or fails it with this very error. The event is how the scheduler learns of it.
            add_event(session, job.id, oom_pending_message(error), level="warn", attempt=attempt,
                      data={OOM_EVENT_KEY: error, "attempt": attempt}, dedupe_key=oom_dedupe_key(attempt))
            if fields:
                update_job(session, job.id, expected_attempt=attempt, **fields)
            return IngestResult(accepted=new + 1, duplicates=dup, status=status)
        transition(session, job.id, JobStatus.failed, expected_attempt=attempt, error=error,
                   lease_owner=None, estimated_finish=None,
                   **{k: v for k, v in fields.items() if k != "estimated_finish"},
                   event_data={"error": error})
        status, new = JobStatus.failed.value, new + 1
    elif fields:
        update_job(session, job.id, expected_attempt=attempt, **fields)
    return IngestResult(accepted=new, duplicates=dup, status=status)


# --- training.on_oom: downshift -------------------------------------------------------------------

OOM_EVENT_KEY = "out_of_memory"  # the event data's key that holds the failure's structured error


def downshifts_on_oom(spec: dict[str, Any] | None) -> bool:
    """Whether the stored spec asks for an out-of-memory downshift instead of a failure."""
    return ((spec or {}).get("training") or {}).get("on_oom") == "downshift"


def oom_dedupe_key(attempt: int) -> str:
    """One out-of-memory event per attempt (a retried post, or every rank's failure, stores one)."""
    return f"oom:{attempt}"


def oom_pending_message(error: dict[str, Any]) -> str:
    where = ", ".join(f"{k} {error[k]}" for k in ("rank", "step", "phase") if error.get(k) is not None)
    return (f"Out of memory ({where}): {error.get('message', '')[:300]} — training.on_oom is downshift: once the "
            "run has ended the job resumes from its latest checkpoint with a change that keeps the training the same")


class _Row:
    """A stored row's dict read by attribute (series.memory_sample takes records and rows alike)."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)


def _metrics_event(r: MetricsRecord) -> dict[str, Any]:
    total = f"/{r.total_steps}" if r.total_steps else ""
    parts = [f"Step {r.step}{total}"]
    if r.loss is not None:
        parts.append(f"training loss={r.loss:.4f}")
    if r.eval_loss is not None:
        parts.append(f"validation loss={r.eval_loss:.4f}")
    if r.rank:
        parts.append(f"rank {r.rank}")
    # OpenAI's metrics event keys (step, train_loss, valid_loss, total_steps) plus memfit's.
    data = {
        "step": r.step, "total_steps": r.total_steps, "train_loss": r.loss, "valid_loss": r.eval_loss,
        "rank": r.rank, "epoch": r.epoch, "learning_rate": r.learning_rate, "grad_norm": r.grad_norm,
        "tokens_per_s": r.tokens_per_s, "trained_tokens": r.trained_tokens, "step_time_s": r.step_time_s,
        "time": r.time,
    }
    return {
        "message": ": ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0],
        "type": "metrics",
        "data": {k: v for k, v in data.items() if v is not None},
        "attempt": r.attempt,
        "dedupe_key": f"m:{r.attempt}:{r.rank}:{r.step}",
        "created_at": _ts(r.time),
    }


def _estimate(session: Session, job: Job, latest: MetricsRecord) -> datetime | None:
    """Now + remaining steps × seconds per step, the rate measured over this attempt's rank-0 metrics
    (the first metrics event of the attempt is the start; step_time_s when there is only one)."""
    remaining = max(0, latest.total_steps - latest.step)
    first = session.scalar(
        select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.type == "metrics",
                                    JobEvent.attempt == job.attempt,
                                    JobEvent.dedupe_key.like(f"m:{job.attempt}:0:%"))
        .order_by(JobEvent.id).limit(1)
    )
    per_step = None
    if first and first.get("step") is not None and latest.step > first["step"]:
        per_step = (latest.time - first["time"]) / (latest.step - first["step"])
    elif latest.step_time_s:
        per_step = latest.step_time_s
    if per_step is None or per_step < 0:
        return None
    return _ts(latest.time) + timedelta(seconds=remaining * per_step)


def _write_results_file(session: Session, settings: Settings, job: Job, r: ResultRecord) -> File:
    """OpenAI's result_files are file ids: register a results JSON (model, artifacts, final metrics)
    as a file of the job's tenant with purpose 'fine-tune-results'."""
    out = settings.storage_dir / "jobs" / job.id
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    body = {
        "job_id": job.id, "attempt": job.attempt, "fine_tuned_model": r.fine_tuned_model,
        "artifacts": resolve_artifacts(output_root(job, settings), r.artifacts), "trained_tokens": r.trained_tokens,
        "metrics": r.metrics,
        # what the run that finished ran with (after any out-of-memory downshift), and each downshift
        "training": (job.spec or {}).get("training"),
        "downshifts": [d for d in session.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.dedupe_key.like(f"{DOWNSHIFT_EVENT}:%"))
            .order_by(JobEvent.id))],
    }
    data = json.dumps(body, indent=1, default=str).encode()
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    row = File(id=new_id("file-"), tenant_id=job.tenant_id, filename="results.json",
               purpose="fine-tune-results", bytes=len(data), path=str(path), format=None, rows=None,
               status="processed")
    session.add(row)
    session.flush()
    return row


def resolve_artifacts(job_dir: Path, artifacts: dict[str, str]) -> dict[str, str]:
    """Workers name artifacts relative to the attempt's output folder; users get absolute paths."""
    return {name: str(job_dir / path) if not os.path.isabs(path) else path for name, path in artifacts.items()}


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)
