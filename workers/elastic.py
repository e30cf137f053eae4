"""An elastic worker group (``resources.min_workers``) started with fewer workers than the job asked for:
the request as it runs on the world size Ray Train gave it.

The split that keeps the global batch is derived here from the spec, by the same rule the scheduler
planned with (service/memory/elastic.py: ``resplit``); whether it fits is the scheduler's re-plan for
that world size (``RunRequest.world_sizes``), made before the run. A world size that cannot keep the
batch, or whose plan does not fit, ends the worker group with that reason instead of training another
batch or running out of memory."""

from __future__ import annotations

from service.domain.spec import RunRequest
from service.domain.units import human_bytes
from service.memory.elastic import resplit


class ElasticRefused(RuntimeError):
    def __init__(self, error: dict):
        self.error = error
        super().__init__(error["message"])


def apply_world_size(req: RunRequest, world: int) -> tuple[RunRequest, list[dict]]:
    """(the request for ``world`` workers, the job events saying what changed). The request is ``req``
    itself when the world size is what the job asked for. Raises ElasticRefused (its ``error`` a
    failure record's fields) when the job cannot run on ``world`` workers."""
    spec = req.spec
    asked = spec.training.resources.num_workers
    if world == asked:
        return req, []
    before = spec.resolved()
    planned = next((w for w in req.world_sizes or [] if w.world_size == world), None)
    candidate, split = resplit(spec, world)
    problem = (planned.problem if planned is not None else None) or split.problem
    if planned is None and problem is None:
        problem = f"no re-plan was made for {world} workers (resources.min_workers {spec.training.resources.min_workers})"
    if problem is not None or candidate is None:
        code = (planned.code if planned is not None and planned.problem else None) or split.code or "elastic_world_size"
        raise ElasticRefused({
            "code": code, "param": "training.resources.min_workers", "phase": "elastic_start",
            "message": f"Ray Train started {world} of the {asked} workers asked for, and the job cannot run on "
                       f"{world}: {problem}",
            "details": {"asked_workers": asked, "world_size": world,
                        "plan": (planned or split).model_dump(mode="json")}})
    after = candidate.resolved()
    fit = (f"; the plan fits ({human_bytes(planned.need_bytes)} per rank of {human_bytes(planned.usable_bytes)} usable)"
           if planned.fits and planned.need_bytes and planned.usable_bytes else "")
    event = {
        "level": "warn", "dedupe": f"elastic:{req.attempt}:{world}",
        "message": (f"Elastic: Ray Train started {world} of the {asked} workers asked for; re-planned for {world}: "
                    f"micro-batch {after.micro_batch_size} × {after.gradient_accumulation_steps} accumulation steps × "
                    f"{after.data_parallel_size} data-parallel (was {before.micro_batch_size} × "
                    f"{before.gradient_accumulation_steps} × {before.data_parallel_size}), global batch "
                    f"{after.global_batch_size} kept{fit}"),
        "data": {"asked_workers": asked, "world_size": world,
                 "before": _split(before), "after": _split(after),
                 "plan": {k: getattr(planned, k) for k in ("fits", "need_bytes", "peak_bytes", "usable_bytes")}}}
    return req.model_copy(update={"spec": candidate}), [event]


def _split(r) -> dict:
    return {"micro_batch_size": r.micro_batch_size, "gradient_accumulation_steps": r.gradient_accumulation_steps,
            "data_parallel_size": r.data_parallel_size, "global_batch_size": r.global_batch_size}
