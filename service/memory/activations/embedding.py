"""What the embedding side keeps all step: the token ids, the rotary tables, and under PEFT with checkpointing a
lookup kept as a leaf.

``embedding_leaf``: a frozen embedding (PEFT) with gradient checkpointing, where the first block reads another
tensor than the lookup's output. transformers' ``activation_checkpointing_enable`` (modeling_utils.py) calls
``enable_input_require_grads``, a forward hook on the input embedding that sets ``requires_grad_(True)`` on its
output: a leaf, whose AccumulateGrad node in the autograd graph holds it until backward ends. Where the first
block reads that output itself (Llama, Qwen, Gemma's scaled embedding module) the checkpoint keeps it anyway;
GPT-2's blocks read the lookup plus the position embeddings (measured: the −0.92% of GPT-2 LoRA fp32 +
checkpointing at s512 under DDP, one tokens × hidden, and ``index_select < aten::embedding`` live at a GPT-2
pipeline stage's peak), and under strategy tensor with the vocabulary split the hook, registered before
``parallelize_module`` added RowwiseParallel's output hook (workers/strategies/common.py enables checkpointing when
it builds the model), marks the vocabulary-partial lookup (a DTensor, before its all-reduce) while the blocks read
the all-reduced copy. One more tokens × hidden in the residual dtype, live all step. (Prompt tuning, whose virtual
tokens are joined to the lookup, is not modelled here: not measured.)
"""

from __future__ import annotations

from service.memory.activations.linears import Linears


def kept(ops: Linears, s: int, *, embedding_leaf: bool) -> int:
    """The embedding indices (int64), the kept leaf (see the module docstring) and the rotary cos/sin tables, cast
    to the hidden states' dtype (GPT-2 has learned positions instead: nothing kept)."""
    T, sh, res = ops.T, ops.shape, ops.regime.residual
    n = T * 8  # embedding indices
    if embedding_leaf:
        n += T * sh.hidden * res
    if sh.family != "gpt2":
        n += 2 * s * sh.head_dim * res
    return n
