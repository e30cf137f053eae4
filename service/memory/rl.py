"""Reinforcement fine-tuning's memory plan (method.type 'reinforcement', workers/rl.py), composed from the
supervised planner's. One RL step on a rank runs two phases, one after the other, on the same memory:

- **sample**: the policy generates ``n`` completions (training.rl.samples_per_prompt) for each of the
  micro-batch's ``m`` prompts, without a graph: the model states that stay between steps (parameters,
  optimizer states; the gradients were freed by the last step's ``zero_grad``), the **KV cache** of ``m × n``
  sequences at prompt + max_completion_tokens tokens (2 × layers × kv heads × head dim × the compute dtype's
  bytes a token: service/memory/serving.py kv_bytes_per_token), the prefill's hidden states and the last
  position's fp32 logits of every row. On CPU workers the sampler is the policy itself, in the training
  process (no second copy of the weights: the weights it samples with are the ones just updated), so the
  sampler's weights are the policy's parameters, counted once. ``sampler_memory_fraction`` samples the
  micro-batch in rounds whose KV cache stays within that share of the capacity;
- **train**: the policy's forward and backward over the same ``m × n`` sequences, padded to the longest — an
  SFT micro-batch of ``m × n`` rows at that width (planner.plan of that spec, every other term the policy's);
  the old policy's log-probabilities are the same forward's, detached (one update per sample, GRPO's μ = 1);
- **the reference** of the KL term (training.rl.kl_coef > 0): ``adapter_disabled`` is the policy with its
  adapter off, a forward without a graph before the policy's — nothing more; ``frozen_copy`` is a second copy
  of the base in the dtype the policy holds it, live at every instant of both phases. With kl_coef 0 there is
  none. (Reference log-probabilities cannot be precomputed once as DPO's are: the samples are new each step.)

``fits`` holds for the whole loop: the plan's need is the larger of the step's and the sampling phase's, and
the sampling phase is one of the job's phases (``job_phases``, measured by workers/rl.py as ``sample``).
"""

from __future__ import annotations

from typing import Any

from service.domain.plan import PhasePeak, Plan
from service.domain.spec import JobSpec, rl_reference_mode
from service.domain.training import regime
from service.memory import dpo, planner
from service.memory.dpo import frozen_copy_bytes, supervised_spec
from service.memory.serving import kv_bytes_per_token

MiB = 2**20


def rows_per_micro_batch(spec: JobSpec) -> int:
    return spec.resolved().micro_batch_size * spec.training.rl.samples_per_prompt


def policy_spec(spec: JobSpec) -> JobSpec:
    """The supervised job whose step the RL policy's is: micro-batches of m × n rows."""
    return supervised_spec(spec, rows_per_micro_batch(spec))


def reference_bytes(spec: JobSpec, shape) -> int:
    """What the KL term's reference holds beyond the policy, per rank."""
    return frozen_copy_bytes(spec, shape) if rl_reference_mode(spec.training) == "frozen_copy" else 0


def sampling_rounds(spec: JobSpec, shape, width: int, capacity_bytes: int | None) -> int:
    """How many rounds a micro-batch's prompts are sampled in (sampler_memory_fraction), at least 1."""
    fraction = spec.training.rl.sampler_memory_fraction
    if fraction is None or not capacity_bytes:
        return 1
    return rounds_for(spec.resolved().micro_batch_size, spec.training.rl.samples_per_prompt,
                      kv_bytes_per_token(shape, _kv_dtype(spec)) * width, capacity_bytes, fraction)


def rounds_for(prompts: int, samples_per_prompt: int, row_bytes: int, capacity_bytes: int | None,
               fraction: float | None) -> int:
    """Rounds of whole prompts (n sequences each) whose KV cache, ``row_bytes`` a sequence, stays within
    ``fraction`` of ``capacity_bytes``: the planner's and the sampler's one rule."""
    if fraction is None or not capacity_bytes:
        return 1
    per_round = max(1, int(capacity_bytes * fraction) // max(row_bytes * samples_per_prompt, 1))
    return -(-prompts // per_round)


def _kv_dtype(spec: JobSpec) -> str:
    t = spec.training
    return regime(t.strategy.value, t.peft.method.value, t.precision.value).compute_dtype


def sampler_bytes(spec: JobSpec, shape, prompt_tokens: int, width: int, rounds: int = 1) -> dict[str, int]:
    """The sampling phase's own terms beyond the model states (module docstring)."""
    rows = -(-rows_per_micro_batch(spec) // rounds)
    kv = kv_bytes_per_token(shape, _kv_dtype(spec)) * width * rows
    prefill = rows * prompt_tokens * shape.hidden * 4 * 4  # the residual stream and a block's q, attention, MLP in
    logits = rows * shape.vocab * 4 * 2  # the last position's logits and their softmax, fp32
    return {"kv_cache": kv, "prefill": prefill, "logits": logits}


def plan(spec: JobSpec, shape, gpu: str | None = None, **kwargs: Any) -> Plan:
    """``planner.plan``'s per-rank plan for a reinforcement spec (its keywords: seq_length — the data's widest
    prompt —, padded, nodes …)."""
    rl = spec.training.rl
    max_seq = spec.training.hyperparameters.max_seq_length
    prompt = min(kwargs.get("seq_length") or (max_seq - rl.max_completion_tokens), max_seq - rl.max_completion_tokens)
    width = prompt + rl.max_completion_tokens
    kwargs.update(seq_length=width, padded=True)
    p = planner.plan(policy_spec(spec), shape, gpu, **kwargs)
    extra = reference_bytes(spec, shape)
    if extra:
        p = dpo.with_parameters(p, extra)
    rounds = sampling_rounds(spec, shape, width, p.capacity_bytes)
    terms = sampler_bytes(spec, shape, prompt, width, rounds)
    states = p.model_states.device
    kept = states.parameters + states.optimizer_states + (p.model_states.host.parameters if p.gpu is None else 0)
    sample_live = kept + sum(terms.values())
    runtime = p.host_memory.runtime_bytes if p.host_memory is not None else planner.CPU_RUNTIME_BYTES
    sample_need = sample_live + (0 if p.gpu is not None else runtime) + p.accuracy_margin_bytes
    m, n = spec.resolved().micro_batch_size, rl.samples_per_prompt
    mode = rl_reference_mode(spec.training)
    p.assumptions.append(
        f"RL: each micro-batch of {m} prompt(s) × {n} samples trains {m * n} rows of up to {prompt} prompt + "
        f"{rl.max_completion_tokens} completion tokens; sampling (the policy itself, in process) holds a KV cache "
        f"of {terms['kv_cache'] / MiB:.1f} MiB for {-(-m * n // rounds)} sequences at {width} tokens"
        + (f" in {rounds} rounds (sampler_memory_fraction {rl.sampler_memory_fraction})" if rounds > 1 else "")
        + {"none": "; no reference (kl_coef 0)",
           "adapter_disabled": "; the reference is the PEFT base with its adapter disabled, no second model",
           "frozen_copy": f"; the reference is a frozen copy of the base, {extra / MiB:.1f} MiB"}[mode])
    update: dict[str, Any] = {}
    if sample_need > p.need_bytes:
        update.update(need_bytes=sample_need, peak_bytes=max(p.peak_bytes, sample_live), peak_phase="sample")
        if p.usable_bytes is not None:
            update.update(margin_bytes=p.usable_bytes - sample_need, fits=p.fits and sample_need <= p.usable_bytes)
    if p.job_phases is not None:
        phases = p.job_phases.model_copy(deep=True)
        usable = p.usable_bytes
        on_gpu = p.gpu is not None
        host = runtime + (0 if on_gpu else sample_live)
        device = (sample_live + int(0.05 * sample_live)) if on_gpu else None
        fits = None if usable is None else (device if on_gpu else sample_need) <= usable
        phases.phases["sample"] = PhasePeak(device_bytes=device, host_bytes=host, fits=fits,
                                            note=f"{m * n} sequences' KV cache")
        if on_gpu and (device or 0) > (phases.phases[phases.device_peak_phase].device_bytes or 0):
            phases.device_peak_phase = "sample"
        if host > phases.phases[phases.host_peak_phase].host_bytes:
            phases.host_peak_phase = "sample"
        if fits is False:
            phases.fits = False
        update["job_phases"] = phases
    return p.model_copy(update=update) if update else p


def suggestions(spec: JobSpec, shape, gpu: str | None, **kwargs: Any) -> list:
    """The knobs RL users turn, as the planner's Changes (service/memory/suggestions.py), those that fit first:
    fewer samples per prompt, shorter completions, a capped sampler, no KL reference."""
    from service.memory.suggestions import Change

    rl = spec.training.rl
    out = []

    def changed(what: str, **fields) -> None:
        body = spec.model_dump(mode="json")
        body["training"]["rl"].update(fields)
        try:
            other = JobSpec.model_validate(body)
        except ValueError:
            return
        key = "rl." + ",".join(sorted(fields))
        out.append(Change(key, what, len(out) + 1, plan(other, shape, gpu, **kwargs), other))

    if rl.samples_per_prompt > 2:
        changed(f"samples_per_prompt {rl.samples_per_prompt} → {max(2, rl.samples_per_prompt // 2)}",
                samples_per_prompt=max(2, rl.samples_per_prompt // 2))
    if rl.max_completion_tokens > 16:
        changed(f"max_completion_tokens {rl.max_completion_tokens} → {rl.max_completion_tokens // 2}",
                max_completion_tokens=rl.max_completion_tokens // 2)
    if rl.sampler_memory_fraction is None:
        changed("sampler_memory_fraction 0.3 (sample the micro-batch in rounds)", sampler_memory_fraction=0.3)
    if rl_reference_mode(spec.training) == "frozen_copy":
        changed("kl_coef 0 (no reference copy); or a LoRA adapter, whose base is the reference", kl_coef=0.0)
    return sorted(out, key=lambda c: (not c.plan.fits, c.cost))
