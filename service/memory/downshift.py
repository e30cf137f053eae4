"""Out-of-memory recovery that keeps the training the same: the change a job downshifts to.

With ``training.on_oom: downshift`` a job whose worker ran out of memory is not failed. The scheduler
(service/scheduler/loop.py: ``_downshift``) requeues it as a new attempt that resumes from the latest
checkpoint with the spec :func:`choose` returns, at most ``training.max_downshifts`` times. Every rung
keeps what the optimizer sees, so the run after the downshift is the run the job would have made:

1. **a smaller micro-batch, more accumulation**: ``mb / k`` rows × ``accumulation · k`` (k the smallest
   divisor of mb first). The global batch is the same rows each step — the sampler gives step s the
   stream positions [s·G, (s+1)·G) whatever the split (workers/data.py ``StepSampler``) — and the loss is
   the same: each backward uses its token-loss sum over the label tokens T of the whole window
   (workers/steps.py), so the gradient is the same sum taken in another order, equal up to fp32
   rounding. The learning-rate schedule (total steps from the global batch) is unchanged.
2. **+ activation checkpointing**: backward recomputes the same activations.
3. **+ offload or sharding**, only where the checkpoint resumes under the new layout:

   - fsdp → ``fsdp.cpu_offload``: each rank reads its shard of the DCP checkpoint into whatever
     placement its DTensors have (torch.distributed.checkpoint reshards by global offsets);
   - deepspeed ZeRO ≥ 1 → ``offload_optimizer: cpu``, then ZeRO-3 → ``offload_param: cpu``: the same
     stage and world size partition the same way, and DeepSpeed's ``load_checkpoint`` fills the host
     copies from its per-rank files;
   - ddp on more than one worker → fsdp (FSDP2, full sharding): FSDP2 reads ddp's full ``state.pt`` and
     keeps its shard (workers/checkpoint.py ``load_full_state``, the optimizer state re-keyed by name).

   Not offered, because the checkpoint would not resume: ddp → DeepSpeed (DeepSpeed loads only its own
   checkpoint folder), ZeRO-1/2 → ZeRO-3 (stage 3 partitions and names its optimizer state per
   parameter, stages 1/2 per flat group: ``load_checkpoint`` of the other layout fails), a change of
   precision or of worker count (not the same optimizer trajectory), and anything for the pipeline
   strategy beyond rungs 1–2.

**Which rung.** Candidates are tried in that order — every split of the micro-batch alone, then
checkpointing with the micro-batch as it is and then split, then offload with checkpointing — and
the first that passes the spec's rules and whose plan fits is taken. "Fits" is the planner's need
scaled by what the out-of-memory proved: the failed spec's plan said ``need``, the worker used more
than the capacity, so the planner missed by at least ``capacity / need`` (1 when the plan already
said it would not fit); a candidate fits when ``need × miss ≤ capacity × (1 − safety margin)``. The
capacity is the plan's (the GPU's, or the CPU worker's ``host_memory_budget_bytes``), else the limit
the out-of-memory reported. A model the planner cannot read takes the first rung, said so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.domain.plan import Plan
from service.domain.spec import MAX_ACCUMULATION, JobSpec, StrategyName, check_rules
from service.domain.units import human_bytes
from service.memory.suggestions import patched_spec
from service.settings import Settings

DOWNSHIFT_REASON = "out_of_memory_downshift"  # the requeue reason (service/scheduler/loop.py)
DOWNSHIFT_EVENT = "downshift"  # the job event of each downshift: dedupe key "downshift:<n>"


@dataclass
class Downshift:
    """The change chosen: its name and words, the new spec, the fields it changes (dotted → value),
    the plans before and after, and how the choice was made."""

    change: str
    description: str
    spec: JobSpec
    spec_changes: dict[str, Any]
    before: Plan | None
    after: Plan | None
    miss: float  # the factor the out-of-memory proved the plan low by (≥ 1)
    why: str
    tried: list[dict[str, Any]] = field(default_factory=list)  # each candidate: name, need, fits


@dataclass
class NoDownshift:
    """Nothing on the ladder fits (or the ladder is empty): the job fails out_of_memory, saying why."""

    why: str
    tried: list[dict[str, Any]] = field(default_factory=list)


def _get(spec: JobSpec, dotted: str) -> Any:
    node: Any = spec
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.value if hasattr(node, "value") else node


def _offload_steps(spec: JobSpec) -> list[tuple[str, str, dict[str, Any]]]:
    """The sharding/offload changes whose checkpoint resumes (see the module docstring), in order."""
    t = spec.training
    out: list[tuple[str, str, dict[str, Any]]] = []
    if t.strategy == StrategyName.fsdp and not t.fsdp.cpu_offload:
        out.append(("fsdp_offload", "FSDP2 shards in host memory", {"training.fsdp.cpu_offload": True}))
    elif t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage >= 1:
        if t.deepspeed.offload_optimizer == "none":
            out.append(("offload_optimizer", "optimizer states in host memory",
                        {"training.deepspeed.offload_optimizer": "cpu"}))
        if t.deepspeed.zero_stage == 3 and t.deepspeed.offload_param == "none":
            out.append(("offload_param", "parameters in host memory", {"training.deepspeed.offload_param": "cpu"}))
    elif t.strategy == StrategyName.ddp and t.resources.num_workers > 1 and not t.qat.enabled:
        out.append(("fsdp", f"FSDP2 sharding over the {t.resources.num_workers} workers",
                    {"training.strategy": "fsdp"}))
    return out


def ladder(spec: JobSpec) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, description, patch) of every candidate, in the order they are tried."""
    r = spec.resolved()
    mb, acc, G = r.micro_batch_size, r.gradient_accumulation_steps, r.global_batch_size
    splits = [k for k in range(2, mb + 1) if mb % k == 0 and acc * k <= MAX_ACCUMULATION]

    def split(k: int) -> tuple[str, str, dict[str, Any]]:
        if k == 1:
            return "", "", {}
        return (f"micro_batch_{mb // k}",
                f"micro-batch {mb // k} × {acc * k} accumulation steps (was {mb} × {acc}; global batch {G} kept)",
                {"training.hyperparameters.micro_batch_size": mb // k,
                 "training.hyperparameters.gradient_accumulation_steps": acc * k})

    out = [split(k) for k in splits]
    tiers: list[tuple[list[str], list[str], dict[str, Any]]] = []
    names: list[str] = []
    words: list[str] = []
    patch: dict[str, Any] = {}
    if not spec.training.gradient_checkpointing:
        names, words = ["gradient_checkpointing"], ["activation checkpointing"]
        patch = {"training.gradient_checkpointing": True}
        tiers.append((list(names), list(words), dict(patch)))
    for name, what, p in _offload_steps(spec):
        names, words, patch = [*names, name], [*words, what], {**patch, **p}
        tiers.append((list(names), list(words), dict(patch)))
    for tier_names, tier_words, tier_patch in tiers:
        for k in [1, *splits]:
            s_name, s_words, s_patch = split(k)
            out.append(("+".join(tier_names + ([s_name] if s_name else [])),
                        " + ".join(tier_words + ([s_words] if s_words else [])),
                        {**tier_patch, **s_patch}))
    return out



def choose(spec: JobSpec, settings: Settings, error: dict[str, Any] | None = None,
           model_path: str | None = None) -> Downshift | NoDownshift:
    """The downshift for ``spec`` after the out-of-memory ``error`` (the job's post-mortem: its
    ``details.limit_bytes`` is what the worker ran out of), or why there is none."""
    from service.memory import planner
    from service.memory.preflight import UnknownModelShape, _gpu_for, plan_for_spec, resolve_shape

    specs = []
    for name, what, patch in ladder(spec):
        try:
            candidate = patched_spec(spec, patch)
        except ValueError:
            continue
        if not check_rules(candidate):
            specs.append((name, what, patch, candidate))
    if not specs:
        return NoDownshift("nothing on the ladder applies: the micro-batch is 1, checkpointing is on and the "
                           "strategy has no offload or sharding step whose checkpoint resumes")
    try:
        shape = resolve_shape(spec, settings, model_path).shape
    except UnknownModelShape as exc:
        name, what, patch, candidate = specs[0]
        return Downshift(name, what, candidate, patch, None, None, 1.0,
                         f"the planner cannot read the model ({exc}): the first rung is taken")
    gpu = _gpu_for(spec, None)
    margin = settings.memory_safety_margin
    before = planner.plan(spec, shape, gpu, safety_margin=margin)
    limit = (error or {}).get("details", {}).get("limit_bytes") if error else None
    capacity = before.capacity_bytes if (gpu or spec.training.resources.host_memory_budget_bytes) else limit
    if not capacity:
        name, what, patch, candidate = specs[0]
        return Downshift(name, what, candidate, patch, None, None, 1.0,
                         "no capacity is known (no GPU type or host budget, and the failure named no limit): "
                         "the first rung is taken")
    miss = max(1.0, capacity / before.need_bytes) if before.need_bytes else 1.0
    usable = int(capacity * (1 - margin))
    tried = []
    for name, what, patch, candidate in specs:
        p = planner.plan(candidate, shape, gpu, safety_margin=margin)
        need = int(p.need_bytes * miss)
        fits = need <= usable
        tried.append({"change": name, "need_bytes": p.need_bytes, "corrected_need_bytes": need, "fits": fits})
        if fits:
            if miss > 1:
                why = (f"the failed spec's plan needed {human_bytes(before.need_bytes)}, yet the worker ran out of "
                       f"{human_bytes(capacity)}: the plan was low by at least ×{miss:.2f}; {name} needs "
                       f"{human_bytes(p.need_bytes)} × {miss:.2f} = {human_bytes(need)} of {human_bytes(usable)} usable")
            else:
                why = (f"the failed spec's plan needed {human_bytes(before.need_bytes)} of {human_bytes(usable)} usable "
                       f"({human_bytes(capacity)}); {name} needs {human_bytes(need)}")
            stored = plan_for_spec(candidate, settings, model_path=model_path)
            return Downshift(name, what, candidate, patch, _with_model(before, stored), stored, miss, why, tried)
    return NoDownshift(f"no change that keeps the training the same fits: the plan was low by at least ×{miss:.2f} "
                       f"and the last candidate ({tried[-1]['change']}) would need {human_bytes(tried[-1]['corrected_need_bytes'])} "
                       f"of {human_bytes(usable)} usable", tried)


def _with_model(plan: Plan, like: Plan) -> Plan:
    """The planner's bare plan with the model information the stored plans carry."""
    return plan.model_copy(update={"model": like.model})


def summary(plan: Plan | None) -> dict[str, Any] | None:
    """What a downshift event keeps of a plan: the totals and the per-rank breakdown."""
    if plan is None:
        return None
    return {"fits": plan.fits, "peak_bytes": plan.peak_bytes, "need_bytes": plan.need_bytes,
            "usable_bytes": plan.usable_bytes, "capacity_bytes": plan.capacity_bytes,
            "per_rank": plan.per_rank.model_dump(mode="json")}


def before_values(spec: JobSpec, changes: dict[str, Any]) -> dict[str, Any]:
    """The values the changed fields had in ``spec``."""
    return {k: _get(spec, k) for k in changes}
