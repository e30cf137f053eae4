"""DeepSpeed ZeRO 0-3 (workers/strategies/deepspeed.py): which model states each stage partitions over the
data-parallel ranks, the reduce and all-gather buckets memfit sizes (service/domain/training.py:
deepspeed_buckets), ZeRO-3's gathered parameters, and what offload moves to host memory.

In 16-bit mode DeepSpeed converts the whole module (frozen base included) and its gradients; the optimizer keeps
fp32 masters of what trains; from ZeRO-1 on an fp32 flat partition too, and for its step a flattened fp32 copy of
the partition's gradients (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py).
"""

from __future__ import annotations

from service.domain.spec import PeftMethod
from service.domain.training import deepspeed_buckets, dtype_bytes
from service.memory import nvme
from service.memory.job import PlannedJob
from service.memory.precision import StateBytes
from service.memory.strategies.terms import StrategyTerms, optimizer_unit


def states(job: PlannedJob, sb: StateBytes, adam_steps: int) -> StrategyTerms:
    """``adam_steps`` is not DeepSpeed's: its optimizers step flat partitions, whose step counters are few."""
    t, shape, rg, N, Pt = job.t, job.shape, job.regime, job.world, job.trainable
    ds = t.deepspeed
    stage = ds.zero_stage
    terms = StrategyTerms(opt_temp_unit=optimizer_unit(job))
    dev = terms.dev
    buckets = deepspeed_buckets(shape.hidden, ds.reduce_bucket_elements)
    p_bytes = dtype_bytes(rg.frozen_dtype)  # DeepSpeed's 16-bit mode converts the whole module
    terms.comm = (buckets.reduce_elements + buckets.allgather_elements) * dtype_bytes(rg.grad_dtype)
    # 16-bit weights: fp32 masters in the optimizer; ZeRO >= 1 also keeps an fp32 flat partition in fp32
    master_bytes = dtype_bytes(rg.master_dtype or "float32")
    master = Pt * master_bytes if rg.master_dtype is not None or stage >= 1 else 0
    if stage == 0:
        dev.parameters = sb.parameters
        dev.gradients = sb.gradients
        dev.optimizer_states = sb.optimizer + (Pt * master_bytes if rg.master_dtype is not None else 0)
    elif stage in (1, 2):
        dev.parameters = sb.parameters
        dev.gradients = sb.gradients if stage == 1 else sb.gradients // N
        # ZeRO-1 reduces every gradient into the rank's flat partition at the accumulation boundary and then frees
        # them: stage_1_and_2.py's ipg_epilogue ends in _clear_param_grad_only ("Clear param.grad so
        # safe_get_full_grad() goes through the proper _hp_mapping path"), so the optimizer step holds the partition's
        # fp32 copy (master_grad) and no full gradient (measured: bench/step_accuracy.py, zero1 bf16 acc2, the
        # optimizer instant one 16-bit gradient copy lower than planned before, +14.29% on every step it peaked in)
        terms.grads_freed_before_step = stage == 1
        if stage == 2 and ds.offload_optimizer != "cpu" and job.trainable_numels:
            dev.gradients = zero2_gradient_buffer_elements(job.trainable_numels, N) * dtype_bytes(rg.grad_dtype)
        dev.optimizer_states = (sb.optimizer + master) // N
    else:
        dev.parameters = sb.parameters // N
        dev.gradients = sb.gradients // N
        dev.optimizer_states = (sb.optimizer + master) // N
        terms.grads_in_forward = True  # ZeRO-3's flat gradient partition buffer, allocated once and kept (measured)
        terms.zero3_linear = True
        _zero3_gathered(job, terms, sb.parameters, buckets, p_bytes)
    if ds.offload_optimizer in ("cpu", "nvme"):
        terms.host.optimizer_states, dev.optimizer_states = dev.optimizer_states, 0
        # the host keeps an fp32 copy of the gradient partition for the CPU optimizer (measured)
        terms.host.gradients, dev.gradients = dev.gradients + (Pt // N) * 4, 0
        # DeepSpeedCPUAdam (deepspeed/ops/adam/cpu_adam.py) steps in C++, in place on the fp32 partition, whose
        # gradient buffer host.gradients already holds: no host temporaries
        terms.offloaded_step = True
    if ds.offload_param in ("cpu", "nvme"):
        terms.host.parameters, dev.parameters = dev.parameters, 0
    if nvme.wanted(job.spec):  # on the disk, swapped through host buffers (service/memory/nvme.py)
        terms.nvme = nvme.swap(job.spec, terms.host, world=N, parameters=job.parameters, trainable=Pt,
                               on_gpu=job.on_gpu, largest_numel=max(shape.parameter_numels(), default=0),
                               param_bytes=p_bytes)
        terms.assumptions.append(f"ZeRO-Infinity: {terms.nvme[0] / 2**30:.2f} GiB per rank on the disk at "
                                 f"{ds.nvme_path}, swapped through {terms.nvme[1] / 2**30:.2f} GiB of host buffers")
    terms.assumptions.append(f"DeepSpeed ZeRO-{stage}: reduce bucket {buckets.reduce_elements} elements, prefetch "
                             "0.9·hidden², persistence threshold 10·hidden")
    if stage >= 1:
        terms.opt_temp_unit = (Pt // N) * 4  # the step runs on the flat fp32 partition
        terms.master_grad = (Pt // N) * 4  # its gradients flattened to fp32 for the step
    return terms


def _zero3_gathered(job: PlannedJob, terms: StrategyTerms, base_param_bytes: int, buckets, p_bytes: int) -> None:
    """ZeRO-3's gathered parameters: all of them when the model is within ``stage3_max_reuse_distance`` (memfit sets
    DeepSpeed's default, 1e9 elements: every parameter is reused within it, so it stays gathered), less the frozen
    ones no backward reaches; else the two largest layers and the prefetch bucket."""
    t, shape, P = job.t, job.shape, job.parameters
    if P > buckets.max_reuse_distance:
        terms.gathered = terms.gathered_layer = (2 * shape.largest_layer_params() + buckets.prefetch_elements) * p_bytes
        return
    gathered = base_param_bytes  # every param is reused within max_reuse_distance: kept gathered
    terms.gathered_layer = gathered
    if not job.full and not shape.tied_embeddings and not t.gradient_checkpointing:
        # a frozen, untied lm_head is released after its forward and is not live at the
        # loss or at the start of backward (measured with LoRA; with checkpointing it stays)
        gathered -= shape.vocab * shape.hidden * p_bytes
    if not job.full:
        # Other frozen weights no backward reaches are released after their forward too, so they are not
        # gathered at the loss: GPT-2's position embeddings, and the first block's linears that read its
        # input where that input needs no gradient (no checkpointing hook, not prompt tuning), whose
        # frozen weights DeepSpeed's linear (deepspeed/runtime/zero/linear.py) needs for no input gradient
        # (measured: GPT-2 IA3 under ZeRO-3, wpe and block 0's c_attn not gathered at the loss)
        gathered -= shape.learned_positions * shape.hidden * p_bytes
        if not t.gradient_checkpointing and t.peft.method != PeftMethod.prompt_tuning:
            first = ("c_attn",) if shape.family == "gpt2" else ("q_proj", "k_proj", "v_proj")
            lin = shape.linear_shapes()
            gathered -= sum(lin[n][0] * lin[n][1] for n in first) * p_bytes
    terms.gathered = gathered
    terms.assumptions.append("ZeRO-3: the model is smaller than stage3_max_reuse_distance, so gathered "
                             "parameters stay live through forward and backward")


def zero2_gradient_buffer_elements(numels: list[int], world: int) -> int:
    """ZeRO-2's gradient buffer on its fullest rank.

    DeepSpeed flattens the trainable tensors in order, pads the total to a multiple of 2·world and cuts
    it into equal partitions; each rank then allocates room for the *whole* of every tensor that
    overlaps its partition (``copy_grads_in_partition``), so a rank whose partition ends inside a
    tensor holds that tensor's full gradient (measured: up to 1.8% of the gradients at hidden 256).
    """
    alignment = 2 * world
    total = sum(numels)
    part = -(-total // alignment) * alignment // world
    fullest = 0
    for rank in range(world):
        lo, hi = rank * part, (rank + 1) * part
        held, start = 0, 0
        for n in numels:
            if start < hi and start + n > lo:
                held += n
            start += n
        fullest = max(fullest, held)
    return fullest
