"""Host memory, planned: what each rank holds in the node's RAM, and what the fullest node needs.

Offloading moves the problem to the host: ZeRO-3 offload users find out when the kernel kills the
job. Two parts, pure arithmetic like the planner (service/memory/planner.py):

**The host column of a rank** (the planner's ``host`` Breakdown, at the step's peak), completed here
with what the offloading libraries allocate on the host beyond the states themselves:

- *pinned rounding* (GPU workers; memfit pins offloaded memory there — workers/strategies/deepspeed.py
  ``pin_memory``, fsdp.py ``CPUOffloadPolicy(pin_memory=True)``): torch's pinned allocator rounds every
  allocation up to the next power of two before asking CUDA for it (aten/src/ATen/core/
  CachingHostAllocator.h: ``roundSize = c10::llvm::PowerOf2Ceil(size)``), so a 3.4 GiB pinned buffer
  holds 4 GiB of RAM. Counted as ``host.overhead``, per pinned tensor:
  DeepSpeed ZeRO-1/2 offload (deepspeed/runtime/zero/stage_1_and_2.py): the fp32 master partition, its
  16-bit staging copy (``param_buffer_of_bit16_for_cpu_offload_groups``), the fp32 gradient partition,
  ``temp_grad_buffer_for_cpu_offload`` and, with accumulation, one buffer per parameter of the
  partition (``accumulated_grads_in_cpu``); ZeRO-3 (stage3.py): ``grad_partitions_flat_buffer``, the
  fp32 gradient of each optimizer sub-group (``sub_group_size`` 1e9 elements) and, with
  ``offload_param``, the 16-bit parameter partition (``param_groups_fp16_flat_cpu_memory``); FSDP2
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): each parameter's padded shard, and each
  gradient shard it copies to the host with ``non_blocking=True`` (pinned destination);
- *DeepSpeed ZeRO-1/2 offload's gradient staging* (stage_1_and_2.py, CPU and GPU alike):
  ``temp_grad_buffer_for_cpu_offload`` (the largest trainable tensor, 16-bit) and, when accumulating,
  ``accumulated_grads_in_cpu`` (each parameter of the partition whole, 16-bit): counted in
  ``host.gradients``.

**The node** (:func:`host_plan`, the plan's ``host_memory``): per rank, the host bytes at four
instants — *load* (:func:`load_bytes`: each rank reads only what it holds, in the dtype it holds it in,
from the checkpoint's safetensors files: workers/weights.py), *step* (the host column, plus on a CPU worker everything, its
process included), *checkpoint* (workers/checkpoint.py: ddp's ``full_model_state`` copies the
state to the host on every rank; DeepSpeed's and the pipeline's ``torch.save`` stage one device
storage at a time, at most the largest; FSDP2's DCP writes shard by shard), *export* (rank 0 only,
:func:`export_extra_bytes`: streamed one tensor at a time, a PEFT merge read from the base's files) —
each plus the worker process itself (``CPU_RUNTIME_BYTES``, measured on CPU workers; a CUDA
worker's libraries take more, not measured here, so on GPU nodes this term is a lower bound). The
fullest node holds as many ranks as fit it (Ray Train places its workers with the PACK strategy) and
rank 0; its need is the largest instant, compared with what Ray found on the node
(service/memory/nodes.py) less the safety margin. Ray unreachable and no node described in the
settings: not checked, and the plan says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.domain.plan import HostPlan, Plan
from service.domain.spec import JobSpec, PeftMethod, StrategyName
from service.domain.training import MERGEABLE_PEFT, dtype_bytes, regime

DEEPSPEED_SUB_GROUP_ELEMENTS = 10**9  # deepspeed/runtime/zero/config.py: sub_group_size default (memfit sets none)


def pow2(n: int) -> int:
    """The next power of two ≥ n: what torch's pinned host allocator reserves for n bytes."""
    return 1 << max(0, math.ceil(math.log2(n))) if n > 0 else 0


def pinned_rounding(sizes: list[int]) -> int:
    """The bytes pinning ``sizes`` (one allocation each) takes beyond the sizes themselves."""
    return sum(pow2(s) - s for s in sizes if s > 0)


def _partition_numels(numels: list[int], world: int) -> list[int]:
    """The whole trainable tensors that overlap the fullest rank's ZeRO-1/2 partition (flat, padded to
    2·world, cut in equal parts: planner.zero2_gradient_buffer_elements's rule)."""
    alignment = 2 * world
    part = -(-sum(numels) // alignment) * alignment // world
    best: list[int] = []
    for rank in range(world):
        lo, hi = rank * part, (rank + 1) * part
        held, start = [], 0
        for n in numels:
            if start < hi and start + n > lo:
                held.append(n)
            start += n
        if sum(held) > sum(best):
            best = held
    return best


@dataclass
class HostTerms:
    """What :func:`offload_terms` adds to a rank's host column."""

    gradients: int = 0  # DeepSpeed ZeRO-1/2 offload's gradient staging buffers
    overhead: int = 0  # pinned rounding


def offload_terms(spec: JobSpec, *, world: int, on_gpu: bool, trainable_numels: list[int], all_numels: list[int],
                  trainable_dtype: str, grad_dtype: str) -> HostTerms:
    """The host bytes DeepSpeed's offload and FSDP2's CPU offload allocate beyond the offloaded states
    (see the module docstring); zero when nothing is offloaded."""
    t = spec.training
    out = HostTerms()
    Pt = sum(trainable_numels)
    Pp = -(-Pt // world)  # one rank's partition of the trainable elements
    b16 = dtype_bytes(trainable_dtype)  # DeepSpeed's "bit16" groups are the module's dtype (fp32 when not 16-bit)
    largest = max(trainable_numels, default=0)
    pinned: list[int] = []
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_optimizer in ("cpu", "nvme"):
        ds = t.deepspeed
        accumulating = spec.resolved().gradient_accumulation_steps > 1
        if ds.zero_stage in (1, 2):
            held = _partition_numels(trainable_numels, world) if accumulating else []
            out.gradients = largest * b16 + sum(n * b16 for n in held)
            pinned += [4 * Pp, b16 * Pp, 4 * Pp, largest * b16, *(n * b16 for n in held)]
        elif ds.zero_stage == 3:
            groups = [min(DEEPSPEED_SUB_GROUP_ELEMENTS, Pp - i) for i in range(0, Pp, DEEPSPEED_SUB_GROUP_ELEMENTS)]
            pinned += [b16 * Pp, *(4 * g for g in groups)]
            if ds.offload_param == "cpu":
                pinned.append(b16 * Pp)
    elif t.strategy == StrategyName.fsdp and t.fsdp.cpu_offload:
        pinned += [-(-n // world) * dtype_bytes(trainable_dtype) for n in all_numels]
        pinned += [-(-n // world) * dtype_bytes(grad_dtype) for n in trainable_numels]
    if on_gpu:
        out.overhead = pinned_rounding(pinned)
    return out


# --- the node -----------------------------------------------------------------------------------------


def export_extra_bytes(spec: JobSpec, *, largest_numel: int, largest_adapted_numel: int, trainable: int,
                       held_dtype_bytes: int, on_gpu: bool) -> int:
    """Rank 0's host bytes beyond its steady state while it exports (workers/export.py: streamed, one tensor at
    a time, in the base checkpoint's dtype — planned at 4 bytes an element, the most a checkpoint holds).

    - PEFT: the trained adapter gathered whole and a fresh adapter beside it (2 × 4 bytes a trainable
      parameter); the merge reads each base tensor from the checkpoint (the largest, 4 bytes an element) or,
      for an adapted weight, reads it, folds the adapter in in fp32 and casts it back (the read, the fp32 weight,
      the adapter's fp32 delta and the cast: 2 + 4 + 4 + 2 bytes an element, at most 12 with a 16-bit file);
    - a full fine-tune: each tensor gathered whole (FSDP2, tensor parallel, ZeRO-3, a pipeline stage's sent to
      rank 0) in the dtype it is held in, then cast to the checkpoint's: the largest, in both. On a CPU worker
      under DDP or ZeRO-0/1/2 the tensor is already in this RAM: only the cast."""
    t = spec.training
    if t.peft.method != PeftMethod.none:
        if not (t.peft.method.value in MERGEABLE_PEFT and t.peft.merge):
            return 2 * 4 * trainable
        return 2 * 4 * trainable + max(4 * largest_numel, 12 * largest_adapted_numel)
    local = t.strategy == StrategyName.ddp or (t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage < 3)
    held = 0 if (local and not on_gpu) else largest_numel * held_dtype_bytes
    return held + 4 * largest_numel


def _checkpoint_extra_bytes(spec: JobSpec, plan: Plan, largest_bytes: int, on_gpu: bool) -> int:
    """A rank's host bytes beyond its steady state while it checkpoints (workers/checkpoint.py)."""
    t = spec.training
    if not on_gpu:
        return 0  # the state is already in this RAM; torch.save streams it
    if t.strategy == StrategyName.ddp:
        # save_full_state: full_model_state(...).cpu() on every rank, then torch.save of the optimizer state
        # copies one device storage at a time to the host
        states = plan.model_states.device
        return states.parameters + largest_bytes
    if t.strategy == StrategyName.fsdp:
        return largest_bytes  # DCP stages each shard to the host as it writes it
    # DeepSpeed / pipeline: torch.save of device tensors, one storage at a time; the largest is a flat
    # fp32 partition under ZeRO ≥ 1
    dev = plan.model_states.device
    return max(largest_bytes, dev.optimizer_states // 2 if t.strategy == StrategyName.deepspeed else 0)


LOAD_CHUNK_BYTES = 64 << 20  # workers/weights.py CHUNK_BYTES: the staging buffer of a cast or a column slice
SPLIT_ON_META = (StrategyName.fsdp, StrategyName.tensor, StrategyName.pipeline)  # built on meta, then read per rank


def load_bytes(spec: JobSpec, plan: Plan, *, largest_numel: int, trainable: int, base_dtype_bytes: int,
               on_gpu: bool, family: str | None = None) -> tuple[int, int]:
    """(device, host) bytes of one rank at the end of loading its weights, beyond the worker process
    (workers/strategies/common.py build_model and materialize, workers/weights.py).

    Every rank holds what it trains with, read from the checkpoint's safetensors files straight into place in
    its own dtype: the parameters of the plan's model states (the whole model under DDP and ZeRO-0/1/2, a shard
    under FSDP2 and ZeRO-3, a stage's blocks, a tensor-parallel slice), on the device, or on the host where
    they are offloaded or the worker has no GPU. Beside them while it reads:

    - a staging buffer: a tensor read in another dtype than it is held in, or a tensor-parallel column slice,
      passes through at most ``LOAD_CHUNK_BYTES`` at a time; a whole tensor where it is read whole to be
      rearranged first (GPT-2's fused attention under tensor parallelism) or, under ZeRO-3, made whole by
      ``deepspeed.zero.Init`` before it is partitioned (its largest parameter, on the device);
    - FSDP2, tensor parallelism and the pipeline build the model on the meta device and keep a copy of what
      was real before they shard it — the fresh adapter (fp32) — to put back afterwards;
    - QLoRA's 4-bit base is quantised tensor by tensor onto the GPU (nothing on the host), or on a CPU worker
      into the host, where the 4-bit model is what stays."""
    t = spec.training
    states = plan.model_states
    largest = largest_numel * base_dtype_bytes
    if t.peft.method == PeftMethod.qlora:
        return (states.device.parameters if on_gpu else 0), (0 if on_gpu else states.device.parameters)
    staging = min(LOAD_CHUNK_BYTES, largest)
    gpt2_fused = family == "gpt2" and t.strategy == StrategyName.tensor
    if gpt2_fused:
        staging = 2 * largest  # read whole, then rearranged (a copy)
    zero3_whole = largest if t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage == 3 else 0
    snapshot = 4 * trainable if t.strategy in SPLIT_ON_META else 0
    if on_gpu:
        return states.device.parameters + zero3_whole, states.host.parameters + staging + snapshot
    return 0, states.device.parameters + states.host.parameters + max(staging, zero3_whole) + snapshot


def ranks_per_node(spec: JobSpec, node) -> int:
    """How many of the job's workers Ray Train's PACK placement puts on ``node`` (its CPUs and GPUs)."""
    res = spec.training.resources
    fit = math.floor(node.cpus / res.cpus_per_worker + 1e-9) if res.cpus_per_worker else res.num_workers
    if res.gpus_per_worker > 0:
        fit = min(fit, math.floor(node.gpus / res.gpus_per_worker + 1e-9))
    return max(0, min(res.num_workers, fit))


def host_plan(spec: JobSpec, plan: Plan, *, base_params: int, trainable: int, largest_numel: int,
              runtime_bytes: int, nodes=None, safety_margin: float = 0.10, family: str | None = None,
              largest_adapted_numel: int | None = None) -> HostPlan:
    """The plan's ``host_memory``: per-rank host bytes at each instant, and the fullest node's need
    against its memory where the cluster's nodes are known (``nodes``: service/memory/nodes.py)."""
    on_gpu = plan.gpu is not None
    host = plan.per_rank.host
    steady = host.parameters + host.gradients + host.optimizer_states + host.overhead
    step_bytes = (plan.need_bytes - runtime_bytes if not on_gpu else host.total)
    rg = regime(spec.training.strategy.value, spec.training.peft.method.value, spec.training.precision.value)
    held_dtype = rg.trainable_dtype if spec.training.peft.method == PeftMethod.none else rg.frozen_dtype
    _, load = load_bytes(spec, plan, largest_numel=largest_numel, trainable=trainable,
                         base_dtype_bytes=dtype_bytes(held_dtype) if held_dtype in ("float32", "bfloat16", "float16")
                         else 4, on_gpu=on_gpu, family=family)
    largest_bytes = largest_numel * 4
    per_rank = {
        "load": runtime_bytes + load,
        "step": runtime_bytes + step_bytes,
        "checkpoint": runtime_bytes + (step_bytes if not on_gpu else steady)
        + _checkpoint_extra_bytes(spec, plan, largest_bytes, on_gpu),
    }
    steady_all = runtime_bytes + (step_bytes if not on_gpu else steady)
    export_extra = export_extra_bytes(
        spec, largest_numel=largest_numel, largest_adapted_numel=largest_adapted_numel or largest_numel,
        trainable=trainable, held_dtype_bytes=dtype_bytes(held_dtype) if held_dtype in ("float32", "bfloat16", "float16")
        else 4, on_gpu=on_gpu)
    per_rank_export = steady_all + export_extra
    notes = [
        "per rank: the worker process (~600 MiB measured on CPU workers"
        + ("; a CUDA worker's libraries take more, not measured here: a lower bound" if on_gpu else "")
        + "), the fp32 model built at load, the host column at the step, the checkpoint's host copies; "
        "rank 0 also exports (the trained state and a rebuilt fp32 model)"]
    out = HostPlan(per_rank_bytes={**per_rank, "export": per_rank_export}, rank0_export_extra_bytes=export_extra,
                   runtime_bytes=runtime_bytes, checked=False, fits=None, source=None, notes=notes)
    if nodes is None or not nodes.nodes:
        why = (nodes.error if nodes is not None and nodes.error else
               "no Ray dashboard address and no MEMFIT_CLUSTER_NODES")
        out.notes.append(f"host memory per node not checked: the nodes are unknown ({why})")
        return out
    out.source = nodes.source
    worst = None
    for node in nodes.nodes:
        k = ranks_per_node(spec, node)
        if k == 0:
            continue
        instants = {"load": k * per_rank["load"], "step": k * per_rank["step"],
                    "checkpoint": k * per_rank["checkpoint"], "export": (k - 1) * steady_all + per_rank_export}
        need = max(instants.values())
        usable = int(node.memory_bytes * (1 - safety_margin))
        margin = usable - need
        if worst is None or margin < worst[0]:
            worst = (margin, node, k, instants, need, usable)
    if worst is None:
        out.notes.append("host memory per node not checked: no node can hold one worker "
                         f"({spec.training.resources.cpus_per_worker} CPU, {spec.training.resources.gpus_per_worker} GPU)")
        return out
    margin, node, k, instants, need, usable = worst
    peak = max(instants, key=lambda x: instants[x])
    out.checked, out.fits = True, margin >= 0
    out.node_id, out.ranks_on_node, out.node_instants_bytes = node.node_id, k, instants
    out.node_need_bytes, out.node_peak_instant = need, peak
    out.node_memory_bytes, out.node_usable_bytes, out.node_margin_bytes = node.memory_bytes, usable, margin
    out.notes.append(f"the fullest node ({node.node_id[:12]}, {nodes.source}) holds {k} rank(s) and rank 0; "
                     f"its need peaks at {peak}; fits when ≤ its memory × (1 − {safety_margin:.2f})")
    return out


def summary(host: HostPlan) -> dict[str, Any]:
    return host.model_dump(mode="json")
