"""The MLP's saved tensors per block, its forward at its fullest, and one block's backward at its fullest.

SwiGLU/GeGLU (Llama-like): gate, act(gate) and up are kept by the activation and the product; the product by
down_proj where it trains. GPT-2's ``gelu_new`` runs as Python ops that keep x, tanh, 0.5·x and 1 + tanh;
mlp.c_proj keeps the product where it trains or carries an adapter ("c_proj" adapts both projections).
"""

from __future__ import annotations

from service.memory.activations.linears import Linears
from service.memory.nf4 import largest_quantised

LLAMA_INPUTS = ["gate_proj", "up_proj"]
LLAMA_LINEARS = ["gate_proj", "up_proj", "down_proj"]
GPT2_LINEARS = ["c_fc", "mlp.c_proj"]


def block(ops: Linears, in_grad: bool, *, zero3_linear: bool, qat: tuple[int, bool] | None) -> int:
    """One block's MLP. ``zero3_linear``, ``qat``: as for the attention (service/memory/activations/attention.py)."""
    T, sh, a, res = ops.T, ops.shape, ops.regime.act, ops.regime.residual
    h, i = sh.hidden, sh.intermediate
    no_ia3 = ops.ia3_feedforward is None
    if sh.family == "gpt2":
        n = ops.linear_input(res if not ops.regime.casts else 4, ["c_fc"], h)
        n += 4 * T * i * a + (T * i * a if (ops.trainable("c_proj") or ops.trainable("mlp.c_proj")) and no_ia3 else 0)
        return n + ops.weight_casts(GPT2_LINEARS) + ops.ia3_saved(GPT2_LINEARS)
    qat_act = bool(qat and qat[1])  # each linear keeps its own fake-quantised input instead of the shared one
    norm_out = 4 if ops.regime.name != "pure16" else 2  # the post-attention norm's output
    n = 0 if qat_act else ops.linear_input(norm_out, LLAMA_INPUTS, h)
    # gate, act(gate), up kept by the activation and the product; the product by down_proj. Linear4bit hands back
    # its input's dtype, so under autocast QLoRA's gate, up and their product stay fp32
    mlp = 4 if ops.nf4_base and ops.regime.casts else a
    n += 3 * T * i * mlp + (T * i * a if ops.trainable("down_proj") and no_ia3 and not qat_act else 0)
    if zero3_linear and not ops.full and in_grad:  # ZeRO-3's linear keeps the frozen linears' inputs too
        n += T * h * a if not any(ops.trainable(c) for c in LLAMA_INPUTS) else 0
        n += T * i * a if not ops.trainable("down_proj") else 0
    n += ops.adapter_saved(LLAMA_LINEARS)
    n += ops.weight_casts(LLAMA_LINEARS) + ops.ia3_saved(LLAMA_LINEARS)
    return n + ops.qat_saved(LLAMA_LINEARS, qat)


def forward_block_bytes(ops: Linears) -> int:
    """A block's forward at its fullest, its MLP's output projection (what a pipeline stage that ends in no loss
    peaks at, in the newest chunk's last block), beyond the block's saves: transformers' blocks hold the second
    norm's output in ``hidden_states`` across ``self.mlp`` (GPT2Block, LlamaDecoderLayer; GPT2Block its
    ``attn_output`` too) and the MLPs their product across the projection, though nothing keeps either where the
    MLP's linears save no copy of them; beside the projection's output. A LoRA adapter on the projection adds
    lora_B's output and its scaled copy and, where a 16-bit input meets the fp32 adapter, peft's fp32 copy of the
    product (tuners_utils.py: _cast_input_dtype) until autocast has cast it back (measured: bench/peak_tensors.py,
    small-gpt2 pipeline LoRA bf16, every one of these live at rank 0's peak)."""
    T, sh, a, res = ops.T, ops.shape, ops.regime.act, ops.regime.residual
    h, i = sh.hidden, sh.intermediate
    gpt2 = sh.family == "gpt2"
    in_names, out_name = (["c_fc"], "c_proj") if gpt2 else (LLAMA_INPUTS, "down_proj")
    norm_bytes = res if gpt2 else (4 if ops.regime.name != "pure16" else 2)
    norm_kept = not ops.regime.casts and any(ops.trainable(n) for n in in_names) and ops.ia3_feedforward is None
    product_kept = (ops.trainable(out_name) and not ops.adapted(out_name)) or (ops.adapted(out_name) and not ops.regime.casts)
    n = (0 if norm_kept else T * h * norm_bytes) + (0 if product_kept else T * i * a) + T * h * a
    if gpt2:  # GPT2Block keeps ``attn_output`` (the attention's projection) in a local until it returns
        n += T * h * a
    if ops.adapted(out_name) and not ops.lycoris and ops.ia3_feedforward is None:
        n += 2 * T * h * a + (T * i * 4 if ops.regime.casts and a == 2 else 0)
    return n


def backward_bytes(ops: Linears) -> int:
    """One block's backward at its fullest. A gated MLP (SwiGLU, GeGLU) peaks in the product's backward: down_proj's
    input gradient and MulBackward0's two outputs, the gradients of act(gate) and of up, all T × intermediate in the
    activations' dtype (measured: bench/peak_tensors.py, pipeline stages), beside the block's incoming fp32 residual
    gradient. GPT-2's MLP: two T × intermediate gradients in flight and two fp32 T × hidden. QLoRA: MatMul4Bit.backward
    dequantises its weight to the compute dtype, one at a time."""
    T, sh, a = ops.T, ops.shape, ops.regime.act
    h, i = sh.hidden, sh.intermediate
    n = 3 * T * i * a + T * h * 4 if sh.mlp in ("swiglu", "geglu") else 2 * T * i * a + 2 * T * h * 4
    if ops.nf4_base:
        n += largest_quantised(sh) * a
    return n
