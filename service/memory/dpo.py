"""DPO's memory plan (method.type 'dpo', workers/dpo.py), composed from the supervised planner's.

What a DPO step holds beyond a supervised one, per rank:

- the policy runs each micro-batch of m pairs as 2m rows — the chosen sequences, then the rejected ones,
  padded to the longest of them — so its activations, logits and loss are an SFT micro-batch of 2m rows:
  planned as exactly that (the spec with micro_batch_size 2m), every other term (model states, buffers,
  offload, sharding) the policy's own;
- the reference's forward runs without a graph, before the policy's: nothing of it is kept for backward,
  and its transient logits and log-softmax are the size of the policy's own at its loss (which the plan
  already holds, beside the saved activations the reference's forward does not have), so it does not
  raise the peak;
- the reference itself: with ``adapter_disabled`` it is the policy (the PEFT base without its adapter) —
  nothing more; with ``precomputed`` it is two numbers a pair (kept on the host, and computed before the
  first step, when no gradient or optimizer state exists yet) — nothing that counts; with ``frozen_copy``
  it is a second copy of the base's weights, in the dtype the policy holds them (sharded over the ranks
  under fsdp): added to the parameters, and so to every instant of the step.

The data's widest micro-batch is the longest sequence, chosen or rejected (service/memory/data.py measures
preference rows so), and a DPO micro-batch always mixes rows of different lengths: it is planned padded.
"""

from __future__ import annotations

from typing import Any

from service.domain.plan import Plan
from service.domain.spec import JobSpec, PeftMethod, StrategyName, dpo_reference_mode
from service.domain.training import dtype_bytes, regime
from service.memory import planner


def policy_spec(spec: JobSpec) -> JobSpec:
    """The supervised job whose step the DPO policy's is: micro-batches of twice the rows."""
    return supervised_spec(spec, 2 * spec.resolved().micro_batch_size)


def supervised_spec(spec: JobSpec, micro_batch_size: int) -> JobSpec:
    """The supervised job whose step a preference or RL policy's is: its micro-batches of ``micro_batch_size``
    rows, the same accumulation, every other field the job's."""
    body = spec.model_dump(mode="json")
    hp = body["training"]["hyperparameters"]
    hp["micro_batch_size"] = micro_batch_size
    hp["gradient_accumulation_steps"] = spec.resolved().gradient_accumulation_steps
    body["method"] = {"type": "supervised"}
    return JobSpec.model_validate(body)


def reference_bytes(spec: JobSpec, shape) -> int:
    """Per rank, what the reference holds beyond the policy (see the module docstring)."""
    return frozen_copy_bytes(spec, shape) if dpo_reference_mode(spec.training) == "frozen_copy" else 0


def frozen_copy_bytes(spec: JobSpec, shape) -> int:
    """Per rank, a frozen copy of the base in the dtype the policy holds it (its shard under FSDP)."""
    t = spec.training
    rg = regime(t.strategy.value, t.peft.method.value, t.precision.value)
    dtype = rg.frozen_dtype if t.peft.method != PeftMethod.none else rg.trainable_dtype
    per_param = dtype_bytes(rg.compute_dtype if dtype == "nf4" else dtype)
    shards = t.resources.num_workers if t.strategy == StrategyName.fsdp else 1
    return -(-shape.parameter_count() * per_param // shards)


def plan(spec: JobSpec, shape, gpu: str | None = None, **kwargs: Any) -> Plan:
    """``planner.plan``'s per-rank plan for a DPO spec (its keywords: seq_length, padded, nodes …)."""
    kwargs["padded"] = True  # chosen and rejected rows of different lengths in every micro-batch
    p = planner.plan(policy_spec(spec), shape, gpu, **kwargs)
    extra = reference_bytes(spec, shape)
    mode = dpo_reference_mode(spec.training)
    m = spec.resolved().micro_batch_size
    p.assumptions.append(
        f"DPO: each micro-batch of {m} pair(s) runs {2 * m} rows through the policy (chosen, then rejected); the "
        f"reference ({mode}) runs its forward without a graph" + (
            f" and holds a frozen copy of the base, {extra / 2**20:.1f} MiB per rank" if extra else
            "; precomputed log-probabilities are 16 bytes a pair" if mode == "precomputed" else
            ": the PEFT base with its adapter disabled, no second model"))
    if extra:
        p = with_parameters(p, extra)
    return p


def with_parameters(p: Plan, extra: int) -> Plan:
    """``p`` with ``extra`` bytes of parameters more, live at every instant: the peak, the need and the
    fit follow."""
    dev = p.per_rank.device.model_copy(update={"parameters": p.per_rank.device.parameters + extra})
    states = p.model_states.model_copy(deep=True)
    states.device.parameters += extra
    need = p.need_bytes + extra
    update = {"per_rank": p.per_rank.model_copy(update={"device": dev}), "model_states": states,
              "phases": {k: v + extra for k, v in p.phases.items()}, "peak_bytes": p.peak_bytes + extra,
              "need_bytes": need}
    if p.usable_bytes is not None:
        update.update(margin_bytes=p.usable_bytes - need, fits=p.fits and need <= p.usable_bytes)
    return p.model_copy(update=update)
