"""The norms' saved tensors: a block's input norm, its post-attention norm (and Gemma 2/3's two feed-forward
norms), and the final norm before the LM head.

RMSNorm (Llama, Qwen, Mistral, Gemma) upcasts its input to fp32 and ``pow`` keeps that fp32 view; it keeps
the per-token ``rsqrt`` (fp32) and, where its weight trains, the normalised input for the weight's gradient:
in the residual dtype (Llama's RMSNorm casts it back before the weight), fp32 for Gemma's, which multiplies
by 1 + weight in fp32 and casts the product (transformers/models/gemma/modeling_gemma.py: GemmaRMSNorm;
gemma2/gemma3 the same). LayerNorm (GPT-2) keeps its input in the residual dtype and two per-token fp32
statistics (mean, rstd).
"""

from __future__ import annotations

from service.memory.activations.linears import Linears


def _normalized(ops: Linears) -> int:
    """The normalised input kept for a trained norm weight (see the module docstring)."""
    norm_fp32 = ops.regime.residual == 4 or ops.shape.family.startswith("gemma")
    return ops.T * ops.shape.hidden * (4 if norm_fp32 else 2)


def block(ops: Linears, in_grad: bool) -> int:
    """Every norm of one block. ``in_grad``: the block's input needs a gradient (see activations: a frozen
    embedding's output does not, under PEFT, so the first block's input norm keeps no input)."""
    T, h, res = ops.T, ops.shape.hidden, ops.regime.residual
    small = T * 4  # per-token fp32 statistics (rsqrt, or mean + rstd for LayerNorm)
    if ops.shape.family == "gpt2":
        ln_1 = (T * h * res if in_grad else 0) + 2 * small
        ln_2 = T * h * res + 2 * small
        return ln_1 + ln_2
    normalized = _normalized(ops) if ops.full else 0
    input_norm = (T * h * 4 if in_grad else 0) + small + normalized  # RMSNorm's fp32 view of its input, kept by pow
    post_attention = T * h * 4 + small + normalized
    # Gemma 2/3: a norm before and after the MLP too, each like the post-attention norm
    feed_forward = 2 * (T * h * 4 + small + normalized) if ops.shape.norms_per_layer == 4 else 0
    return input_norm + post_attention + feed_forward


def final(ops: Linears) -> int:
    """The final norm: its input (fp32 view, or LayerNorm's in the residual dtype), its statistics, and where it
    trains (a full fine-tune) its normalised input."""
    T, h = ops.T, ops.shape.hidden
    small = T * 4
    n = T * h * 4 + small if ops.shape.family != "gpt2" else T * h * ops.regime.residual + 2 * small
    if ops.full:
        n += T * h * (4 if ops.shape.family.startswith("gemma") else ops.regime.residual)  # normalised input
    return n


def checkpoint_kept_input(ops: Linears, in_grad: bool) -> int:
    """What a checkpointed block's recomputation does not allocate again: a block that keeps its input for its first
    norm keeps the checkpointed input itself (LayerNorm's input; RMSNorm's fp32 view when the stream is fp32,
    .to(float32) returning it), no new tensor beyond the one the checkpoint holds."""
    kept_input = in_grad and (ops.shape.family == "gpt2" or ops.regime.residual == 4)
    return ops.T * ops.shape.hidden * ops.regime.residual if kept_input else 0
