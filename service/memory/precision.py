"""The precision regime as the planner reads it: how wide each tensor a step keeps is.

Which regime a job runs in, and the dtype of each model state (frozen base, trained weights, gradients,
AdamW's moments, a master copy), is service/domain/training.py's :func:`regime`, the rule the workers
build from. Here: what that regime means for the activations (the element sizes of what forward keeps)
and for the model states (their bytes on one rank before any strategy splits them).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.domain.training import Regime, dtype_bytes
from service.memory.nf4 import qlora_base_bytes
from service.memory.shape import ModelShape


@dataclass(frozen=True)
class ActivationSizes:
    """How a regime (service/domain/training.py) stores tensors in forward: element sizes of linear
    outputs and of the residual stream, and whether each linear casts its own copies."""

    name: str  # fp32 | autocast | pure16 | lora16, the Regime's name
    act: int  # bytes per element of linear/attention outputs
    residual: int  # bytes per element of the residual stream between blocks
    casts: bool  # autocast: each linear makes its own bf16 copy of its input (and weight)


ACTIVATION_SIZES = {"fp32": ActivationSizes("fp32", 4, 4, False), "autocast": ActivationSizes("autocast", 2, 4, True),
                    "pure16": ActivationSizes("pure16", 2, 2, False),
                    # a bf16 frozen base (bf16 residual stream, no weight casts) with an fp32 adapter that
                    # PEFT feeds an fp32 copy of its input and autocast casts per matmul
                    "lora16": ActivationSizes("lora16", 2, 2, True)}


@dataclass(frozen=True)
class StateBytes:
    """One rank's model states before a strategy splits them: every parameter, gradient and AdamW moment."""

    parameters: int  # the frozen base in its dtype (QLoRA: packed NF4 and its constants) + the trained weights
    gradients: int  # one gradient per trainable parameter, in the regime's gradient dtype
    optimizer: int  # AdamW's two moments per trainable parameter


def state_bytes(rg: Regime, shape: ModelShape, P: int, Pt: int, qlora: bool) -> StateBytes:
    """``P`` parameters of which ``Pt`` train, held as regime ``rg`` holds them."""
    if not qlora:
        params = (P - Pt) * dtype_bytes(rg.frozen_dtype) + Pt * dtype_bytes(rg.trainable_dtype)
    else:  # NF4 codes and constants for the quantised linears, the rest and the fp32 adapter as they are
        params = qlora_base_bytes(shape, dtype_bytes(rg.compute_dtype)) + Pt * 4
    return StateBytes(params, Pt * dtype_bytes(rg.grad_dtype), Pt * 2 * dtype_bytes(rg.optimizer_dtype))
