"""What a strategy contributes to a rank's plan: the model states it holds where (device or host), and the
buffers it adds at the instants of a step (service/memory/instants.py reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.domain.plan import Breakdown
from service.memory.job import PlannedJob
from service.memory.peft import largest_trainable
from service.memory.precision import StateBytes


@dataclass
class StrategyTerms:
    dev: Breakdown = field(default_factory=Breakdown)  # parameters, gradients, optimizer states on the device
    host: Breakdown = field(default_factory=Breakdown)  # the same, offloaded to host memory
    opt_temp_unit: int = 0  # bytes: 4 × the largest unit the optimizer steps at once (its temporaries: 2 of them)
    gathered: int = 0  # parameters materialised at the loss (forward's end, backward's start) beyond the shards
    gathered_layer: int = 0  # parameters materialised while one block runs (its forward, recompute or backward)
    loss_gathered: int = 0  # parameters gathered while the loss runs and is differentiated, beyond ``gathered``
    root_reduce: int = 0  # FSDP2, full fine-tune: the root's reduce-scatter temporaries, an instant of their own
    comm: int = 0  # communication buckets live at the end of backward
    held: int = 0  # buffers the strategy allocates once and keeps, live at every instant (DDP's reducer buckets)
    grads_in_forward: bool = False  # a gradient buffer allocated once and kept (ZeRO-3), live in forward too
    grads_freed_before_step: bool = False  # the full gradients are freed once reduced, before the optimizer step (ZeRO-1)
    master_grad: int = 0  # DeepSpeed ZeRO ≥ 1: the fp32 copy of the partition's gradients for the step
    offloaded_step: bool = False  # the optimizer steps host tensors
    host_step_temporaries: bool = False  # that step is torch's AdamW on host tensors (FSDP2): its temporaries too
    host_grads_per_instant: bool = False  # offloaded gradients that exist only from backward to zero_grad (FSDP2)
    zero3_linear: bool = False  # DeepSpeed ZeRO-3's linear keeps frozen linears' inputs (activations)
    stage_views: list[Any] = field(default_factory=list)  # pipeline: every stage (strategies/pipeline.py)
    nvme: tuple[int, int] | None = None  # ZeRO-Infinity: (bytes a rank swaps to the disk, its host swap buffers)
    assumptions: list[str] = field(default_factory=list)


def optimizer_unit(job: PlannedJob) -> int:
    """4 bytes × the largest unit torch's AdamW updates at once (service/memory/peft.py: largest_trainable)."""
    return max(largest_trainable(job.spec, job.shape, job.targets), 1) * 4


def replicated(job: PlannedJob, sb: StateBytes, adam_steps: int) -> Breakdown:
    """Every state whole on the rank (DDP, a tensor-parallel group of one replica, ZeRO-0)."""
    return Breakdown(parameters=sb.parameters, gradients=sb.gradients, optimizer_states=sb.optimizer + adam_steps)
