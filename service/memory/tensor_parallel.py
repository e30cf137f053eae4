"""Strategy tensor in the planner: the per-rank memory of a model whose decoder blocks are split over
``tensor_parallel.size`` ranks (workers/strategies/tensor.py), with the rest of the workers FSDP2 data
parallel over them. No torch here.
"""

from __future__ import annotations

from service.domain.spec import JobSpec, tensor_parallel_size
from service.domain.training import tensor_problem, vocab_parallel
from service.memory.shape import ModelShape


def check_tensor(spec: JobSpec, shape: ModelShape) -> int:
    """The tensor-parallel size, after refusing (422 naming training.tensor_parallel.size) a model
    whose heads or MLP columns the ranks cannot share evenly."""
    size = tensor_parallel_size(spec.training)
    problem = tensor_problem(shape.family, shape.num_heads, shape.num_kv_heads, shape.intermediate, size)
    if problem:
        from service.domain.errors import SpecInvalid

        raise SpecInvalid([{"param": "training.tensor_parallel.size", "message": problem, "code": "invalid_value"}])
    return size


def rank_shape(shape: ModelShape, size: int) -> ModelShape:
    """What one tensor-parallel rank holds and computes, as a model of its own: every block with
    1/size of the query and key/value heads and 1/size of the MLP's columns; where ``vocab_parallel``
    (size divides the vocabulary) 1/size of the vocabulary, else all of it; the hidden width, the norms
    and GPT-2's position embedding whole (replicated).

    This is exactly the worker's split (workers/strategies/tensor.py): ColwiseParallel shards q/k/v/
    gate/up (GPT-2: c_attn, regrouped so the share is the rank's heads' q, k and v, and c_fc) and their
    biases on the output features, RowwiseParallel o/down (GPT-2: both c_proj) on the input features with
    their biases replicated; a LoRA adapter on a column-wise layer keeps lora_A [r, in] whole and lora_B
    [out/size, r] sharded, on a row-wise one lora_A [r, in/size] sharded and lora_B [out, r] whole —
    each of which is this shape's own linear of (in, out) features. The activations follow: the
    attention's per-head tensors and the MLP's intermediate at 1/size, the residual stream and the
    norms' inputs whole on every rank.

    The vocabulary's share is the worker's ``vocab_plan``: the token embedding RowwiseParallel and the LM
    head ColwiseParallel, both weights Shard(0) — vocab/size rows of each (one, tied, where the model ties
    them) — and the logits a DTensor sharded on the vocabulary that cross-entropy reads under
    loss_parallel, so the logits, their fp32 copy, the log-softmax and the loss's gradients are each
    rank's vocab/size columns; the embedding's dense gradient is its rows'."""
    from dataclasses import replace

    vocab = shape.vocab // size if vocab_parallel(shape.vocab, size) else shape.vocab
    return replace(shape, num_heads=shape.num_heads // size, num_kv_heads=shape.num_kv_heads // size,
                   intermediate=shape.intermediate // size, vocab=vocab)

