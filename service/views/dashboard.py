"""What the dashboard pages show, assembled from the store (no HTTP here).

- :func:`job_rows`: the jobs list (status, model, strategy, progress, peak memory vs capacity, age);
- :func:`job_view`: one job's page data — loss/eval-loss and tokens/s per step, memory per category
  over steps for each rank, predicted against measured per category with the error, the plan's
  suggestions, events, checkpoints and the files under the job's output directory;
- :func:`memory_samples_after`: memory points newer than a sample id (the page's live updates).

Every list the job page reads is bounded whatever the job's length: the newest events, rank 0's
metrics and each rank's memory from service/jobs/series.py (the last steps at full resolution, older
ones as min / max / last buckets), the peaks from the series' whole-run heads.

Memory categories are service/domain/plan.py's CHARTED: parameters, gradients, optimizer states,
activations and other. ``other`` in the charts is ``temporary_bytes + other_bytes`` of a sample,
temporary + overhead of a plan. Plans are read typed (``Plan``), stored or computed.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.domain.plan import CHARTED, COMPARED, LABELS, Plan, Suggestion, read_plan
from service.jobs import artifacts, series
from service.jobs.crud import get_job, list_jobs
from service.settings import Settings
from service.store.auth import Principal
from service.store.models import Checkpoint, Job, JobEvent, MemorySample, SeriesHead, SeriesRollup, utcnow

# The charts' categories and their labels: service/domain/plan.py, the one list.
CATEGORIES = CHARTED
CATEGORY_LABELS = {c: LABELS[c] for c in CHARTED}
MAX_FILES = artifacts.MAX_FILES
EVENTS_SHOWN = 300  # the job page's events table: the newest, then live
CHECKPOINTS_SHOWN = 100


def plan_capacity(plan: Plan | None) -> tuple[int | None, str | None]:
    """(the capacity a plan was planned against, the GPU's name); (None, None) for an informative plan."""
    if plan is None or not plan.capacity_bytes:
        return None, None
    return plan.capacity_bytes, plan.gpu


def suggestion_rows(suggestions: list[Suggestion]) -> list[dict]:
    """What the pages list of each suggestion: what it changes, its predicted peak, whether it fits."""
    return [{"change": s.description or s.change, "predicted_peak_bytes": s.predicted_peak_bytes or None,
             "fits": s.fits} for s in suggestions]


def error_suggestions(error: dict | None) -> list[Suggestion]:
    """The suggestions a job's error carries (out of memory, insufficient memory), typed."""
    details = (error or {}).get("details") or {}
    try:
        return [Suggestion.model_validate(s) for s in details.get("suggestions") or []]
    except ValueError:  # not the planner's suggestions: show none rather than fail the page
        return []


_PLANS: dict[str, Plan | None] = {}


def _plan_now(spec_json: str, settings: Settings) -> Plan | None:
    if spec_json in _PLANS:
        return _PLANS[spec_json]
    try:
        from service.domain.spec import JobSpec
        from service.memory.preflight import plan_for_spec

        plan = plan_for_spec(JobSpec.model_validate_json(spec_json), settings)
    except Exception:  # noqa: BLE001 - no planner, or a model whose shape it cannot read: no prediction
        plan = None
    if len(_PLANS) > 256:
        _PLANS.clear()
    _PLANS[spec_json] = plan
    return plan


def plan_of(job: Job, settings: Settings) -> tuple[Plan | None, str | None]:
    """(the plan, where it came from): the one stored at validation, else the planner run now on the
    job's spec (pure arithmetic, cached per spec), else (None, None)."""
    if job.plan is not None:
        stored = read_plan(job.plan)
        return (stored, "stored") if stored is not None else (None, None)
    plan = _plan_now(json.dumps(job.spec, sort_keys=True), settings)
    return (plan, "computed") if plan is not None else (None, None)


def capacity_for(job: Job, spec_training: dict) -> tuple[int | None, str | None]:
    """What a rank's memory is compared with: the GPU's capacity (plan, then spec.gpu_type), or a CPU
    worker's host memory budget; (None, None) for a CPU worker without one."""
    cap, label = plan_capacity(read_plan(job.plan))
    if cap:
        # A plan without a GPU was planned against the CPU worker's host memory budget.
        return cap, f"{label} capacity" if label else "host memory budget"
    res = spec_training.get("resources") or {}
    if res.get("gpu_type"):
        try:
            from service.memory.gpus import get_gpu

            gpu = get_gpu(res["gpu_type"])
            return gpu.capacity_bytes, f"{gpu.display} capacity"
        except Exception:  # noqa: BLE001 - an unknown name shows no line rather than failing the page
            pass
    if res.get("host_memory_budget_bytes"):
        return int(res["host_memory_budget_bytes"]), "host memory budget"
    return None, None


# --- samples ------------------------------------------------------------------------------------


def step_predictor(job: Any):
    """(rank, a sample's micro-batches) → the predicted live peak of that step (service/memory/step_compare.py),
    for the chart's predicted line; None where the job's plan cannot say."""
    from service.memory.step_compare import predicted_step, step_planner

    try:
        sp = step_planner(job.id, job.spec, job.plan)
    except Exception:  # noqa: BLE001 - a stored spec or plan the planner cannot read: no predicted line
        sp = None
    if sp is None:
        return None
    return lambda rank, micro_batches: predicted_step(sp, rank, micro_batches)


def sample_point(s: MemorySample, predict=None) -> dict[str, Any]:
    other = None
    if s.temporary_bytes is not None or s.other_bytes is not None:
        other = (s.temporary_bytes or 0) + (s.other_bytes or 0)
    return {
        "id": s.id, "attempt": s.attempt, "rank": s.rank, "step": s.step, "phase": s.phase, "source": s.source,
        "parameters": s.parameters_bytes, "gradients": s.gradients_bytes, "optimizer_states": s.optimizer_bytes,
        "activations": s.activations_bytes, "other": other, "peak": s.peak_bytes, "rss": s.process_rss_bytes,
        "host": {"parameters": s.host_parameters_bytes, "gradients": s.host_gradients_bytes,
                 "optimizer_states": s.host_optimizer_bytes},
        # the plan of this step's own micro-batches (the chart's predicted line)
        "predicted": predict(s.rank, (s.device or {}).get("micro_batches")) if predict is not None else None,
    }


def bucket_point(b: SeriesRollup) -> dict[str, Any]:
    """A rolled-up bucket of the memory series as a chart point: each category's maximum in the bucket."""
    hi = b.stats.get("max", {})
    other = None
    if hi.get("temporary_bytes") is not None or hi.get("other_bytes") is not None:
        other = (hi.get("temporary_bytes") or 0) + (hi.get("other_bytes") or 0)
    return {
        "id": None, "attempt": b.attempt, "rank": b.rank, "step": b.first_step, "phase": "rollup", "source": "rollup",
        "parameters": hi.get("parameters_bytes"), "gradients": hi.get("gradients_bytes"),
        "optimizer_states": hi.get("optimizer_bytes"), "activations": hi.get("activations_bytes"), "other": other,
        "peak": hi.get("peak_bytes"), "rss": hi.get("process_rss_bytes"),
        "host": {"parameters": hi.get("host_parameters_bytes"), "gradients": hi.get("host_gradients_bytes"),
                 "optimizer_states": hi.get("host_optimizer_bytes")},
        "rollup": {"from_step": b.first_step, "to_step": b.last_step, "count": b.count},
    }


def memory_samples_after(session: Session, job_id: str, after_id: int = 0, limit: int = 1000, job=None) -> list[dict]:
    """Step-phase samples (one per rank per sampled step) newer than ``after_id``, oldest first: the
    page's live updates, one page of ``limit`` at a time (with ``job``, each with its step's prediction)."""
    q = (select(MemorySample).where(MemorySample.job_id == job_id, MemorySample.id > after_id,
                                    MemorySample.phase == "step")
         .order_by(MemorySample.id).limit(limit))
    predict = step_predictor(job) if job is not None else None
    return [sample_point(s, predict) for s in session.scalars(q)]


def memory_chart(session: Session, job_id: str, hs: list[SeriesHead], job=None) -> tuple[list[dict], int]:
    """(the latest attempt's chart points per rank — at most series.MAX_BUCKETS buckets, then the last
    series.RECENT_STEPS steps' step-phase samples — by rank and step; the newest sample id)."""
    attempt = series.latest_attempt(hs)
    if attempt is None:
        return [], 0
    buckets, raw = series.memory_points(session, job_id, attempt, hs, phase="step")
    predict = step_predictor(job) if job is not None else None
    points = [bucket_point(b) for bs in buckets.values() for b in bs] + [sample_point(s, predict) for s in raw]
    points.sort(key=lambda p: (p["rank"], p["step"]))
    return points, max((s.id for s in raw), default=0)


COMPARED_LABELS = {c: LABELS[c] for c in COMPARED}


def compare_job(session: Session, job: Job, plan: Plan | None, hs: list[SeriesHead]) -> dict[str, Any]:
    """Predicted vs measured per rank and category, with the signed error: service.memory's view (the
    same numbers as GET /v1/fine_tuning/jobs/{id}/memory, whole-run peaks), for ``plan`` when the job
    stored none."""
    from types import SimpleNamespace

    from service.memory.compare import job_memory_view

    view_job = SimpleNamespace(id=job.id, status=job.status, attempt=job.attempt,
                               plan=plan.model_dump(mode="json") if plan is not None else None,
                               memory_summary=job.memory_summary)
    from service.jobs.crud import phase_samples

    attempt, peaks = series.memory_peaks(hs)  # the page charts the points itself: only the peaks here
    phases, steps = [], []
    if attempt is not None:
        phases = phase_samples(session, job.id, attempt)
        steps = series.memory_points(session, job.id, attempt, hs, phase="step")[1]
    view = job_memory_view(view_job, steps, peaks=peaks, attempt=attempt, phase_samples=phases)
    per_rank = {r: [{**row, "label": COMPARED_LABELS.get(row["category"], row["category"])} for row in rows]
                for r, rows in view["per_rank"].items()}
    data = plan.data if plan is not None else None
    return {"has_plan": view["has_plan"], "predicted": view["predicted"], "per_rank": per_rank, "phases": view["phases"],
            "steady_state_from_step": view["steady_state_from_step"], "error_definition": view["error_definition"],
            # what the prediction was made for, and the bound beside it (service/memory/data.py)
            "data_measured": bool(data and data.measured), "data_reason": data.reason if data else None,
            "predicted_at_max_seq_length": view["predicted_at_max_seq_length"],
            "max_seq_length": data.max_seq_length if data else None}


# --- files --------------------------------------------------------------------------------------


# What of the output folder a tenant may see is service.jobs.artifacts' allowlist, in one place.
output_root = artifacts.output_root
list_output_files = artifacts.list_artifacts
output_file = artifacts.artifact_file
FileNotInJob = artifacts.FileNotInJob


# --- the job page -------------------------------------------------------------------------------


def _age_s(ts: datetime | None) -> float | None:
    return (utcnow() - ts).total_seconds() if ts else None


def job_view(session: Session, principal: Principal, settings: Settings, job_id: str) -> dict[str, Any]:
    """Everything the job page shows (JSON-serialisable); JobNotFound for another tenant's job."""
    job = get_job(session, principal, job_id)
    spec = job.spec or {}
    training = spec.get("training") or {}
    # The newest EVENTS_SHOWN events; the SSE stream carries on from the newest.
    events = list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id)
                                  .order_by(JobEvent.id.desc()).limit(EVENTS_SHOWN)))[::-1]
    metrics = series.metric_points(session, job_id)  # rank 0's, bounded whatever the run's length
    steps = sorted(metrics)
    hs = series.heads(session, job_id, series.MEMORY)
    samples, last_sample_id = memory_chart(session, job_id, hs, job)
    capacity, capacity_label = capacity_for(job, training)
    plan, plan_source = plan_of(job, settings)
    comparison = compare_job(session, job, plan, hs)
    ranks = sorted({s["rank"] for s in samples})
    checkpoints = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                                       .order_by(Checkpoint.step.desc()).limit(CHECKPOINTS_SHOWN)))[::-1]
    last = metrics[steps[-1]] if steps else {}
    return {
        "job": {
            "id": job.id, "status": job.status, "model": job.model, "attempt": job.attempt,
            "strategy": training.get("strategy"), "peft": (training.get("peft") or {}).get("method"),
            "precision": training.get("precision"), "gradient_checkpointing": training.get("gradient_checkpointing"),
            "num_workers": (training.get("resources") or {}).get("num_workers"),
            "created_at": job.created_at.timestamp() if job.created_at else None,
            "finished_at": job.finished_at.timestamp() if job.finished_at else None,
            "estimated_finish": job.estimated_finish.timestamp() if job.estimated_finish else None,
            "fine_tuned_model": job.fine_tuned_model, "trained_tokens": job.trained_tokens,
            "error": job.error, "desired_state": job.desired_state,
            "step": last.get("step"), "total_steps": last.get("total_steps"),
        },
        "metrics": {
            "steps": steps,
            "loss": [metrics[s].get("train_loss") for s in steps],
            "eval_loss": [metrics[s].get("valid_loss") for s in steps],
            "tokens_per_s": [metrics[s].get("tokens_per_s") for s in steps],
        },
        "memory": {
            "categories": list(CATEGORIES),
            "labels": CATEGORY_LABELS,
            "capacity_bytes": capacity,
            "capacity_label": capacity_label,
            "ranks": ranks,
            "samples": samples,
            "last_sample_id": last_sample_id,
        },
        "comparison": {**comparison, "plan_source": plan_source if comparison["has_plan"] else None},
        # An out-of-memory failure carries the planner's suggestions for the run that failed; else the plan's.
        "suggestions": suggestion_rows(error_suggestions(job.error) or (plan.suggestions if plan else [])),
        "plan": plan.model_dump(mode="json") if plan is not None else None,
        "events": [{"id": e.id, "created_at": e.created_at.timestamp(), "level": e.level, "type": e.type,
                    "message": e.message} for e in events],
        "last_event_id": events[-1].id if events else 0,
        "checkpoints": [{"step": c.step, "path": c.path, "metrics": c.metrics or {}, "attempt": c.attempt}
                        for c in checkpoints],
        "files": list_output_files(job, settings),
    }


def job_rows(session: Session, principal: Principal, *, status: str | None = None, limit: int = 50) -> list[dict]:
    """The jobs list: newest first, with progress and peak memory vs capacity per job."""
    jobs = list_jobs(session, principal, limit=limit, status=status or None)
    ids = [j.id for j in jobs]
    peaks: dict[str, int] = {}
    if ids:  # the memory series' heads: a few rows per job, not its samples
        q = select(SeriesHead.job_id, SeriesHead.peaks).where(SeriesHead.job_id.in_(ids),
                                                                SeriesHead.series == series.MEMORY)
        for job_id, p in session.execute(q):
            total = ((p or {}).get("any") or {}).get("total") or 0
            peaks[job_id] = max(peaks.get(job_id, 0), int(total))
    rows = []
    for j in jobs:
        training = (j.spec or {}).get("training") or {}
        last = session.scalar(
            select(JobEvent.data).where(JobEvent.job_id == j.id, JobEvent.type == "metrics")
            .order_by(JobEvent.id.desc()).limit(1))
        cap, cap_label = capacity_for(j, training)
        rows.append({
            "id": j.id, "status": j.status, "model": j.model, "strategy": training.get("strategy"),
            "peft": (training.get("peft") or {}).get("method"),
            "step": (last or {}).get("step"), "total_steps": (last or {}).get("total_steps"),
            "peak_bytes": peaks.get(j.id) or None, "capacity_bytes": cap, "capacity_label": cap_label,
            "age_s": _age_s(j.created_at), "created_at": j.created_at.timestamp() if j.created_at else None,
        })
    return rows
