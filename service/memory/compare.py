"""Predicted against measured: the plan in the categories the telemetry measures, the steady-state
peaks per rank, the signed errors (GET /v1/fine_tuning/jobs/{id}/memory) and the short memory summary
kept on the job as samples arrive.

Predicted and measured are compared in the categories the telemetry can measure, the way
bench/memory_accuracy.py does: parameters, gradients and optimizer states at their full size on the
rank (device + host), activations (saved for backward), temporary (the rest of the peak) and the
total — the peak of live tensor bytes. On a GPU the plan's ``overhead`` (CUDA context, NCCL buffers,
allocator rounding) is outside what the allocator's tensors show, so the predicted total compared with
the measured peak is the plan's peak minus its overhead. Errors are signed: (predicted − measured) /
measured, negative when the planner under-predicts.

Each measured step is also compared with the plan of its own micro-batches (``steps``:
service/memory/step_compare.py), per rank, with the worst error and whether every step is within the bound;
``predicted_run`` is what the planner said of the run before it started (its peak step, rank and rows).

A plan made with the training file is for that data (the run's worst step: service/memory/steps.py),
and that is what is compared; the same job's bound, every row padded to ``max_seq_length``, is reported
beside it (``predicted_at_max_seq_length``), never compared — real data rarely fills max_seq_length.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from service.domain.plan import COMPARED, JOB_PHASES, MODEL_STATES, read_plan
from service.memory.step_compare import compare_steps, step_planner
from service.store.models import MEMORY_BYTE_COLUMNS

STEADY_STATE_STEP = 3  # the planner predicts a steady-state step: the optimizer states exist from step 2


# --- predicted vs measured ----------------------------------------------------------------------


def predicted_categories(plan: Any) -> dict[str, int] | None:
    """The plan (typed, or as stored) in the measured categories (module docstring): model states at
    full size on the rank, activations, the peak of live tensors (minus the GPU overhead) and the rest
    as temporary."""
    p = read_plan(plan)
    if p is None:
        return None
    d, h, states = p.per_rank.device, p.per_rank.host, p.model_states
    out = {c: getattr(states.device, c) + getattr(states.host, c) for c in MODEL_STATES}
    out["activations"] = d.activations + h.activations
    out["total"] = p.peak_bytes - (d.overhead if p.gpu else 0)
    out["temporary"] = max(0, out["total"] - sum(out[c] for c in (*MODEL_STATES, "activations")))
    return {c: out[c] for c in COMPARED}


def bound_total(plan: Any) -> int | None:
    """The predicted peak of live tensors (as ``predicted_categories``' total) with every row padded to
    max_seq_length; None for a plan stored before plans knew the data."""
    p = read_plan(plan)
    if p is None or p.at_max_seq_length is None:
        return None
    b = p.at_max_seq_length
    return b.peak_bytes - (b.per_rank.device.overhead if p.gpu else 0)


def measured_categories(values: Mapping[str, Any]) -> dict[str, int | None]:
    """One sample's byte columns (MEMORY_BYTE_COLUMNS names) in the compared categories: model states
    device + host, activations, temporary (temporary + other, on a step that measured its peak) and
    the total (the peak)."""
    g = values.get

    def add(*keys):
        vals = [g(k) for k in keys]
        return None if all(v is None for v in vals) else int(sum(v or 0 for v in vals))

    return {
        "parameters": add("parameters_bytes", "host_parameters_bytes"),
        "gradients": add("gradients_bytes", "host_gradients_bytes"),
        "optimizer_states": add("optimizer_bytes", "host_optimizer_bytes"),
        "activations": g("activations_bytes"),
        "temporary": add("temporary_bytes", "other_bytes") if g("peak_bytes") is not None else None,
        "total": g("peak_bytes"),
    }


def _measured(s: Any) -> dict[str, int | None]:
    """One sample (a MemorySample row or MemoryRecord) in the compared categories."""
    return measured_categories({k: getattr(s, k, None) for k in MEMORY_BYTE_COLUMNS})


def _steady(samples: list[Any]) -> list[Any]:
    """The latest attempt's samples, steady-state steps (≥ 3) when there are any."""
    if not samples:
        return []
    attempt = max(s.attempt for s in samples)
    latest = [s for s in samples if s.attempt == attempt]
    return [s for s in latest if s.step >= STEADY_STATE_STEP] or latest


def measured_peaks(samples: Iterable[Any]) -> dict[int, dict[str, int | None]]:
    """Per rank, the highest measured bytes of each category over the steady-state steps."""
    out: dict[int, dict[str, int | None]] = {}
    for s in _steady(list(samples)):
        row = out.setdefault(s.rank, {c: None for c in COMPARED})
        for c, v in _measured(s).items():
            if v is not None and (row[c] is None or v > row[c]):
                row[c] = v
    return out


def signed_error(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def _sample_entry(s: Any) -> dict[str, Any]:
    return {
        "step": s.step, "phase": s.phase, "source": s.source,
        **{f"{c}_bytes": v for c, v in _measured(s).items() if c != "total"},
        "peak_bytes": s.peak_bytes,
        "host_parameters_bytes": s.host_parameters_bytes, "host_gradients_bytes": s.host_gradients_bytes,
        "host_optimizer_bytes": s.host_optimizer_bytes, "process_rss_bytes": s.process_rss_bytes,
        "device": s.device or None,
    }


def bucket_entry(b: Any) -> dict[str, Any]:
    """A rolled-up bucket (service/jobs/series.py) as a sample entry: each byte field is the bucket's
    maximum (a sum of categories, the sum of their maxima), ``rollup`` holds its steps, count, min and last."""
    hi = b.stats.get("max", {})
    return {
        "step": b.first_step, "phase": "rollup", "source": "rollup",
        **{f"{c}_bytes": v for c, v in measured_categories(hi).items() if c != "total"},
        "peak_bytes": hi.get("peak_bytes"),
        "host_parameters_bytes": hi.get("host_parameters_bytes"), "host_gradients_bytes": hi.get("host_gradients_bytes"),
        "host_optimizer_bytes": hi.get("host_optimizer_bytes"), "process_rss_bytes": hi.get("process_rss_bytes"),
        "device": None,
        "rollup": {"from_step": b.first_step, "to_step": b.last_step, "width": b.width, "count": b.count,
                   "min": b.stats.get("min", {}), "max": hi, "last": b.stats.get("last", {})},
    }


def job_memory_view(job, samples: list[Any], *, peaks: dict[int, dict[str, int | None]] | None = None,
                    attempt: int | None = None, buckets: dict[int, list[Any]] | None = None,
                    phase_samples: list[Any] | None = None) -> dict[str, Any]:
    """``GET /v1/fine_tuning/jobs/{id}/memory``: the plan, the samples per rank over steps, the peak per
    category per rank and each predicted category's signed error.

    ``samples`` are raw samples; ``buckets`` ({rank: rolled-up buckets}) come before them in each rank's
    list; ``peaks`` (whole-run, from service/jobs/series.py) replace the peaks of ``samples`` when given,
    and ``attempt`` is the attempt they are of."""
    predicted = predicted_categories(job.plan)
    if peaks is None:
        peaks = measured_peaks(samples)
    if attempt is None:
        attempt = max((s.attempt for s in samples), default=job.attempt)
    by_rank: dict[str, list[dict[str, Any]]] = {}
    for rank, bs in sorted((buckets or {}).items()):
        by_rank[str(rank)] = [bucket_entry(b) for b in bs]
    for s in sorted(samples, key=lambda s: (s.attempt, s.rank, s.step, s.phase)):
        if s.attempt != attempt:
            continue
        by_rank.setdefault(str(s.rank), []).append(_sample_entry(s))
    by_rank = {r: by_rank[r] for r in sorted(by_rank, key=int)}
    # each step against the plan of its own micro-batches (service/memory/step_compare.py)
    steps = compare_steps(step_planner(job.id, getattr(job, "spec", None), job.plan), by_rank)
    errors = {str(r): {c: signed_error((predicted or {}).get(c), m.get(c)) for c in COMPARED} for r, m in peaks.items()}
    rows = {str(r): [{"category": c, "predicted_bytes": (predicted or {}).get(c), "measured_bytes": m.get(c),
                      "error": errors[str(r)][c]} for c in COMPARED] for r, m in sorted(peaks.items())}
    return {
        "object": "fine_tuning.job.memory",
        "job_id": job.id,
        "status": job.status,
        "attempt": attempt,
        "has_plan": predicted is not None,
        "plan": job.plan,
        "predicted": predicted,
        # the bound beside the data's prediction: what every row padded to max_seq_length would peak at
        "predicted_at_max_seq_length": bound_total(job.plan),
        "steady_state_from_step": STEADY_STATE_STEP,
        "samples": by_rank,
        "measured_peaks": {str(r): {c: m.get(c) for c in COMPARED} for r, m in sorted(peaks.items())},
        "errors": errors,
        "per_rank": rows,
        "summary": job.memory_summary or initial_summary(job.plan),
        "error_definition": "(predicted - measured) / measured; negative = under-predicted",
        # load, step, eval, checkpoint, export: planned and measured per rank, and which phase peaks
        "phases": phase_view(job.plan, phase_samples if phase_samples is not None else samples,
                             [s for s in samples if s.phase == "step" and s.attempt == attempt]),
        "steps": steps,
        "predicted_run": (read_plan(job.plan).steps.model_dump(mode="json")
                          if read_plan(job.plan) is not None and read_plan(job.plan).steps is not None else None),
    }


# --- the job's phases: load, step, eval, checkpoint, export --------------------------------------------

MEASURED_PHASES = ("load", "eval", "checkpoint", "export", "sample")  # workers/telemetry.py PhaseMeter's (sample: RL)


def _peak_and_lead(values: dict[str, int | None]) -> tuple[str | None, float | None]:
    """(the phase with the highest value, how far above the next one it is: (peak − second) / second)."""
    known = sorted(((v, k) for k, v in values.items() if v), reverse=True)
    if not known:
        return None, None
    if len(known) == 1 or not known[1][0]:
        return known[0][1], None
    return known[0][1], (known[0][0] - known[1][0]) / known[1][0]


def phase_view(plan: Any, phase_samples: Iterable[Any], step_samples: Iterable[Any] = ()) -> dict[str, Any]:
    """Memory by phase of the job, planned (the plan's ``job_phases``: service/memory/phases.py) and measured
    per rank (workers/telemetry.py PhaseMeter: each phase's host peak — the process's peak resident memory — and
    on a GPU the allocator's device peak; the step's from its samples), with the phase that peaks and by how much
    it is above the next one."""
    p = read_plan(plan)
    planned: dict[str, dict[str, Any]] = {}
    planned_peak: dict[str, Any] = {}
    if p is not None and p.job_phases is not None:
        jp = p.job_phases
        planned = {k: {"device_bytes": v.device_bytes, "host_bytes": v.host_bytes, "fits": v.fits}
                   for k, v in jp.phases.items()}
        for side in ("device", "host"):
            phase, lead = _peak_and_lead({k: v[f"{side}_bytes"] for k, v in planned.items()})
            planned_peak[side] = {"phase": phase, "above_next": lead}
    measured: dict[str, dict[str, dict[str, int | None]]] = {}
    for sm in phase_samples:
        if sm.phase not in MEASURED_PHASES:
            continue
        row = measured.setdefault(str(sm.rank), {}).setdefault(sm.phase, {"host_bytes": None, "device_bytes": None})
        host = sm.process_rss_bytes
        dev = (sm.device or {}).get("max_memory_allocated")
        if host is not None and (row["host_bytes"] is None or host > row["host_bytes"]):
            row["host_bytes"] = int(host)
        if dev is not None and (row["device_bytes"] is None or dev > row["device_bytes"]):
            row["device_bytes"] = int(dev)
    for sm in step_samples:
        row = measured.setdefault(str(sm.rank), {}).setdefault("step", {"host_bytes": None, "device_bytes": None})
        host, dev = sm.process_rss_bytes, ((sm.device or {}).get("max_memory_allocated") if sm.device else None)
        if host is not None and (row["host_bytes"] is None or host > row["host_bytes"]):
            row["host_bytes"] = int(host)
        if dev is not None and (row["device_bytes"] is None or dev > row["device_bytes"]):
            row["device_bytes"] = int(dev)
    measured_peak = {}
    for rank, phases in measured.items():
        measured_peak[rank] = {}
        for side in ("device", "host"):
            phase, lead = _peak_and_lead({k: v[f"{side}_bytes"] for k, v in phases.items()})
            measured_peak[rank][side] = {"phase": phase, "above_next": lead}
    extra = [k for k in planned if k not in JOB_PHASES]  # RL's sample phase (service/memory/rl.py)
    return {"phases": [*JOB_PHASES, *extra], "planned": planned, "planned_peak": planned_peak,
            "measured": {r: measured[r] for r in sorted(measured, key=int)}, "measured_peak": measured_peak,
            "definition": "host: the rank's process at its peak resident memory in the phase (rank 0's export); "
                          "device: GPU memory (planned with the allocator's overhead, measured as "
                          "max_memory_allocated); above_next: (peak − next phase) / next phase"}


def initial_summary(plan: Any) -> dict[str, Any] | None:
    """The short ``memory`` object on a job before anything is measured."""
    p = read_plan(plan)
    if p is None:
        return None
    predicted = predicted_categories(p)
    return {
        "fits": p.fits,
        "gpu": p.gpu,
        "predicted_peak_bytes": p.peak_bytes,
        "predicted_live_peak_bytes": predicted["total"] if predicted else None,
        "predicted_live_peak_at_max_seq_length_bytes": bound_total(p),
        "planned_for_data": bool(p.data and p.data.measured),
        "capacity_bytes": p.capacity_bytes,
        "usable_bytes": p.usable_bytes,
        "measured_peak_bytes": None,
        "measured_rank": None,
        "measured_step": None,
        "measured_attempt": None,
        "error": None,
    }


def summary_fields(job, records: Iterable[Any]) -> dict[str, Any]:
    """``{"memory_summary": …}`` updated with newly ingested samples (steady-state peaks win over
    earlier steps; a newer attempt starts over), or ``{}`` when nothing changes. For ingest."""
    current = dict(job.memory_summary or initial_summary(job.plan) or {
        "fits": None, "gpu": None, "predicted_peak_bytes": None, "predicted_live_peak_bytes": None,
        "capacity_bytes": None, "usable_bytes": None, "measured_peak_bytes": None, "measured_rank": None,
        "measured_step": None, "measured_attempt": None, "error": None})
    changed = False

    def key(attempt, step, peak):  # later attempt, then steady state, then the higher peak
        return (attempt, step >= STEADY_STATE_STEP, peak)

    for r in records:
        if r.peak_bytes is None:
            continue
        new = key(r.attempt, r.step, r.peak_bytes)
        if current.get("measured_peak_bytes") is not None:
            old = key(current["measured_attempt"], current["measured_step"], current["measured_peak_bytes"])
            if new <= old:
                continue
        current.update(measured_peak_bytes=int(r.peak_bytes), measured_rank=r.rank, measured_step=r.step,
                       measured_attempt=r.attempt)
        changed = True
    if not changed:
        return {}
    current["error"] = signed_error(current.get("predicted_live_peak_bytes"), current["measured_peak_bytes"])
    return {"memory_summary": current}


