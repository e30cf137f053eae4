"""An out-of-memory failure completed with where the memory went: the dominant category, the
breakdown at failure, the prediction, and the planner's suggestions."""

from __future__ import annotations

from typing import Any

from service.domain.plan import read_plan
from service.domain.spec import (
    JobSpec,
)
from service.domain.units import gib
from service.memory import planner
from service.memory.preflight import (
    MAX_SUGGESTIONS,
    _gpu_for,
    _suggestion,
    resolve_shape,
)
from service.settings import Settings


def oom_error(job, error: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Complete a worker's out_of_memory error: the dominant category, the breakdown at failure, the
    prediction, and the planner's suggestions (the job's own when its plan had them, else the single
    changes that lower the predicted peak the most)."""
    details = dict(error.get("details") or {})
    details.pop("plan", None)  # the job's plan is on the job (and in GET …/memory); keep the error short
    plan = read_plan(job.plan)
    if plan is not None:
        details["predicted"] = {"per_rank": plan.per_rank.model_dump(mode="json"), "peak_bytes": plan.peak_bytes,
                                "fits": plan.fits, "capacity_bytes": plan.capacity_bytes}
    suggestions = [s.model_dump(mode="json") for s in plan.suggestions] if plan is not None else []
    if not suggestions:
        try:
            suggestions = _reductions(JobSpec.model_validate(job.spec), settings)
        except Exception:  # noqa: BLE001 - a post-mortem without suggestions beats a lost failure
            suggestions = []
    details["suggestions"] = suggestions
    cats = details.get("categories_bytes") or {}
    dominant = details.get("dominant_category") or (max(cats, key=lambda k: cats[k]) if cats else None)
    details["dominant_category"] = dominant
    message = error.get("message") or "out of memory"
    if dominant and cats.get(dominant) is not None:
        message = (f"{message} — largest category: {dominant} ({gib(cats[dominant])}); "
                   f"{len(suggestions)} suggested change(s) in error.details.suggestions")
    return {**error, "message": message[:8000], "details": details}


def _reductions(spec: JobSpec, settings: Settings) -> list[dict[str, Any]]:
    """The planner's single changes that lower the predicted peak, as the plan's suggestions."""
    resolved = resolve_shape(spec, settings)
    changes = planner.reductions(spec, resolved.shape, _gpu_for(spec, None),
                                 safety_margin=settings.memory_safety_margin, limit=MAX_SUGGESTIONS)
    return [_suggestion(i + 1, spec, x).model_dump(mode="json") for i, x in enumerate(changes)]
