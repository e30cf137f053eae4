"""The memory planner: per-rank bytes by category, before the job runs. Pure arithmetic, no torch.

What it predicts is what workers/telemetry.py measures: the peak of live tensor bytes on one rank
during a steady-state optimizer step, split into parameters, gradients, optimizer states,
activations (saved for backward at the end of forward), temporaries and framework overhead — on
the GPU, plus what lives in host memory (offloaded state). On a GPU the overhead adds what the
allocator never sees (CUDA context, NCCL buffers) and the allocator's rounding/caching.

:func:`plan` reads as the checklist the workers run:

1. the job as the planner reads it (service/memory/job.py): the rank's model shape (strategy tensor: its share),
   the data-parallel ranks, the micro-batch and its width, the precision regime (service/domain/training.py:
   ``regime``; service/memory/precision.py) and the training method (service/memory/peft.py);
2. the model states in the regime's dtypes (precision.py: ``state_bytes``), split by the strategy — one module
   per strategy, mirroring workers/strategies/ (service/memory/strategies/: ddp, fsdp, deepspeed, pipeline,
   tensor), each with its communication buffers and gathered parameters;
3. what offloading allocates on the host (service/memory/host.py);
4. the activations, by block component (service/memory/activations/: norms, attention, MLP, embedding, head
   and loss), of the rank or of every pipeline stage;
5. the instants of a step and what is live at each (service/memory/instants.py): the peak is the largest;
6. the GPU's overhead, the capacity, the measured accuracy margin (service/memory/accuracy.py) and ``fits``.

Where ranks differ (ZeRO-2's gradient buffer holds whole tensors across partition boundaries), the
figures are the fullest rank's: the one that runs out of memory first.
"""

from __future__ import annotations

import math
from typing import Any

from service.domain.plan import Breakdown, ModelStates, ModelStatesPerRank, PerRank, Plan  # noqa: F401 - re-exported
from service.domain.spec import JobSpec, PeftMethod, check_rules
from service.domain.training import loss_chunk_problem, qat_problem, regime  # noqa: F401 - regime re-exported
from service.memory import host as host_memory
from service.memory import nvme as nvme_memory
from service.memory.phases import job_phases
from service.memory.accuracy import accuracy_margin
from service.memory.activations import Activations, activations  # noqa: F401 - re-exported
from service.memory.activations.attention import padding_mask_bytes  # noqa: F401 - re-exported
from service.memory.activations.linears import qat_linear_bytes  # noqa: F401 - re-exported
from service.memory.gpus import MiB
from service.memory.instants import step
from service.memory.job import PlannedJob, general_assumptions, planned_job
from service.memory.peft import (  # noqa: F401 - re-exported under the names they had here
    adapted_modules as _lora_targets,
    checkpointed_peft,
    embedding_leaf,
    largest_trainable as _largest_trainable,
    method_terms,
    trainable_numels as _trainable_numels,
    trainable_parameters,
)
from service.memory.precision import ACTIVATION_SIZES, ActivationSizes, state_bytes  # noqa: F401 - re-exported
from service.memory.shape import ModelShape
from service.memory.strategies import ddp, deepspeed, fsdp, pipeline, tensor
from service.memory.strategies.deepspeed import zero2_gradient_buffer_elements  # noqa: F401 - re-exported
from service.memory.strategies.fsdp import root_reduce as fsdp_root_reduce  # noqa: F401 - re-exported
from service.memory.strategies.pipeline import StageView, _rank_view, pipeline_stages  # noqa: F401 - re-exported
from service.memory.suggestions import Change, _candidates, patched_spec, _pipeline_candidates, _tensor_candidates

DEFAULT_HOST_BYTES = 16 * 2**30  # a CPU worker's memory when no host budget is given
CPU_RUNTIME_BYTES = 600 * MiB  # RSS of a torch + transformers worker process before any tensor (measured)

STRATEGIES = {"ddp": ddp, "fsdp": fsdp, "deepspeed": deepspeed, "pipeline": pipeline, "tensor": tensor}


def _refuse(param: str, problem: str):
    from service.domain.errors import SpecInvalid

    raise SpecInvalid([{"param": param, "message": problem, "code": "invalid_value"}])


def _method_assumptions(job: PlannedJob) -> list[str]:
    """What the loss and QAT change, after refusing a model they cannot run on."""
    t, shape = job.t, job.shape
    out = []
    if t.loss_chunk_tokens:
        problem = loss_chunk_problem(shape.extra.get("final_logit_softcapping"))
        if problem:
            _refuse("training.loss_chunk_tokens", problem)
        out.append(f"loss: LM head and cross-entropy over chunks of {min(t.loss_chunk_tokens, job.micro_batch * job.seq)} "
                   "tokens, each recomputed in backward")
    if t.qat.enabled:
        widths = {name: din for name, (din, _) in shape.linear_shapes().items()}
        if not shape.tied_embeddings:
            widths["lm_head"] = shape.hidden
        problem = qat_problem(shape.family, widths, t.qat.group_size)
        if problem:
            _refuse("training.qat.group_size" if shape.family != "gpt2" else "training.qat.enabled", problem)
    if job.regime.cast_frozen_base:
        out.append("LoRA + bf16: the frozen base is held in bf16, the adapter in fp32")
    if job.qlora:
        out.append("QLoRA: NF4 base (0.5 B/param + double-quantised block constants, ~0.516 B/param), "
                   "embeddings, norms and lm_head upcast to fp32, the adapter in fp32; no 16-bit copy of "
                   "the base (each 4-bit linear dequantises its weight per call)")
    return out


def _activation_options(job: PlannedJob, terms, stage: int | None) -> list[tuple[Any, Activations, int]]:
    """(pipeline stage or None, its activations, what its forward keeps) for every rank view planned."""
    t = job.t
    if terms.stage_views:  # every stage is planned; the fullest decides
        return [(v, v.act, v.saved_bytes if v.saved_bytes is not None else v.in_flight * v.act.saved(t.gradient_checkpointing))
                for v in terms.stage_views if stage is None or v.index == stage]
    split = tensor.vocab_split(job)
    act = activations(job.shape, job.micro_batch, job.seq, ACTIVATION_SIZES[job.regime.name], job.targets, t.peft.r,
                      t.attention, zero3_linear=terms.zero3_linear, padded=job.padded,
                      loss_chunk_tokens=t.loss_chunk_tokens, nf4_base=job.qlora, on_gpu=job.on_gpu,
                      # prompt tuning's virtual tokens are trainable embeddings: the first block's input needs a gradient
                      input_grad=t.peft.method == PeftMethod.prompt_tuning or checkpointed_peft(job.spec),
                      loss_parallel=split, embedding_leaf=embedding_leaf(job.spec, job.shape, split),
                      virtual_tokens=t.peft.num_virtual_tokens if t.peft.method == PeftMethod.prompt_tuning else 0,
                      **method_terms(job.spec, job.shape))
    return [(None, act, act.saved(t.gradient_checkpointing))]


def plan(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, world_size: int | None = None,
         safety_margin: float = 0.10, stage: int | None = None, seq_length: int | None = None,
         padded: bool = False, nodes=None, first_micro_batch: bool = False) -> Plan:
    """Per-rank memory of ``spec`` training ``shape``; ``gpu`` (catalogue name) or the spec's gpu_type.

    On CPU workers (no GPU) the "device" is host memory: the capacity is the host budget when one is
    set, else ``DEFAULT_HOST_BYTES``, and offloaded state lands in the same RAM. A pipeline's plan is
    its fullest stage's, or stage ``stage``'s when given (the accuracy benchmark compares every rank).
    ``seq_length``: the padded width of the widest micro-batch when the data is known (service/memory/data.py),
    else every row is padded to ``max_seq_length``; ``padded``: that micro-batch holds shorter rows, so
    attention runs with a padding mask (not on a pipeline, whose stages run causal attention unmasked).
    ``host_memory`` is service/memory/host.py's: per rank, and against the fullest of ``nodes``
    (service/memory/nodes.py) when given — a node short of memory makes the plan not fit.
    ``first_micro_batch``: the first micro-batch of an accumulated step, whose forward holds no gradient yet
    (service/memory/steps.py plans each micro-batch of a step).
    """
    job = planned_job(spec, shape, gpu, world_size=world_size, seq_length=seq_length, padded=padded,
                      first_micro_batch=first_micro_batch)
    t, g, on_gpu, rg = job.t, job.gpu, job.on_gpu, job.regime
    assumptions = general_assumptions(job, seq_length) + _method_assumptions(job)
    # 2. the model states in the regime's dtypes, split by the strategy
    sb = state_bytes(rg, job.shape, job.parameters, job.trainable, job.qlora)
    # torch's AdamW keeps a 0-dim fp32 ``step`` per parameter (torch/optim/adam.py: _init_group), on the CPU unless
    # fused or capturable: 4 bytes a trainable tensor, on every rank, beside the moments (measured: the whole
    # difference, 128 B for LoKr's 32 tensors, between planned and counted optimizer states on CPU workers).
    adam_steps = 4 * len(job.trainable_numels) if not on_gpu else 0
    terms = STRATEGIES[job.strategy].states(job, sb, adam_steps)
    assumptions += terms.assumptions
    # 3. what the offloading libraries allocate on the host beyond the states (service/memory/host.py)
    extra = host_memory.offload_terms(
        spec, world=job.world, on_gpu=on_gpu, trainable_numels=job.trainable_numels,
        all_numels=job.shape.parameter_numels() + (job.trainable_numels if not job.full else []),
        trainable_dtype=rg.trainable_dtype, grad_dtype=rg.grad_dtype)
    terms.host.gradients += extra.gradients
    terms.host.overhead += extra.overhead
    if extra.overhead:
        assumptions.append("host: pinned buffers rounded up to powers of two (torch's pinned allocator)")
    # 4-5. the activations of every rank view, the instants of its step; the fullest decides
    fullest = None
    for view, act, A in _activation_options(job, terms, stage):
        s = step(job, terms, view, act, A)
        if view is not None:
            blocks = " and ".join(f"{r.start}–{r.stop - 1}" for r in (view.local_blocks or [view.blocks]))
            assumptions.append(f"stage {view.index}: blocks {blocks}, {view.in_flight} chunk(s) in flight, "
                               f"peak {s.peak / MiB:.1f} MiB")
        if fullest is None or s.peak > fullest.peak:
            fullest = s
    dev, host, phases = fullest.dev, fullest.host, fullest.phases
    peak_phase = max(phases, key=lambda k: phases[k])
    dev.gradients, dev.activations, dev.temporary = fullest.cands[peak_phase]
    if terms.host_grads_per_instant:  # the gradients live at the peak instant are the offloaded (host) ones
        host.gradients, dev.gradients = dev.gradients, 0
    # 6. overhead, capacity, the measured margin, fits
    if on_gpu:
        dev.overhead = g.context_bytes + (g.nccl_bytes if job.world > 1 else 0)
        # The caching allocator rounds blocks and keeps freed ones: budget ~5% of the live peak.
        dev.overhead += int(0.05 * phases[peak_phase])
        assumptions.append(f"overhead: CUDA context {g.context_bytes // MiB} MiB"
                           + (f", NCCL {g.nccl_bytes // MiB} MiB" if job.world > 1 else "")
                           + ", allocator rounding/cache 5% of the live peak")
    runtime = 0 if on_gpu else CPU_RUNTIME_BYTES
    capacity = g.capacity_bytes if on_gpu else t.resources.host_memory_budget_bytes or DEFAULT_HOST_BYTES
    usable = int(capacity * (1 - safety_margin))
    # The planner's own measured error for this strategy (service/memory/accuracy.py) must fit too.
    accuracy, accuracy_source = accuracy_margin(spec)
    peak = dev.total + (0 if on_gpu else host.total)
    accuracy_bytes = math.ceil(peak * accuracy)
    need = dev.total + (0 if on_gpu else host.total + runtime) + accuracy_bytes
    if not on_gpu:
        assumptions.append("CPU worker: device and host are the same RAM; capacity is the host budget "
                           f"(or {DEFAULT_HOST_BYTES // 2**30} GiB), plus ~{CPU_RUNTIME_BYTES // MiB} MiB process runtime")
    assumptions.append(f"fits when the predicted peak ≤ capacity × (1 − {safety_margin:.2f})")
    if accuracy_bytes:
        assumptions.append(f"plus the planner's measured under-prediction for this strategy, {accuracy:.2%} of the "
                           f"peak ({accuracy_source})")
    P, Pt, N = job.parameters, job.trainable, job.world
    if job.model_shape is not job.shape:  # tensor: the bytes are one rank's, the counts the whole model's
        Pt, N = trainable_parameters(spec, job.model_shape), N * job.tensor_size
        P = job.model_shape.parameter_count() + (Pt if not job.full else 0)
        assumptions += job.tensor_assumptions
    result = Plan(
        fits=need <= usable, parameter_count=P, trainable_parameter_count=Pt, world_size=N, gpu=g.name if g else None,
        capacity_bytes=capacity, usable_bytes=usable, safety_margin=safety_margin,
        # on CPU workers offloaded state shares the RAM with the "device" and is added
        peak_bytes=peak, peak_phase=peak_phase, per_rank=PerRank(device=dev, host=host), phases=phases,
        runtime_bytes=runtime, model_states=fullest.state, activations_saved_bytes=fullest.activations_saved,
        assumptions=assumptions, margin_bytes=usable - need, need_bytes=need, memory_policy=t.memory_policy,
        accuracy_margin=accuracy, accuracy_margin_bytes=accuracy_bytes, accuracy_source=accuracy_source,
    )
    targets = job.targets
    result.host_memory = host_memory.host_plan(
        spec, result, base_params=job.model_shape.parameter_count(), trainable=Pt if not job.full else 0,
        largest_numel=max(job.model_shape.parameter_numels(), default=0), runtime_bytes=CPU_RUNTIME_BYTES,
        nodes=nodes, safety_margin=safety_margin, family=job.model_shape.family,
        largest_adapted_numel=max((a * b for a, b in job.model_shape.targeted_linears(targets).values()), default=0)
        if targets else None)
    if result.host_memory.fits is False:
        result.fits = False
    if terms.nvme is not None:  # ZeRO-Infinity's disk (service/memory/nvme.py)
        result.disk = nvme_memory.disk_plan(spec, *terms.nvme)
        if result.disk.fits is False:
            result.fits = False
    result.job_phases = job_phases(spec, result, job.model_shape)  # load … export (service/memory/phases.py)
    if result.job_phases.fits is False:
        result.fits = False
    return result


# --- suggestions: the changes of service/memory/suggestions.py, planned ----------------------------------------


def suggest(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, safety_margin: float = 0.10,
            limit: int = 8, seq_length: int | None = None, padded: bool = False, nodes=None) -> list[Change]:
    """Changes that would make ``spec`` fit, cheapest first, each with its predicted peak.

    Single changes first; when none fits alone, cumulative combinations in cost order (e.g. bf16,
    then + checkpointing, then + LoRA), so the list always ends in something that fits if anything does.
    """
    found: list[Change] = []
    singles = []
    for name, desc, cost, patch in [*_candidates(spec, gpu), *_pipeline_candidates(spec, shape),
                                    *_tensor_candidates(spec, shape)]:
        try:
            s2 = patched_spec(spec, patch)
            if check_rules(s2):  # a change the service would refuse with a 422 is no suggestion
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded, nodes=nodes)
        except Exception:  # noqa: BLE001 - a candidate the spec rules refuse is simply not offered
            continue
        singles.append((name, desc, cost, patch, p))
        if p.fits:
            found.append(Change(name, desc, cost, p, s2))
    # Combinations: add cheap changes one at a time (greedy by cost) on top of each other.
    ordered = sorted(singles, key=lambda x: (x[2], x[4].peak_bytes))
    combo_patch: dict[str, Any] = {}
    names: list[str] = []
    cost_sum = 0
    for name, _desc, cost, patch, _ in ordered:
        if any(name.startswith(p) for p in ("micro_batch_", "workers_")) and any(
                n.startswith(name.split("_")[0]) for n in names):
            continue
        if "training.strategy" in patch and "training.strategy" in combo_patch:
            continue  # one strategy: a second would replace the first, not add to it
        trial = {**combo_patch, **patch}
        try:
            s2 = patched_spec(spec, trial)
            if check_rules(s2):
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded, nodes=nodes)
        except Exception:  # noqa: BLE001
            continue
        if len(names) >= 1 and p.peak_bytes >= plan(patched_spec(spec, combo_patch), shape, gpu,
                                                    seq_length=seq_length, padded=padded).peak_bytes:
            continue  # this change does not help on top of the others
        combo_patch, cost_sum = trial, cost_sum + cost
        names.append(name)
        if len(names) > 1 and p.fits:
            found.append(Change("+".join(names), " + ".join(names), cost_sum, p, s2))
            break
    found.sort(key=lambda s: (s.cost, s.plan.peak_bytes))
    unique: list[Change] = []
    seen = set()
    for s in found:
        if s.change not in seen:
            seen.add(s.change)
            unique.append(s)
    return unique[:limit]


def reductions(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, safety_margin: float = 0.10,
               limit: int = 6, seq_length: int | None = None, padded: bool = False) -> list[Change]:
    """Single changes that lower the predicted peak, lowest peak first (cheapest among equals) — what an
    out-of-memory post-mortem offers when the job's plan had no suggestions. Changes the spec's rules
    refuse are not offered."""
    base = plan(spec, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded)
    out = []
    for name, desc, cost, patch in _candidates(spec, gpu):
        try:
            s2 = patched_spec(spec, patch)
            if check_rules(s2):
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded)
        except Exception:  # noqa: BLE001 - a change the spec rules refuse is not offered
            continue
        if p.peak_bytes < base.peak_bytes:
            out.append(Change(name, desc, cost, p, s2))
    out.sort(key=lambda x: (x.plan.peak_bytes, x.cost))
    return out[:limit]
