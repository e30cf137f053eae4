"""The attention's saved tensors, per block: the projections' inputs, SDPA's own saves, padding and prefix
masks, eager attention's probabilities, Qwen3's per-head norms, and what the adapters on q/k/v/o keep.

SDPA keeps q, k, v after rotary, its output (= o_proj's input) and a log-sum-exp per head and token; eager
attention also keeps the s² probabilities (fp32, and their 16-bit copy under a 16-bit regime) and every
head's keys and values (repeat_kv). GPT-2's c_attn computes q, k and v as one storage.
"""

from __future__ import annotations

from service.memory.activations.linears import Linears
from service.memory.shape import ModelShape

LLAMA_INPUTS = ["q_proj", "k_proj", "v_proj"]
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj"]
GPT2_LINEARS = ["c_attn", "attn.c_proj"]


def padding_mask_bytes(shape: ModelShape, b: int, s: int, a: int) -> int:
    """What a padded micro-batch adds to one block's SDPA, beyond a causal one. transformers builds a
    boolean b×1×s×s mask when any row is padded (masking_utils.sdpa_mask skips it only when none is), and
    then (integrations/sdpa_attention.py: use_gqa_in_sdpa wants ``attention_mask is None``) gives SDPA
    every head's keys and values through repeat_kv, which SDPA keeps for backward instead of the kv heads:
    2·T·(q_dim − kv_dim) elements. torch's SDPA converts the boolean mask to an additive one in the query's
    dtype (aten/src/ATen/native/transformers/attention.cpp: convert_boolean_attn_mask), a new b×s×s tensor
    in every block, which the kernel keeps for its backward (measured on CPU: small-llama, chat rows)."""
    T = b * s
    return b * s * s * a + 2 * T * (shape.q_dim - shape.kv_dim) * a


def recast_output(ops: Linears, o_name: str, *, on_gpu: bool, lokr: bool, lora_autocast: bool) -> int:
    """o_proj's (GPT-2: attn.c_proj's) adapter keeps a recast copy of the attention's 16-bit output: PEFT's fp32 copy
    (peft/tuners/tuners_utils.py: _cast_input_dtype, which does not ask about autocast) that autocast casts back to
    16 bits for lora_A, which keeps it (measured). Where that happens: LoRA with a bf16 base under DDP (``lora16``);
    an fp32 adapter beside an fp32 base under autocast (pipeline and tensor: ``lora_autocast``; measured under
    strategy tensor, `_to_copy < linear` of o_proj's input live at the peak); QLoRA under autocast on CPU, where
    peft's 4-bit LoRA layer (peft/tuners/lora/bnb.py) casts unless ``torch.is_autocast_enabled()``, which asks about
    CUDA's autocast only; and LoKr under autocast (Llama-like only): _get_delta_activations casts its input to the
    delta weight's dtype, fp32 (torch.kron is not an autocast op and promotes its mixed inputs), which SDPA's 16-bit
    output is not, and F.linear keeps autocast's 16-bit recast of that copy (LoHa's delta is 16-bit)."""
    casts, qd = ops.regime.casts, ops.shape.q_dim
    gpt2 = ops.shape.family == "gpt2"
    recast = (ops.regime.name == "lora16" or (ops.nf4_base and casts and not on_gpu) or lora_autocast
              or (lokr and casts and not gpt2))
    return ops.T * qd * 2 if recast and ops.adapted(o_name) and ops.ia3_feedforward is None else 0


def block(ops: Linears, b: int, s: int, in_grad: bool, *, attention: str, padded: bool, prefix_tokens: int,
          zero3_linear: bool, qat: tuple[int, bool] | None, on_gpu: bool, lokr: bool, lora_autocast: bool) -> int:
    """One block's attention (see the module docstring).

    ``padded``: the micro-batch holds rows shorter than its width, so the model hands SDPA a padding mask instead
    of ``is_causal`` (:func:`padding_mask_bytes`). ``prefix_tokens``: prefix tuning's virtual tokens, which peft
    hands every block as past keys and values. ``zero3_linear``: DeepSpeed ZeRO-3 runs every linear through its own
    autograd function, which saves the input even when the weight is frozen, wherever the input needs a gradient.
    ``qat``: (group size, activations fake-quantised); with the int8 scheme each linear keeps its own fake-quantised
    input instead of the shared one."""
    T, sh, a, res = ops.T, ops.shape, ops.regime.act, ops.regime.residual
    h, qd, kvd = sh.hidden, sh.q_dim, sh.kv_dim
    if sh.family == "gpt2":
        n = ops.linear_input(res if not ops.regime.casts else 4, ["c_attn"], h)
        n += T * 3 * qd * a + T * qd * a + sh.num_heads * T * 4  # q,k,v (one c_attn storage), out, lse
        n += padding_mask_bytes(sh, b, s, a) if padded and attention == "sdpa" else 0
        n += ops.adapter_saved(["c_attn", "c_proj"])  # "c_proj" names attn.c_proj (and the MLP's, not counted here)
        n += recast_output(ops, "c_proj", on_gpu=on_gpu, lokr=lokr, lora_autocast=lora_autocast)
        n += ops.weight_casts(GPT2_LINEARS, () if in_grad else ("c_attn",)) + ops.ia3_saved(GPT2_LINEARS)
        return n
    qat_act = bool(qat and qat[1])
    norm_out = 4 if ops.regime.name != "pure16" else 2  # the input norm's output
    n = 0 if qat_act else ops.linear_input(norm_out, LLAMA_INPUTS, h)
    n += ops.adapter_saved(LLAMA_LINEARS)
    n += recast_output(ops, "o_proj", on_gpu=on_gpu, lokr=lokr, lora_autocast=lora_autocast)
    # SDPA keeps q, k, v after rotary, its output (= o_proj's input) and the lse
    n += T * qd * a + 2 * T * kvd * a + T * qd * a + b * sh.num_heads * s * 4
    if prefix_tokens and attention == "sdpa":
        # prefix tuning: the cached prefix makes keys and values s + p long, and transformers then passes SDPA a
        # mask, so (as for padding) every head's keys and values are materialised by repeat_kv and kept, with the
        # additive b × s × (s + p) mask of each block
        n += 2 * b * sh.num_heads * (s + prefix_tokens) * sh.head_dim * a - 2 * T * kvd * a
        n += b * s * (s + prefix_tokens) * a
    elif padded and attention == "sdpa":
        n += padding_mask_bytes(sh, b, s, a)
    if attention == "eager":
        probs = b * sh.num_heads * s * s
        n += probs * 4 + (probs * 2 if a == 2 else 0)
        n += 2 * T * (qd - kvd) * a  # repeat_kv materialises k and v for every head
    if sh.qk_norm:
        # per-head RMSNorm of q and k (Qwen3): like the block's norms, each keeps its fp32 input (pow) and per-head
        # statistics, and, where its weight trains, the normalised input in q/k's dtype
        n += T * (qd + kvd) * 4 + T * (sh.num_heads + sh.num_kv_heads) * 4
        n += T * (qd + kvd) * (4 if sh.family.startswith("gemma") else a) if ops.full else 0
    if zero3_linear and not ops.full and in_grad and not any(ops.trainable(c) for c in LLAMA_INPUTS):
        # ZeRO-3's linear keeps the frozen q/k/v's input where no adapter keeps it (prompt tuning: measured, the
        # input norm's output live at the peak); o_proj's is SDPA's output, kept anyway
        n += T * h * a
    n += ops.weight_casts(LLAMA_LINEARS, () if in_grad else tuple(LLAMA_INPUTS)) + ops.ia3_saved(LLAMA_LINEARS)
    return n + ops.qat_saved(LLAMA_LINEARS, qat)
