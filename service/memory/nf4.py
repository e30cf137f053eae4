"""QLoRA's 4-bit base as bitsandbytes holds it (workers/peft_setup.py load_qlora_base): the bytes of each
NF4 weight with its quantisation constants, and what ``prepare_model_for_kbit_training`` leaves dense. No torch.

One linear's weight of n elements (bitsandbytes/functional.py ``quantize_4bit``, double quantisation):

- the packed codes: two 4-bit values per byte, ``ceil(n / 2)`` bytes of uint8 (``quant_storage``);
- the absmax of each block of ``NF4_BLOCK`` weights, itself quantised (``compress_statistics``) by
  ``quantize_blockwise(absmax - offset, blocksize=256)``: one uint8 per block, an fp32 absmax per 256
  blocks, and the fp32 ``offset`` (the mean absmax) — without double quantisation, one fp32 per block;
- the 16 fp32 values of the NF4 code (``get_4bit_type`` builds one per weight); the 256-entry fp32 code of
  the 8-bit blockwise map is one shared tensor (``name2qmap["dynamic"]``) for the whole model.

Everything else (embeddings, norms, lm_head, which transformers leaves dense) is upcast to fp32 by peft's
``prepare_model_for_kbit_training`` (peft/utils/other.py), whatever the checkpoint's dtype.
"""

from __future__ import annotations

from service.memory.shape import ModelShape

NF4_BLOCK = 64  # bitsandbytes/functional.py quantize_4bit: blocksize None -> 64 (transformers sets none)
ABSMAX_BLOCK = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(..., blocksize=256)
NF4_CODE_BYTES = 16 * 4  # get_4bit_type("nf4"): 16 fp32 values, one tensor per quantised weight
DYNAMIC_CODE_BYTES = 256 * 4  # create_dynamic_map(): 256 fp32, cached once in name2qmap["dynamic"]
DENSE_BYTES = 4  # prepare_model_for_kbit_training casts every non-4-bit parameter to fp32


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def nf4_weight_bytes(n: int, double_quant: bool = True) -> int:
    """One quantised weight of ``n`` elements: packed codes, block constants, its NF4 code (see the module)."""
    blocks = _ceil(n, NF4_BLOCK)
    if double_quant:
        stats = blocks + _ceil(blocks, ABSMAX_BLOCK) * 4 + 4  # uint8 absmax, fp32 absmax of absmax, fp32 offset
    else:
        stats = blocks * 4
    return _ceil(n, 2) + stats + NF4_CODE_BYTES


def quantised_numels(shape: ModelShape) -> list[int]:
    """The weights transformers' bitsandbytes integration quantises: every linear of every block."""
    return [i * o for i, o in shape.linear_shapes().values()] * shape.num_layers


def qlora_base_bytes(shape: ModelShape, double_quant: bool = True) -> int:
    """The frozen base of a QLoRA model (the adapter not included): the quantised weights with their
    constants, and every other parameter in fp32."""
    quantised = quantised_numels(shape)
    nf4 = sum(nf4_weight_bytes(n, double_quant) for n in quantised) + (DYNAMIC_CODE_BYTES if double_quant else 0)
    dense = shape.parameter_count() - sum(quantised)
    return nf4 + dense * DENSE_BYTES


def largest_quantised(shape: ModelShape) -> int:
    """Elements of the largest quantised weight: what one dequantisation materialises at a time."""
    return max(quantised_numels(shape), default=0)
