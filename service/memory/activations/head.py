"""The LM head and the loss: the head's kept input and weight copy, the logits, and the loss's saved and
temporary tensors (workers/steps.py: token_loss_sum; workers/chunked_loss.py).

workers/steps.py token_loss_sum shifts the labels, not the logits: cross-entropy runs over all T positions (each
row's last is ignored), on a contiguous view of the logits, and keeps the fp32 log-softmax for backward. Prompt
tuning (``virtual_tokens``): peft prepends the virtual tokens to the embeddings, so the logits cover them too, but
token_loss_sum keeps the last len(labels) positions: cross-entropy runs over the data's positions only, and the
slice, not contiguous, is copied by the reshape, in the logits' dtype (measured: a prompt tuning job's log-softmax
and loss gradients b × s × V, not b × (s + p) × V).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.memory.activations.linears import Linears, qat_linear_bytes


@dataclass(frozen=True)
class HeadTerms:
    kept_bytes: int  # kept all step from the head's forward: its input, a weight copy, QAT's terms
    loss_saved_bytes: int  # the fp32 log-softmax (or, chunked, the head's input) and the targets
    logits_bytes: int  # the head's output, freed once the loss has it
    loss_copy_bytes: int  # copies the loss makes of the logits in forward
    loss_grad_bytes: int  # what the loss's backward holds at once at the start of backward


def terms(ops: Linears, b: int, s: int, *, zero3_linear: bool, qat: tuple[int, bool] | None,
          loss_chunk_tokens: int | None, loss_parallel: bool, virtual_tokens: int) -> HeadTerms:
    """``loss_chunk_tokens``: the LM head and the loss run chunk by chunk (workers/chunked_loss.py); the
    vocabulary-sized terms are one chunk's. ``loss_parallel``: the logits are a DTensor sharded on the vocabulary
    (strategy tensor, ``vocab_parallel``) and cross-entropy runs under torch's loss_parallel
    (torch/distributed/tensor/parallel/loss.py), which builds the log-softmax and its backward from their parts
    instead of aten's fused kernels."""
    T, sh, rg = ops.T, ops.shape, ops.regime
    h, V, res, a = sh.hidden, sh.vocab, rg.residual, rg.act
    # the head's input, when the head trains (its bf16 copy under autocast); a chunked loss keeps the final hidden
    # states instead (below)
    kept = T * h * (2 if a == 2 else 4) if ops.full and not loss_chunk_tokens else 0
    if zero3_linear and not ops.full and sh.family != "gpt2":
        # ZeRO-3's linear (deepspeed/runtime/zero/linear.py: LinearFunctionForZeroStage3) keeps the frozen LM head's
        # input, the final norm's output, which needs a gradient once anything before it trains (measured)
        kept += T * h * a
    if qat and not sh.tied_embeddings:  # lm_head is quantised unless it is the embedding's weight
        kept += qat_linear_bytes(T, h, V, *qat) - (T * h * 4 if qat[1] else 0)
    if rg.casts and rg.name != "lora16":
        kept += 2 * V * h  # lm_head weight's bf16 copy
    Tl = b * (s - virtual_tokens)
    logit_bytes = 4 if rg.name == "fp32" else 2
    loss_saved = Tl * V * 4 + Tl * 8  # log-softmax output (fp32) and the int64 targets
    logits = T * V * logit_bytes
    # fp32: a view (or the slice's copy); 16-bit logits: .float() copies
    loss_copy = (Tl * V * logit_bytes if virtual_tokens else 0) + (0 if rg.name == "fp32" else Tl * V * 4)
    loss_grad = 2 * Tl * V * 4  # the log-softmax's and the loss's gradients, vocabulary-sized fp32
    if loss_parallel:  # V is the rank's share of the vocabulary
        # forward (_log_softmax): ``shifted = x - max`` lives on beside ``exp(shifted)`` while the sum of
        # exponentials is taken, and beside the result (the kept log-softmax) after: one fp32 T × V more than
        # aten's fused log-softmax, which writes its output only
        loss_copy += T * V * 4
        # backward (_nll_loss_and_log_softmax_backward, one op for nll_loss and log_softmax): a zeros_like with
        # -1 at the targets, exp(log-softmax), their sum, then that × the incoming gradient while the local
        # zeros tensor is still referenced: three fp32 T × V at once where aten's two ops hold two
        loss_grad = 3 * T * V * 4
    if loss_chunk_tokens:
        # workers/chunked_loss.py runs each chunk of c tokens under non-reentrant checkpointing
        # (torch/utils/checkpoint.py): forward keeps only the chunk's input and targets, so the plain
        # head's saved input gives way to the final hidden states themselves, kept whether or not the head
        # trains, in the residual stream's dtype.
        c = min(loss_chunk_tokens, T)
        loss_saved = T * h * res + T * 8  # the head's input, the int64 targets
        # one chunk's fp32 logits (16-bit logits are freed once ``.float()`` has copied them) and its
        # log-softmax, freed when the chunk's loss is summed (measured: the 16-bit logits are not live then)
        logits = c * V * 4
        loss_copy = c * V * 4
        # in backward, one chunk at a time: its recomputed log-softmax and two fp32 gradients, plus the
        # gradient of the hidden states being summed over the chunks and, where the head trains, a chunk's
        # weight gradient in the compute dtype before it is added to .grad (measured, fp32/autocast/LoRA)
        loss_grad = 3 * c * V * 4 + T * h * res + (V * h * a if ops.full else 0)
    return HeadTerms(kept, loss_saved, logits, loss_copy, loss_grad)
