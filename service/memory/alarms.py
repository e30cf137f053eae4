"""Drift and leak alarms: a rank whose memory departs from its plan, or grows from step to step.

- **drift**: a traced step whose measured peak is above the plan of its own micro-batches (service/memory/
  step_compare.py) by more than the strategy's measured under-prediction margin (service/memory/accuracy.py: the
  worst the accuracy matrices ever measured for it, so no job of those matrices can raise it) and more than
  :data:`DRIFT_FLOOR_BYTES`. The other way round (a plan above the step) is no danger and raises nothing.
- **leak**: what a rank holds at the end of a step (its counted parameters, gradients, optimizer states and
  buffers, and what the referee finds beyond them: workers/telemetry.py: Referee) grows over the last
  :data:`LEAK_WINDOW` − 1 sampled steady steps (from step 3: DDP rebuilds its buckets in step 2) whose
  micro-batches are of widths the rank had already trained on, by at least :func:`leak_threshold` — a kept
  tensor, a loss summed with its graph — where the plan holds it flat (what a step holds after its optimizer step
  does not depend on its micro-batches). Only steps of widths already seen count: on CPU, bf16 matmuls go
  through oneDNN, which keeps a primitive (with the weights reordered for it, ~the model's bf16 weights) per new
  shape, so a run of varied lengths grows by that much at each new width and not at a repeated one (measured:
  docs/measurements/2026-12-06/step-by-step.md) — a cache, not a leak.

Each alarm is a job event (level warn) naming the rank, the category that grew and by how much, once per attempt,
rank and kind; with ``training.memory_alarm: stop`` the job then ends failed (``memory_alarm``) and its run is
stopped (service/jobs/ingest.py).
"""

from __future__ import annotations

from typing import Any, Iterable

from service.domain.spec import JobSpec
from service.memory.accuracy import accuracy_margin
from service.memory.step_compare import predicted_step

MiB = 2**20
DRIFT_FLOOR_BYTES = 256 * 1024  # below this a measured step is never "above its plan" (allocator and trace noise)
LEAK_WINDOW = 4  # sampled steps of known widths the growth is read over
LEAK_HISTORY = 24  # a rank's latest samples read for it
LEAK_FLOOR_BYTES = 2 * MiB
STEADY_FROM_STEP = 3


def held_by_category(values: dict[str, Any]) -> dict[str, int]:
    """What a sample says its rank holds at the step's end, by category (the referee's surplus as unattributed)."""
    g = values.get
    device = g("device") or {}
    return {
        "parameters": (g("parameters_bytes") or 0) + (g("host_parameters_bytes") or 0),
        "gradients": (g("gradients_bytes") or 0) + (g("host_gradients_bytes") or 0),
        "optimizer_states": (g("optimizer_bytes") or 0) + (g("host_optimizer_bytes") or 0),
        "other": g("other_bytes") or 0,
        "unattributed": int((device.get("referee") or {}).get("unattributed_bytes") or 0),
    }


def leak_threshold(plan_peak_bytes: int | None) -> int:
    """The growth over the window that is a leak: 1% of the planned peak, at least LEAK_FLOOR_BYTES."""
    return max(LEAK_FLOOR_BYTES, int(0.01 * (plan_peak_bytes or 0)))


def _widths(sample: dict[str, Any]) -> set[int]:
    return {max(m) for m in ((sample.get("device") or {}).get("micro_batches") or []) if m}


def leak(samples: list[dict[str, Any]], plan_peak_bytes: int | None) -> dict[str, Any] | None:
    """A rank's leak in its latest samples (dicts of a sample's columns), or None (see the module docstring)."""
    ordered = sorted(samples, key=lambda s: s["step"])
    seen: set[int] = set()
    pairs = []  # (the step before, a steady step of widths already trained on)
    for before, s in zip(ordered, ordered[1:]):
        seen |= _widths(before)
        if s["step"] >= STEADY_FROM_STEP and before["step"] >= STEADY_FROM_STEP and _widths(s) <= seen:
            pairs.append((before, s))
    pairs = pairs[-(LEAK_WINDOW - 1):]
    if len(pairs) < LEAK_WINDOW - 1:
        return None
    growth_by = {c: 0 for c in held_by_category({})}
    steps = []
    for a, b in pairs:
        ha, hb = held_by_category(a), held_by_category(b)
        steps.append(sum(hb.values()) - sum(ha.values()))
        for c in growth_by:
            growth_by[c] += hb[c] - ha[c]
    growth, threshold = sum(steps), leak_threshold(plan_peak_bytes)
    # a leak keeps what it took: no step of the window gives back more than a quarter of the threshold
    if growth < threshold or any(g < -(threshold // 4) for g in steps):
        return None
    category = max(growth_by, key=lambda c: growth_by[c])
    return {"kind": "leak", "rank": pairs[-1][1]["rank"], "step": pairs[-1][1]["step"], "from_step": pairs[0][0]["step"],
            "category": category, "growth_bytes": int(growth_by[category]), "total_growth_bytes": int(growth),
            "threshold_bytes": threshold, "steps_read": [b["step"] for _, b in pairs]}


def drifted(predicted: int, measured: int, margin: float) -> bool:
    """The drift rule: measured above predicted by more than the margin (a fraction of measured) and the floor."""
    return measured - predicted > max(DRIFT_FLOOR_BYTES, margin * measured)


def drift(sp, spec: JobSpec, sample: dict[str, Any]) -> dict[str, Any] | None:
    """A traced step measured above the plan of its own micro-batches beyond the strategy's margin, or None."""
    measured = sample.get("peak_bytes")
    micro = (sample.get("device") or {}).get("micro_batches")
    if measured is None or sp is None or sample["step"] < STEADY_FROM_STEP:
        return None
    predicted = predicted_step(sp, sample["rank"], micro)
    if predicted is None:
        return None
    margin, source = accuracy_margin(spec)
    excess = measured - predicted
    if not drifted(predicted, measured, margin):
        return None
    return {"kind": "drift", "rank": sample["rank"], "step": sample["step"], "category": "total",
            "predicted_bytes": int(predicted), "measured_bytes": int(measured), "excess_bytes": int(excess),
            "margin": margin, "margin_source": source}


def message(alarm: dict[str, Any]) -> str:
    if alarm["kind"] == "leak":
        return (f"Memory leak on rank {alarm['rank']}: {alarm['category'].replace('_', ' ')} grew by "
                f"{alarm['growth_bytes'] / MiB:.1f} MiB over steps {alarm['from_step']}–{alarm['step']} of widths "
                f"already trained on ({alarm['total_growth_bytes'] / MiB:.1f} MiB held in all), where the plan holds "
                "it flat")
    return (f"Memory drift on rank {alarm['rank']} at step {alarm['step']}: measured "
            f"{alarm['measured_bytes'] / MiB:.1f} MiB, {alarm['excess_bytes'] / MiB:.1f} MiB above the plan of its "
            f"micro-batches ({alarm['predicted_bytes'] / MiB:.1f} MiB), beyond the strategy's measured margin "
            f"({alarm['margin']:.2%})")


def alarms(sp, spec: JobSpec, plan_peak_bytes: int | None, new: Iterable[dict[str, Any]],
           history: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Alarms raised by newly stored samples ``new``, with each rank's recent samples ``history`` (new included)."""
    out = []
    ranks = set()
    for s in new:
        d = drift(sp, spec, s)
        if d is not None:
            out.append(d)
        ranks.add(s["rank"])
    for rank in sorted(ranks):
        found = leak(history.get(rank, []), plan_peak_bytes)
        if found is not None:
            out.append(found)
    return out
