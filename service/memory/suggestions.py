"""The changes the planner tries when a job does not fit (or, after an out-of-memory failure, that lower its
peak): each single change worth trying, as a patch to the spec, with its cost. service/memory/planner.py plans
each (``suggest``, ``reductions``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.domain.plan import Plan
from service.domain.spec import JobSpec, PeftMethod, Precision, StrategyName
from service.domain.training import pipeline_problem, tensor_problem
from service.memory.gpus import get_gpu
from service.memory.shape import ModelShape


@dataclass
class Change:
    """A change the planner tried: its name, what it does, its cost, the changed spec and its plan."""

    change: str
    description: str
    cost: int  # lower is cheaper: speed or quality given up
    plan: Plan
    spec: JobSpec


def patched_spec(spec: JobSpec, patch: dict[str, Any]) -> JobSpec:
    """``spec`` with the dotted fields of ``patch`` set (a suggestion's or a downshift's change)."""
    body = spec.model_dump(mode="json")
    for dotted, value in patch.items():
        node = body
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return JobSpec.model_validate(body)


def _candidates(spec: JobSpec, gpu: str | None) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(name, description, cost, patch) for each single change worth trying."""
    t = spec.training
    on_gpu = bool(gpu or t.resources.gpu_type)
    out: list[tuple[str, str, int, dict[str, Any]]] = []
    if t.precision == Precision.fp32 and (not on_gpu or get_gpu(gpu or t.resources.gpu_type).bf16):
        out.append(("bf16", "train in bf16 mixed precision", 1, {"training.precision": "bf16"}))
    if not t.gradient_checkpointing:
        out.append(("gradient_checkpointing", "recompute activations in backward (~+30% compute)", 2,
                    {"training.gradient_checkpointing": True}))
    mb = t.hyperparameters.micro_batch_size
    r = spec.resolved()
    k = 2
    while mb // k >= 1 and k <= 64:
        new_mb = mb // k
        if mb % k == 0:
            patch: dict[str, Any] = {"training.hyperparameters.micro_batch_size": new_mb,
                                     "training.hyperparameters.gradient_accumulation_steps": r.gradient_accumulation_steps * k}
            if spec.openai_hyperparameters.batch_size != "auto":
                patch.pop("training.hyperparameters.gradient_accumulation_steps")
            out.append((f"micro_batch_{new_mb}", f"micro-batch {new_mb} with {r.gradient_accumulation_steps * k}× "
                        f"accumulation (global batch {r.global_batch_size} kept)", 2 + k // 2, patch))
        k *= 2
    if t.peft.method == PeftMethod.none and not t.qat.enabled:
        out.append(("lora", "train a LoRA adapter (r=16) instead of every weight", 4,
                    {"training.peft.method": "lora", "training.peft.r": 16}))
    n = t.resources.num_workers
    if t.strategy == StrategyName.ddp and n > 1 and not t.qat.enabled:
        out.append(("fsdp", "shard parameters, gradients and optimizer states with FSDP2", 3,
                    {"training.strategy": "fsdp"}))
        out.append(("zero3", "DeepSpeed ZeRO-3: shard parameters, gradients and optimizer states", 3,
                    {"training.strategy": "deepspeed", "training.deepspeed.zero_stage": 3}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage < 3 and n > 1:
        out.append(("zero3", "DeepSpeed ZeRO-3", 3, {"training.deepspeed.zero_stage": 3}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_optimizer == "none" and t.deepspeed.zero_stage >= 1:
        out.append(("offload_optimizer", "offload optimizer states to host memory (slower steps)", 5,
                    {"training.deepspeed.offload_optimizer": "cpu"}))
    if t.strategy in (StrategyName.ddp,) and not t.qat.enabled:
        out.append(("zero3_offload", "DeepSpeed ZeRO-3 with optimizer and parameters offloaded to host memory", 6,
                    {"training.strategy": "deepspeed", "training.deepspeed.zero_stage": 3,
                     "training.deepspeed.offload_optimizer": "cpu", "training.deepspeed.offload_param": "cpu"}))
    if t.strategy == StrategyName.fsdp and not t.fsdp.cpu_offload:
        out.append(("fsdp_offload", "FSDP2 with CPU offload of the shards", 6, {"training.fsdp.cpu_offload": True}))
    # Host memory short (service/memory/host.py): bring offloaded state back to the GPU where it fits there.
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_param == "cpu":
        out.append(("no_offload_param", "keep the parameters on the GPU (less host memory)", 3,
                    {"training.deepspeed.offload_param": "none"}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_optimizer == "cpu":
        out.append(("no_offload", "keep parameters and optimizer states on the GPU (less host memory)", 4,
                    {"training.deepspeed.offload_param": "none", "training.deepspeed.offload_optimizer": "none"}))
    if t.strategy == StrategyName.fsdp and t.fsdp.cpu_offload:
        out.append(("no_fsdp_offload", "keep the FSDP2 shards on the GPU (less host memory)", 4,
                    {"training.fsdp.cpu_offload": False}))
    if t.strategy in (StrategyName.fsdp, StrategyName.deepspeed) or n > 1:
        for extra in (2, 4):
            out.append((f"workers_{n * extra}", f"{n * extra} workers (more shards per rank)", 4 + extra,
                        {"training.resources.num_workers": n * extra}))
    elif t.strategy == StrategyName.ddp:
        out.append(("fsdp_2", "FSDP2 over 2 workers", 5, {"training.strategy": "fsdp", "training.resources.num_workers": 2}))
    return out


def _split_sizes(workers: int) -> list[int]:
    """The group sizes a model split over ``workers`` is offered at: all of them, then their largest
    other divisor (the rest data-parallel replicas)."""
    return [d for d in range(workers, 1, -1) if workers % d == 0][:2]


def _pipeline_candidates(spec: JobSpec, shape: ModelShape) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Pipeline parallelism over the job's workers: stages = num_workers, then its largest other divisor
    (the rest data parallel), where the job could run as a pipeline — a family whose blocks the workers
    split, enough blocks, and none of what the pipeline strategy refuses (fp16, prefix/prompt tuning,
    qlora, a chunked loss, activation offload, QAT). Its plan is the most loaded stage's. 1F1B when each
    micro-batch gives every stage a chunk, else GPipe."""
    t = spec.training
    n = t.resources.num_workers
    if (t.strategy == StrategyName.pipeline or n < 2 or t.precision == Precision.fp16 or t.loss_chunk_tokens
            or t.activation_offload or t.qat.enabled
            or t.peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning, PeftMethod.qlora)):
        return []
    micro = spec.resolved().micro_batch_size
    out = []
    for stages in _split_sizes(n):
        if pipeline_problem(shape.family, shape.num_layers, stages):
            continue
        schedule = "1f1b" if micro >= stages else "gpipe"
        replicas = f", {n // stages} data-parallel replicas" if n // stages > 1 else ""
        out.append((f"pipeline_{stages}", f"pipeline parallel: {stages} stages of the model's blocks ({schedule}{replicas})",
                    5, {"training.strategy": "pipeline", "training.pipeline.stages": stages,
                        "training.pipeline.schedule": schedule}))
    return out


def _tensor_candidates(spec: JobSpec, shape: ModelShape) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Tensor parallelism over the job's workers: size = num_workers, then its largest other divisor (the
    rest FSDP2 replicas), where the model's heads, key/value heads and MLP columns split evenly over that
    many ranks (tensor_problem); what else the tensor strategy refuses (fp16, PEFT other than LoRA, a
    chunked loss, activation offload) the spec rules refuse when the candidate is planned. Its plan is one
    rank's share (tensor_parallel.rank_shape). Dearer than a pipeline: two all-reduces of the hidden
    states per block, forward and backward, where the pipeline sends one per stage boundary."""
    t = spec.training
    n = t.resources.num_workers
    if t.strategy == StrategyName.tensor or n < 2:
        return []
    out = []
    for size in _split_sizes(n):
        if tensor_problem(shape.family, shape.num_heads, shape.num_kv_heads, shape.intermediate, size):
            continue
        replicas = f", {n // size} FSDP2 replicas" if n // size > 1 else ""
        out.append((f"tensor_{size}", f"tensor parallel: every block's heads and MLP columns over {size} ranks{replicas}",
                    6, {"training.strategy": "tensor", "training.tensor_parallel.size": size}))
    return out

