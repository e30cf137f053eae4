"""The training rules the planner predicts from and the workers build from: one home each, no torch.

- :func:`regime`: the precision regime of a (strategy, PEFT method, precision) — which dtype the
  frozen base, the trained weights, the gradients, the optimizer states and any master copy are
  kept in, the dtype matmuls run in, and who casts (torch.autocast per op, or the wrapper once).
- :func:`lora_targets`: the modules ``target_modules: auto`` adapts, per model family.
- :data:`MERGEABLE_PEFT`: the PEFT methods whose adapter folds into the base weights.
- :func:`deepspeed_buckets`: the ZeRO communication buffer sizes memfit sets (and the planner counts).
- :func:`loss_chunk_problem`: which models the chunked cross-entropy cannot run on.
- :func:`qat_problem`: which models QAT's group size cannot quantise.
- :func:`tensor_problem`, :func:`vocab_parallel`: what strategy tensor splits, and whether the vocabulary too.

Dtypes are named as strings ("float32", "bfloat16", "float16", and "nf4" for QLoRA's 4-bit base);
the workers turn the names into torch dtypes. Strategy, method and precision are the spec's enum
values (``StrategyName.ddp.value`` …), so the spec can use these rules without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# --- the precision regime -----------------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HALF = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Regime:
    """How one rank holds and computes a model under a (strategy, PEFT method, precision).

    ``name`` is the activation regime, how forward stores what backward needs:

    - ``fp32``: everything in fp32.
    - ``autocast`` (DDP, pipeline): fp32 weights and residual stream; torch.autocast casts each
      linear's input and weight to 16 bits per op.
    - ``pure16`` (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16/fp16 mode): the wrapper casts the
      weights once and the whole forward runs in 16 bits.
    - ``lora16`` (LoRA + bf16 under DDP or a pipeline): the frozen base is only read, so it is kept in bf16
      (2 bytes per parameter instead of 4, what LoRA users expect), hence a bf16 residual stream; the adapter
      stays fp32 for AdamW and autocast casts it per matmul.
    """

    name: str
    compute_dtype: str  # the dtype matmuls run in
    autocast: bool  # torch.autocast around forward; False: the wrapper (FSDP2, DeepSpeed) casts, or fp32
    frozen_dtype: str  # the base weights a PEFT method does not train, as held ("nf4": QLoRA's 4-bit base)
    trainable_dtype: str  # the trained weights as the module holds them
    grad_dtype: str  # gradients as held and reduced
    optimizer_dtype: str  # AdamW's two moments
    master_dtype: str | None  # the optimizer's master copy beside 16-bit weights (DeepSpeed), else None
    cast_frozen_base: bool  # the frozen base is held in a 16-bit ``frozen_dtype`` (the worker reads it so)


@cache
def regime(strategy: str, peft_method: str, precision: str) -> Regime:
    """The one place a (strategy, peft method, precision) becomes a :class:`Regime`; the same
    arguments always return the same object."""
    frozen_base = "nf4" if peft_method == "qlora" else "float32"  # the loader quantises QLoRA's base
    if precision == "fp32":
        return Regime("fp32", "float32", False, frozen_base, "float32", "float32", "float32", None, False)
    half = HALF[precision]
    if strategy == "deepspeed":
        # DeepSpeed's bf16/fp16 mode converts the whole module and its gradients; the optimizer
        # keeps fp32 masters of what trains.
        return Regime("pure16", half, False, half, half, half, "float32", "float32", False)
    if strategy == "fsdp":
        # FSDP2 keeps fp32 shards of what trains and casts each unit when it gathers it; gradients reduce in
        # fp32. A PEFT method's frozen base is only read: its shards are held in 16 bits (FSDP2 needs one dtype
        # for a unit's trained parameters only, _fsdp_param_group.py _init_mp_dtypes), read so from the checkpoint.
        frozen = half if peft_method not in ("none", "qlora") else frozen_base
        return Regime("pure16", half, False, frozen, "float32", "float32", "float32", None, frozen == half)
    if strategy in ("ddp", "pipeline") and peft_method == "lora" and precision == "bf16":
        return Regime("lora16", half, True, half, "float32", "float32", "float32", None, True)
    # DDP and pipeline: fp32 weights, torch.autocast per op.
    return Regime("autocast", half, True, frozen_base, "float32", "float32", "float32", None, False)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dense dtype (not "nf4", whose size the planner models with its constants)."""
    return DTYPE_BYTES[dtype]


# --- PEFT ---------------------------------------------------------------------------------------

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
# The attention projections per model family: what "auto" adapts. Every family the planner reads
# (service/memory/shape.py) has one here.
AUTO_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    **{f: ("q_proj", "k_proj", "v_proj", "o_proj") for f in _LLAMA_LIKE}, "gpt2": ("c_attn", "c_proj")}
# IA3 also scales the MLP's down projection, which it then treats as a feed-forward module.
AUTO_FEEDFORWARD: dict[str, tuple[str, ...]] = {**{f: ("down_proj",) for f in _LLAMA_LIKE}, "gpt2": ("c_fc",)}

MERGEABLE_PEFT = frozenset({"lora", "qlora", "ia3", "loha", "lokr"})  # prefix/prompt tuning add tokens

# peft's LyCORIS tuners (LoHa, LoKr) wrap torch's Linear and Conv layers only; GPT-2's attention and MLP
# projections are transformers' Conv1D, which peft/tuners/lycoris_utils.py ``_create_new_module`` refuses.
PEFT_UNSUPPORTED: dict[str, frozenset[str]] = {"gpt2": frozenset({"loha", "lokr"})}


def peft_family_problem(family: str, method: str) -> str | None:
    """Why ``method`` cannot adapt a model of ``family``, or None when it can."""
    if method in PEFT_UNSUPPORTED.get(family, ()):
        return (f"peft method {method!r} cannot adapt {family} models: their projections are transformers' "
                "Conv1D layers, which peft's LoHa/LoKr do not wrap; use lora, ia3, prefix_tuning or prompt_tuning")
    return None


def lora_targets(family: str, target_modules: list[str] | str) -> list[str]:
    """The module names an adapter wraps: the spec's list, or the family's attention projections for "auto"."""
    if target_modules != "auto":
        return list(target_modules)
    if family not in AUTO_LORA_TARGETS:
        raise ValueError(f"no automatic target_modules for model family {family!r}; set training.peft.target_modules")
    return list(AUTO_LORA_TARGETS[family])


def feedforward_targets(family: str, target_modules: list[str] | str) -> list[str]:
    """IA3's feed-forward modules: the family's MLP projection for "auto", none for an explicit list."""
    return list(AUTO_FEEDFORWARD.get(family, ())) if target_modules == "auto" else []


# --- DeepSpeed buffers --------------------------------------------------------------------------

# ZeRO-3 keeps a gathered parameter live when it is reused within this many elements (DeepSpeed's
# default, set explicitly so the planner's assumption is the worker's config).
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000


@dataclass(frozen=True)
class DeepSpeedBuckets:
    """ZeRO's communication buffers in elements. They follow hidden² (Hugging Face's "auto" values),
    not DeepSpeed's 5e8-element default that allocates ~1 GB per rank whatever the model."""

    reduce_elements: int  # the gradient reduce (ipg) bucket
    allgather_elements: int  # its all-gather twin
    prefetch_elements: int  # ZeRO-3: parameters prefetched ahead of the running module
    persistence_threshold: int  # ZeRO-3: parameters this small stay gathered
    max_reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE


def deepspeed_buckets(hidden: int, reduce_bucket_elements: int | None = None) -> DeepSpeedBuckets:
    bucket = int(reduce_bucket_elements or hidden * hidden)
    return DeepSpeedBuckets(bucket, bucket, int(0.9 * hidden * hidden), 10 * hidden)


# ZeRO-Infinity's swap buffers (DeepSpeed offload to a local disk): the sizes memfit sets, which the planner
# counts as host memory. DeepSpeed's default sub-group (1e9 elements) would stage 16 GB of optimizer state per swap.
NVME_SUB_GROUP_ELEMENTS = 10**8  # zero_optimization.sub_group_size with nvme offload
NVME_PARAM_BUFFERS = 5  # offload_param.buffer_count (DeepSpeed's default)
NVME_PARAM_BUFFER_ELEMENTS = 10**8  # offload_param.buffer_size (DeepSpeed's default), at least the largest parameter
NVME_OPTIMIZER_BUFFERS = 4  # offload_optimizer.buffer_count (DeepSpeed's default)
NVME_AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True}  # DeepSpeed's "aio" defaults, set explicitly


def nvme_param_buffer_elements(largest_param_numel: int) -> int:
    """offload_param.buffer_size: DeepSpeed needs each swapped parameter to fit one buffer."""
    return max(NVME_PARAM_BUFFER_ELEMENTS, int(largest_param_numel))


# --- pipeline stages ----------------------------------------------------------------------------

PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")  # whose blocks workers/strategies/pipeline.py splits


def pipeline_problem(family: str, num_layers: int, stages: int) -> str | None:
    """Why a model cannot be split into ``stages`` pipeline stages, or None."""
    if family not in PIPELINE_FAMILIES:
        return (f"the pipeline strategy splits the blocks of {', '.join(PIPELINE_FAMILIES)} models; this model is "
                f"{family!r} (use ddp, fsdp or deepspeed)")
    if stages > num_layers:
        return f"{stages} pipeline stages need at least {stages} decoder blocks; this model has {num_layers}"
    return None


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder blocks each pipeline stage runs, in order: as even as the count allows, every stage
    at least one block. Stage 0 also holds the embeddings and the last stage the final norm, the
    LM head and the loss (whose fp32 logits are the largest activation of a small model), so the
    blocks left over after the even share go to the middle stages first, then to the first stage,
    and only then to the last. The planner sizes each stage by this split; the workers build it."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages need 1..{num_layers} decoder blocks each at least one")
    counts = [num_layers // stages] * stages
    order = [*range(1, stages - 1), 0, stages - 1] if stages > 1 else [0]
    for k in order[: num_layers % stages]:
        counts[k] += 1
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def in_flight_microbatches(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe runs every forward before
    any backward (all of them); 1F1B warms up with ``stages - stage`` forwards and then alternates
    one forward with one backward, so stage k never holds more than that (torch.distributed.pipelining
    schedules.py, Schedule1F1B's warm-up count)."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)


def local_stages(schedule: str, virtual_stages: int | None) -> int:
    """Model stages each pipeline rank holds: ``virtual_stages`` (default 2) with interleaved_1f1b, else 1.
    The blocks are split into ``stages × local_stages`` model stages; rank r holds r, r + stages, …"""
    return (virtual_stages or 2) if schedule == "interleaved_1f1b" else 1


def interleaved_in_flight(ranks: int, local: int, rank: int, microbatches: int) -> list[tuple[int, ...]]:
    """ScheduleInterleaved1F1B on ``rank`` of ``ranks`` with ``local`` stages each: after each of the
    rank's operations, how many chunks each of its local stages holds (forwards whose backward has
    not run), in local order. The order is torch.distributed.pipelining's (schedules.py, torch 2.13:
    ScheduleInterleaved1F1B._calculate_single_rank_operations and _get_1f1b_rank_ops): rounds =
    max(1, n // ranks) of n // rounds chunks; warm-up forwards W = min((local - 1)·per_round +
    2·(ranks - 1 - rank), n·local); then one forward and one backward per operation, then the remaining
    backwards. A forward of operation i runs local stage (i // per_round) mod local; a backward, local
    stage local - 1 - ((i - W) // per_round) mod local. The peak is W + 1 chunks in all (the first
    steady forward before its backward), of whichever local stages they belong to."""
    n = microbatches
    per_round = n // max(1, n // ranks)
    total = n * local
    warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), total)
    held = [0] * local
    out: list[tuple[int, ...]] = []
    for op in range(total + warmup):
        if op < total:  # warm-up and steady operations run a forward (steady ones then a backward)
            held[(op // per_round) % local] += 1
            out.append(tuple(held))
        if op >= warmup:  # steady and cool-down operations run a backward
            held[local - 1 - ((op - warmup) // per_round) % local] -= 1
            out.append(tuple(held))
    return out


# --- chunked cross-entropy ----------------------------------------------------------------------


def qat_problem(family: str, in_widths: dict[str, int], group_size: int) -> str | None:
    """Why ``training.qat`` cannot run on a model, or None: torchao fake-quantises ``nn.Linear`` layers
    only (GPT-2's blocks are ``Conv1D``), in groups of ``group_size`` along each one's input
    (torchao/quantization/qat/linear.py refuses ``in_features % group_size != 0``, as
    workers/strategies/qat.py: qat_prepare does before it). ``in_widths``: module name -> input width of
    every linear the worker would quantise."""
    if family == "gpt2":
        return "GPT-2's blocks are Conv1D, not torch.nn.Linear: QAT has nothing to quantise; use another family"
    uneven = sorted(f"{name} ({width})" for name, width in in_widths.items() if width % group_size)
    if uneven:
        return (f"training.qat.group_size={group_size} must divide the input width of every quantised linear; "
                f"it does not divide {', '.join(uneven)}")
    return None


def loss_chunk_problem(final_logit_softcapping: float | None) -> str | None:
    """Why ``training.loss_chunk_tokens`` cannot run on a model, or None. Gemma 2 (and any config
    with ``final_logit_softcapping``) caps the logits in the model's forward *after* the LM head,
    where the chunked head (workers/chunked_loss.py) hands back the loss, not logits."""
    if final_logit_softcapping is not None:
        return ("chunked cross-entropy cannot run on a model whose config sets final_logit_softcapping (the "
                "model caps the logits after the LM head); leave training.loss_chunk_tokens unset")
    return None


# --- tensor parallel ----------------------------------------------------------------------------

# Whose decoder blocks workers/strategies/tensor.py splits, and how: module name -> "colwise" (output
# features split over the ranks) or "rowwise" (input features split; the partial outputs all-reduced).
# GPT-2's layers are transformers' Conv1D ([in, out] weights, which torch's ColwiseParallel/
# RowwiseParallel do not take: the worker has its own styles for them) and its c_attn is q, k and v fused
# in one [q | k | v] output, whose columns the worker regroups so that each rank's share is its own heads'.
_LLAMA_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
             "mlp.down_proj": "rowwise"}
TENSOR_LAYERS: dict[str, dict[str, str]] = {
    **{f: _LLAMA_TP for f in ("llama", "mistral", "qwen2", "qwen3")},
    "gpt2": {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
}
TENSOR_FAMILIES = tuple(TENSOR_LAYERS)
TENSOR_PEFT = ("none", "lora")  # the adapters whose layers the plan splits along with their base


def tensor_problem(family: str, heads: int, kv_heads: int, intermediate: int, size: int) -> str | None:
    """Why a model cannot be split over ``size`` tensor-parallel ranks, or None: each rank computes
    whole attention heads (of queries and of keys/values) and an equal share of the MLP's columns."""
    if family not in TENSOR_FAMILIES:
        return (f"the tensor strategy splits the layers of {', '.join(TENSOR_FAMILIES)} models; this model is "
                f"{family!r} (use ddp, fsdp, deepspeed or pipeline)")
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                    ("intermediate_size", intermediate)):
        if n % size:
            return f"tensor_parallel.size {size} must divide the model's {what} ({n})"
    return None


def vocab_parallel(vocab: int, size: int) -> bool:
    """Whether strategy tensor also splits the token embedding, the LM head and the loss over the
    vocabulary (torch's loss_parallel: each rank holds vocab/size rows and logits, cross-entropy reduces
    over the group without gathering them): where ``size`` divides the vocabulary evenly. Elsewhere they
    stay whole on every rank, as before; nothing is refused."""
    return size > 1 and vocab % size == 0


# --- evaluation cadence (workers/steps.py Progress.due_eval) ------------------------------------------

EVALS_PER_RUN = 4  # training.eval_every_steps unset: the validation file is evaluated about this often


def eval_interval(eval_every_steps: int | None, total_steps: int) -> int:
    """Steps between evaluations of the validation file: ``training.eval_every_steps``, or by default a
    quarter of the run (at least every step); the last step is always evaluated too."""
    return eval_every_steps or max(1, -(-total_steps // EVALS_PER_RUN))
