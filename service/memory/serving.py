"""A serving replica's memory, planned like a training rank's: pure arithmetic on the model's shape.

    weights      parameters × bytes per parameter in the serving dtype (fp32, bf16/fp16, or 4-bit NF4 with
                 its fp32 absmax per 64-weight block);
    adapters     each resident adapter's parameters (LoRA: r × (in + out) per targeted linear) in fp32,
                 × the adapters a replica keeps (MEMFIT_SERVE_MAX_ADAPTERS, the multiplexed LRU's size);
    kv cache     2 (K and V) × layers × kv heads × head dim × dtype bytes per token, × the context length,
                 × the sequences generated at once (the engine's batch);
    activations  one forward of the batch's widest step: the logits (batch × vocab in fp32) and a layer's
                 hidden states at the prompt's length — small next to the rest for a decode loop;
    runtime      the replica process itself (Python, torch, transformers, Ray's worker): a measured constant.

:func:`admit` refuses a deployment whose replica does not fit the memory a replica may use
(MEMFIT_SERVE_REPLICA_MEMORY_BYTES) with 507-free language: ``insufficient_memory`` (422), its breakdown
attached. The model page (api/routes/serving.py) shows this plan beside what the replica measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from service.domain.errors import UnprocessableEntity
from service.domain.units import gib
from service.memory.shape import ModelShape

DTYPE_BYTES = {"float32": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0,
               "nf4": 0.5 + 4 / 64, "4bit": 0.5 + 4 / 64}
# A CPU replica's own process before any model: the interpreter, torch, transformers, peft and Ray's
# worker (measured on this project's replicas: RSS of a replica holding a tiny preset, ~560-640 MB).
RUNTIME_BYTES = 600 * 1024**2
DEFAULT_LORA_TARGETS = ["q_proj", "v_proj"]


@dataclass(frozen=True)
class ServingPlan:
    weights_bytes: int
    adapters_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    runtime_bytes: int
    dtype: str
    context_length: int
    concurrent_sequences: int
    adapters_resident: int
    kv_bytes_per_token: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.adapters_bytes + self.kv_cache_bytes + self.activation_bytes + self.runtime_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def kv_bytes_per_token(shape: ModelShape, dtype: str = "float32") -> int:
    kv_dtype = 2.0 if dtype in ("nf4", "4bit") else DTYPE_BYTES[dtype]  # a 4-bit model's cache is in its compute dtype
    return int(2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_dtype)


def plan_serving(shape: ModelShape, *, dtype: str = "float32", context_length: int = 1024, concurrent_sequences: int = 8,
                 adapters_resident: int = 0, lora_r: int = 8, lora_targets: list[str] | None = None,
                 runtime_bytes: int = RUNTIME_BYTES) -> ServingPlan:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown serving dtype {dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    weights = int(shape.parameter_count() * DTYPE_BYTES[dtype])
    adapter_params = shape.lora_params(lora_r, lora_targets or DEFAULT_LORA_TARGETS) if adapters_resident else 0
    adapters = int(adapter_params * 4 * adapters_resident)
    per_token = kv_bytes_per_token(shape, dtype)
    kv = per_token * context_length * concurrent_sequences
    activations = concurrent_sequences * shape.vocab * 4 + concurrent_sequences * context_length * shape.hidden * 4
    return ServingPlan(weights, adapters, kv, activations, runtime_bytes, dtype, context_length, concurrent_sequences,
                       adapters_resident, per_token)


class ServingDoesNotFit(UnprocessableEntity):
    code, title = "insufficient_memory", "Insufficient memory"

    def __init__(self, plan: ServingPlan, capacity_bytes: int):
        super().__init__(f"a serving replica of this model is predicted to need {gib(plan.total_bytes)} "
                         f"(weights {gib(plan.weights_bytes)}, adapters {gib(plan.adapters_bytes)}, KV cache "
                         f"{gib(plan.kv_cache_bytes)} for {plan.concurrent_sequences} sequences of {plan.context_length} "
                         f"tokens); a replica may use {gib(capacity_bytes)} (MEMFIT_SERVE_REPLICA_MEMORY_BYTES)",
                         param="model")
        self.extensions = {"plan": plan.to_dict(), "capacity_bytes": capacity_bytes}


def admit(plan: ServingPlan, capacity_bytes: int | None) -> None:
    """Refuse (ServingDoesNotFit) a deployment whose replica is predicted not to fit ``capacity_bytes``."""
    if capacity_bytes and plan.total_bytes > capacity_bytes:
        raise ServingDoesNotFit(plan, capacity_bytes)
