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
    GRADER_REWARD_PREFIX,
    named_metrics,
)
from service.domain.states import JobStatus
from service.jobs import metrics, series
from service.domain.storage import object_store
from service.jobs.artifacts import output_location, output_root
from service.jobs.claimed_paths import inside
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


def authorize(session: Session, job_id: str, token: str | None) -> int:
    """Whether ``token`` opens ``job_id``'s ingest, answered before a byte of the body is read: the
    job's current attempt when it does; InvalidIngestToken (no token) or JobNotFound (a token of
    another job, or none at all) otherwise. :func:`ingest` checks again, under the row lock."""
    if token is None:
        raise InvalidIngestToken("ingest needs the job's ingest token: Authorization: Bearer <token>")
    row = session.execute(select(Job.ingest_token_hash, Job.attempt).where(Job.id == job_id)).first()
    if row is None or not ingest_token_matches(token, row.ingest_token_hash):
        raise JobNotFound(job_id)  # another job's token: the same answer as an unknown id
    return row.attempt


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


def _claimed_paths(settings: Settings, job: Job, batch: IngestBatch) -> dict[int, Any]:
    """Every path the batch names, checked against the attempt's own folder before anything is stored
    (service/jobs/claimed_paths.py): record index → the checkpoint's relative path, or a result's
    artefacts as relative paths. One path outside refuses the whole batch (422, naming the field)."""
    folder = output_root(job, settings)
    out: dict[int, Any] = {}
    for i, r in enumerate(batch.records):
        if isinstance(r, CheckpointRecord):
            out[i] = inside(folder, r.path, param=f"records[{i}].path")
        elif isinstance(r, ResultRecord):
            out[i] = {name: inside(folder, path, param=f"records[{i}].artifacts.{name}")
                      for name, path in r.artifacts.items()}
    return out


def _store(session: Session, settings: Settings, job: Job, batch: IngestBatch) -> IngestResult:
    attempt = job.attempt
    claimed = _claimed_paths(settings, job, batch)
    new = dup = 0
    events: list[dict[str, Any]] = []
    memory: list[MemoryRecord] = []
    latest: MetricsRecord | None = None
    trained_tokens = job.trained_tokens
    ending: ResultRecord | FailureRecord | None = None

    for i, r in enumerate(batch.records):
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
            # Stored relative to the attempt's folder; the event shows where it is.
            if add_checkpoint(session, job.id, attempt=attempt, step=r.step, path=claimed[i], metrics=r.metrics):
                new += 1
                where = f"{output_location(job, settings)}/{claimed[i]}"
                events.append({"message": f"Checkpoint created at step {r.step}", "attempt": attempt,
                               "data": {"step": r.step, "path": where, "metrics": r.metrics},
                               "dedupe_key": f"ckpt:{r.step}", "created_at": _ts(r.time)})
            else:
                dup += 1
        elif isinstance(r, EventRecord):
            events.append({"message": r.message, "level": r.level, "data": r.data, "attempt": attempt,
                           "dedupe_key": f"ev:{attempt}:{r.dedupe}" if r.dedupe else None,
                           "created_at": _ts(r.time)})
        elif isinstance(r, ResultRecord):
            ending = r.model_copy(update={"artifacts": claimed[i]})
        elif isinstance(r, FailureRecord):
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
    alarm_stop: dict[str, Any] | None = None
    if memory:
        stored_rows = store_memory_samples(session, job.id, memory)
        new += len(stored_rows)
        dup += len(memory) - len(stored_rows)
        series.add(session, job.id, series.MEMORY, [series.memory_sample(_Row(r)) for r in stored_rows])
        alarm_stop = memory_alarms(session, job, attempt, stored_rows)

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
        results = [_write_metrics_csv(session, settings, job), _write_results_file(session, settings, job, ending)]
        transition(
            session, job.id, JobStatus.succeeded, expected_attempt=attempt,
            fine_tuned_model=ending.fine_tuned_model, result_files=[f.id for f in results],
            lease_owner=None, desired_state=None, estimated_finish=None,
            **{k: v for k, v in fields.items() if k != "estimated_finish"},
            event_data={"fine_tuned_model": ending.fine_tuned_model,
                        "artifacts": resolve_artifacts(output_location(job, settings), ending.artifacts),
                        "result_files": [f.id for f in results]},
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
    elif alarm_stop is not None:  # training.memory_alarm: stop — failed now, its run stopped by the scheduler
        error = FailureInfo(code="memory_alarm", message=alarm_stop["message"], rank=alarm_stop["rank"],
                            step=alarm_stop["step"], details=alarm_stop).model_dump(mode="json")
        transition(session, job.id, JobStatus.failed, expected_attempt=attempt, error=error, lease_owner=None,
                   desired_state="cancel", estimated_finish=None,
                   **{k: v for k, v in fields.items() if k != "estimated_finish"}, event_data={"error": error})
        status, new = JobStatus.failed.value, new + 1
    elif fields:
        update_job(session, job.id, expected_attempt=attempt, **fields)
    return IngestResult(accepted=new, duplicates=dup, status=status)


# --- memory alarms (service/memory/alarms.py) ----------------------------------------------------------


def memory_alarms(session: Session, job: Job, attempt: int, stored: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Drift and leak alarms of newly stored step samples, each a job event once per attempt, rank and kind;
    the first alarm's data when the job's ``training.memory_alarm`` is ``stop`` (else None)."""
    from service.domain.plan import read_plan
    from service.domain.spec import JobSpec
    from service.memory import alarms
    from service.memory.step_compare import step_planner
    from service.store.models import MemorySample, MEMORY_BYTE_COLUMNS

    steps = [r for r in stored if r["phase"] == "step"]
    plan = read_plan(job.plan)
    if not steps or plan is None or not job.spec:
        return None
    try:
        spec = JobSpec.model_validate(job.spec)
        sp = step_planner(job.id, spec, plan)
    except Exception:  # noqa: BLE001 - a stored spec or plan the planner cannot read raises no alarm
        return None
    history: dict[int, list[dict[str, Any]]] = {}
    cols = [getattr(MemorySample, c) for c in ("rank", "step", "device", *MEMORY_BYTE_COLUMNS)]
    for rank in {r["rank"] for r in steps}:
        q = (select(*cols).where(MemorySample.job_id == job.id, MemorySample.attempt == attempt,
                                 MemorySample.rank == rank, MemorySample.phase == "step")
             .order_by(MemorySample.step.desc()).limit(alarms.LEAK_HISTORY))
        history[rank] = [dict(row._mapping) for row in session.execute(q)]
    found = alarms.alarms(sp, spec, plan.peak_bytes, steps, history)
    for a in found:
        a["message"] = alarms.message(a)
        add_event(session, job.id, a["message"], level="warn", attempt=attempt, data={"memory_alarm": a},
                  dedupe_key=f"memory-alarm:{attempt}:{a['rank']}:{a['kind']}")
    if found and spec.training.memory_alarm == "stop":
        return found[0]
    return None


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
    for label, value in (("training loss", r.loss), ("training accuracy", r.mean_token_accuracy),
                         ("validation loss", r.eval_loss), ("validation accuracy", r.eval_mean_token_accuracy),
                         ("reward margin", r.reward_margin), ("preference accuracy", r.preference_accuracy),
                         ("mean reward", r.mean_reward), ("validation mean reward", r.eval_mean_reward)):
        if value is not None:
            parts.append(f"{label}={value:.4f}")
    if r.rank:
        parts.append(f"rank {r.rank}")
    # OpenAI's metrics event keys (step, train_loss, train_mean_token_accuracy, valid_loss,
    # valid_mean_token_accuracy, full_valid_*, total_steps) plus memfit's (service/domain/records.py METRIC_NAMES).
    data = {"step": r.step, "total_steps": r.total_steps, "rank": r.rank, "time": r.time, **named_metrics(r)}
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


# OpenAI's result file: a CSV of per-step metrics, this header, a row per step, a cell left empty where the
# step has no value (valid_* only at evaluations). train_accuracy is the step's mean token accuracy.
RESULTS_CSV_NAME = "step_metrics.csv"
RESULTS_CSV_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")
_CSV_SOURCES = ("step", "train_loss", "train_mean_token_accuracy", "valid_loss", "valid_mean_token_accuracy")
# A reinforcement job's columns after OpenAI's (workers/rl.py), then one train_reward_mean/<grader> per grader
RL_CSV_COLUMNS = ("train_reward_mean", "train_reward_std", "valid_reward_mean", "train_kl", "train_sample_tokens_mean",
                  "train_grader_error_rate")


def metrics_csv(session: Session, job_id: str) -> str:
    """The job's per-step metrics as OpenAI's result CSV, from its rank-0 metrics events; a step run again
    after a restart keeps the value of its last run."""
    import csv
    import io

    rows: dict[int, dict[str, Any]] = {}
    for data in session.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                                .order_by(JobEvent.id)):
        if data and data.get("rank") == 0 and data.get("step") is not None:
            rows[int(data["step"])] = data
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    rl = any("train_reward_mean" in d for d in rows.values())
    graders = sorted({k for d in rows.values() for k in d if k.startswith(GRADER_REWARD_PREFIX)})
    writer.writerow([*RESULTS_CSV_COLUMNS, *(RL_CSV_COLUMNS if rl else ()), *graders])
    for step in sorted(rows):
        d = rows[step]
        cells = [d.get(k) for k in _CSV_SOURCES] + ([d.get(k) for k in RL_CSV_COLUMNS] if rl else [])
        cells += [d.get(g) for g in graders]
        writer.writerow(["" if v is None else v for v in cells])
    return out.getvalue()


def _register_result(session: Session, settings: Settings, job: Job, name: str, data: bytes) -> File:
    """A result file of the job, written whole (atomically) and registered as a file of its tenant with
    purpose 'fine-tune-results' (OpenAI's result_files are file ids)."""
    out = settings.storage_dir / "jobs" / job.id
    path = out / name
    store = object_store(settings)
    if store is not None:  # the same key in the bucket (service/domain/storage.py)
        key = store.key_for(settings.storage_dir, path)
        store.put_bytes(key, data)
        stored = store.uri(key)
    else:
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        stored = str(path)
    row = File(id=new_id("file-"), tenant_id=job.tenant_id, filename=name, purpose="fine-tune-results",
               bytes=len(data), path=stored, format=None, rows=None, status="processed")
    session.add(row)
    session.flush()
    return row


def _write_metrics_csv(session: Session, settings: Settings, job: Job) -> File:
    """OpenAI's result file (the first of result_files): per-step metrics as CSV."""
    return _register_result(session, settings, job, RESULTS_CSV_NAME, metrics_csv(session, job.id).encode())


def _write_results_file(session: Session, settings: Settings, job: Job, r: ResultRecord) -> File:
    """memfit's result file (the second of result_files): results.json — the model's name, its artefacts,
    the final metrics, what the run ran with and each out-of-memory downshift."""
    body = {
        "job_id": job.id, "attempt": job.attempt, "fine_tuned_model": r.fine_tuned_model,
        "artifacts": resolve_artifacts(output_location(job, settings), r.artifacts), "trained_tokens": r.trained_tokens,
        "metrics": r.metrics,
        # what the run that finished ran with (after any out-of-memory downshift), and each downshift
        "training": (job.spec or {}).get("training"),
        "downshifts": [d for d in session.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.dedupe_key.like(f"{DOWNSHIFT_EVENT}:%"))
            .order_by(JobEvent.id))],
    }
    return _register_result(session, settings, job, "results.json", json.dumps(body, indent=1, default=str).encode())


def resolve_artifacts(job_dir: str | Path, artifacts: dict[str, str]) -> dict[str, str]:
    """Artefacts are stored relative to the attempt's output folder (checked by _claimed_paths); users
    get absolute paths (``s3://`` URIs on object storage)."""
    return {name: f"{str(job_dir).rstrip('/')}/{path}" if not os.path.isabs(path) else path
            for name, path in artifacts.items()}


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)
