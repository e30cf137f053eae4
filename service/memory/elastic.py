"""Elastic re-plan: the job on each world size it may get when ``resources.min_workers`` lets it run on
fewer workers than ``num_workers`` (a node lost, a busy cluster).

Ray Train V2 starts an elastic worker group (``ScalingConfig(num_workers=(min, max))``,
workers/run.py) with as many workers as the cluster has room for, and restarts it with another count
after a node is lost or comes back. Before each (re)start the workers must know that the job still
fits and how to keep its training the same, so the scheduler plans every world size the group may
get, once, when it submits the run (:func:`world_plans`, in ``RunRequest.world_sizes``), and the
workers apply the entry of the world size they are started with (workers/elastic.py).

**The rule that keeps the global batch** (:func:`resplit`): the global batch G = micro-batch ×
accumulation × data-parallel size stays what the spec says. On ``w`` workers the data-parallel size
is d = w (÷ ``pipeline.stages`` for a pipeline), each replica's share is G ÷ d, and

1. G must divide by d — otherwise no split keeps G exactly, and that world size is refused
   (``elastic_world_size``): the job does not start on it rather than train another batch;
2. the micro-batch stays as asked when it divides the share (then accumulation = share ÷ micro-batch:
   2 workers → 1 doubles it), else it becomes the largest divisor of the share below it (so a rank never
   holds more activations than planned) and accumulation = share ÷ that;
3. the result must pass the spec's rules (accumulation ≤ its limit, a pipeline's chunks dividing the
   micro-batch and, for 1f1b, at least ``stages`` of them) and its plan must fit — else refused
   (``insufficient_memory``, as the pre-flight's refusal, with the plan's numbers).

The rows of each step are the same whatever the split (workers/data.py ``StepSampler`` gives step s
the stream positions [s·G, (s+1)·G)), and so is the learning-rate schedule (total steps from G).
"""

from __future__ import annotations

from typing import Any

from service.domain.elastic import WorldPlan
from service.domain.spec import MAX_ACCUMULATION, JobSpec, StrategyName, check_rules
from service.domain.units import human_bytes
from service.settings import Settings

MAX_WORLD_SIZES = 16  # world sizes planned, largest first: a range wider than this starts on one of them or not at all


def world_sizes(spec: JobSpec) -> list[int]:
    """The world sizes below ``num_workers`` an elastic group may start with, largest first (a
    pipeline's are multiples of its stages); empty when ``min_workers`` is unset."""
    res = spec.training.resources
    if res.min_workers is None or res.min_workers >= res.num_workers:
        return []
    step = spec.training.pipeline.stages if spec.training.strategy == StrategyName.pipeline else 1
    sizes = [w for w in range(res.num_workers - 1, res.min_workers - 1, -1) if w % step == 0]
    return sizes[:MAX_WORLD_SIZES]


def data_parallel_size(spec: JobSpec, world: int) -> int:
    t = spec.training
    return world // t.pipeline.stages if t.strategy == StrategyName.pipeline else world


def _with(spec: JobSpec, world: int, micro: int, accumulation: int) -> JobSpec:
    body = spec.model_dump(mode="json", exclude_unset=False)
    hp = body["training"]["hyperparameters"]
    hp["micro_batch_size"], hp["gradient_accumulation_steps"] = micro, accumulation
    body["training"]["resources"].update(num_workers=world, min_workers=None)
    return JobSpec.model_validate(body)


def resplit(spec: JobSpec, world: int) -> tuple[JobSpec | None, WorldPlan]:
    """``spec`` on ``world`` workers with the same global batch (the rule in the module docstring): the
    spec to plan and run, and its split; (None, a split whose ``problem`` says why) when no split
    keeps the batch or the spec's rules refuse it."""
    r = spec.resolved()
    G, micro = r.global_batch_size, r.micro_batch_size
    d = data_parallel_size(spec, world)

    def refused(problem: str, m: int = micro, a: int = r.gradient_accumulation_steps) -> tuple[None, WorldPlan]:
        return None, WorldPlan(world_size=world, data_parallel_size=d, micro_batch_size=m,
                               gradient_accumulation_steps=a, global_batch_size=G, problem=problem,
                               code="elastic_world_size")

    if G % d:
        return refused(f"the global batch of {G} cannot be split evenly over {d} data-parallel rank(s) "
                       f"({world} workers)")
    share = G // d
    new_micro = micro if share % micro == 0 else max(k for k in range(1, micro + 1) if share % k == 0)
    accumulation = share // new_micro
    if accumulation > MAX_ACCUMULATION:
        return refused(f"{world} workers would need {accumulation} accumulation steps for the global batch of {G}, "
                       f"over the limit of {MAX_ACCUMULATION}", new_micro, accumulation)
    candidate = _with(spec, world, new_micro, accumulation)
    problems = check_rules(candidate)
    if problems:
        return refused("; ".join(f"{p.param}: {p.message}" for p in problems), new_micro, accumulation)
    return candidate, WorldPlan(world_size=world, data_parallel_size=d, micro_batch_size=new_micro,
                                gradient_accumulation_steps=accumulation, global_batch_size=G)


def world_plans(spec: JobSpec, settings: Settings, *, model_path: str | None = None,
                training_path: str | None = None) -> list[WorldPlan] | None:
    """Every world size of :func:`world_sizes` re-split and re-planned (for the training data when
    ``training_path`` is given, as the pre-flight plans); None when the job is not elastic. A model the
    planner cannot read is planned as fitting (its memory is only measured, as at the pre-flight)."""
    from service.domain.errors import UnprocessableEntity
    from service.memory.gpus import UnknownGPU
    from service.memory.preflight import UnknownModelShape, plan_for_spec

    sizes = world_sizes(spec)
    if not sizes:
        return None
    out: list[WorldPlan] = []
    for world in sizes:
        candidate, split = resplit(spec, world)
        if candidate is None:
            out.append(split)
            continue
        try:
            p = plan_for_spec(candidate, settings, model_path=model_path, training_path=training_path)
        except UnknownModelShape:
            out.append(split)
            continue
        except (UnprocessableEntity, UnknownGPU) as exc:  # e.g. more pipeline stages than blocks: not this size
            out.append(split.model_copy(update={"problem": f"the planner refuses {world} workers: {exc}",
                                                "code": "elastic_world_size"}))
            continue
        update: dict[str, Any] = {"fits": p.fits, "need_bytes": p.need_bytes, "peak_bytes": p.peak_bytes,
                                  "usable_bytes": p.usable_bytes}
        if not p.fits:
            update.update(code="insufficient_memory", problem=(
                f"on {world} workers the plan needs {human_bytes(p.need_bytes)} per rank, over the "
                f"{human_bytes(p.usable_bytes or 0)} usable" if p.usable_bytes is not None else
                f"on {world} workers the plan does not fit the node's memory"))
        out.append(split.model_copy(update=update))
    return out
