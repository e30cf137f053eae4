"""QLoRA's 4-bit base as bitsandbytes holds it (workers/peft_setup.py load_qlora_base): the bytes of each
NF4 weight with its quantisation constants, and what ``prepare_model_for_kbit_training`` leaves dense. No torch.

One linear's weight of n elements (bitsandbytes/functional.py ``quantize_4bit``, double quantisation):

- the packed codes: two 4-bit values per byte, ``ceil(n / 2)`` bytes of uint8 (``quant_storage``);
- the absmax of each block of ``NF4_BLOCK`` weights, itself quantised (``compress_statistics``) by
  ``quantize_blockwise(absmax - offset, blocksize=256)``: one uint8 per block, an fp32 absmax per 256
  blocks, and the fp32 ``offset`` (the mean absmax) — without double quantisation, one fp32 per block;
- the 16 fp32 values of the NF4 code (``get_4bit_type`` builds one per weight) and, with double
  quantisation, the 256 fp32 values of the 8-bit blockwise map in the nested state: one per weight too
  (measured: loading leaves each QuantState its own copy, not the shared ``name2qmap["dynamic"]``).

Everything else (embeddings, norms, lm_head, which transformers leaves dense) is upcast to fp32 by peft's
``prepare_model_for_kbit_training`` (peft/utils/other.py), whatever the checkpoint's dtype.
"""

from __future__ import annotations

from service.memory.shape import ModelShape

NF4_BLOCK = 64  # bitsandbytes/functional.py quantize_4bit: blocksize None -> 64 (transformers sets none)
ABSMAX_BLOCK = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(..., blocksize=256)
NF4_CODE_BYTES = 16 * 4  # get_4bit_type("nf4"): 16 fp32 values, one tensor per quantised weight
DYNAMIC_CODE_BYTES = 256 * 4  # create_dynamic_map(): 256 fp32 in each nested state (see above)
DENSE_BYTES = 4  # prepare_model_for_kbit_training casts every non-4-bit parameter to fp32


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def nf4_weight_bytes(n: int, double_quant: bool = True) -> int:
    """One quantised weight of ``n`` elements: packed codes, block constants, its NF4 code (see the module)."""
    blocks = _ceil(n, NF4_BLOCK)
    if double_quant:
        # uint8 absmax, fp32 absmax of absmax, fp32 offset, the 8-bit code
        stats = blocks + _ceil(blocks, ABSMAX_BLOCK) * 4 + 4 + DYNAMIC_CODE_BYTES
    else:
        stats = blocks * 4
    return _ceil(n, 2) + stats + NF4_CODE_BYTES


def quantised_numels(shape: ModelShape) -> list[int]:
    """The weights transformers' bitsandbytes integration quantises: every linear of every block."""
    return [i * o for i, o in shape.linear_shapes().values()] * shape.num_layers


def quantised_bias_numel(shape: ModelShape) -> int:
    """Biases of the quantised linears (Qwen2's q, k, v; GPT-2's every projection): they stay dense."""
    weights = sum(i * o for i, o in shape.linear_shapes().values())
    norms = shape.norms_per_layer * shape.norm_params() + (2 * shape.head_dim if shape.qk_norm else 0)
    return (shape.layer_params() - weights - norms) * shape.num_layers


def qlora_base_bytes(shape: ModelShape, compute_bytes: int, double_quant: bool = True) -> int:
    """The frozen base of a QLoRA model (the adapter not included): the quantised weights with their
    constants, their biases in the compute dtype (Linear4bit.forward casts ``bias.data`` to it on the first
    call, bitsandbytes/nn/modules.py), and every other parameter in fp32."""
    quantised = quantised_numels(shape)
    nf4 = sum(nf4_weight_bytes(n, double_quant) for n in quantised)
    biases = quantised_bias_numel(shape)
    dense = shape.parameter_count() - sum(quantised) - biases
    return nf4 + biases * compute_bytes + dense * DENSE_BYTES


def largest_quantised(shape: ModelShape) -> int:
    """Elements of the largest quantised weight: what one dequantisation materialises at a time."""
    return max(quantised_numels(shape), default=0)


def packed_bytes(shape: ModelShape, layers: int | None = None) -> int:
    """The packed 4-bit codes alone (of ``layers`` blocks, default all): what FSDP2 shards and gathers."""
    one = sum(_ceil(i * o, 2) for i, o in shape.linear_shapes().values())
    return one * (shape.num_layers if layers is None else layers)


def constants_bytes(shape: ModelShape, double_quant: bool = True) -> int:
    """The quantisation constants of every 4-bit weight: not parameters, so FSDP2 leaves them whole on
    every rank (Linear4bit keeps its ``quant_state`` beside the sharded weight)."""
    return sum(nf4_weight_bytes(n, double_quant) - _ceil(n, 2) for n in quantised_numels(shape))
