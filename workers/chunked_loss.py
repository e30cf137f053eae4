"""Chunked cross-entropy (``training.loss_chunk_tokens``): the LM head and the loss computed over
chunks of tokens, so the b·s·V logits, their fp32 copy, the log-softmax and its gradient only ever
exist for one chunk — never for the whole micro-batch, which for a small model with a big vocabulary
is the largest activation there is (1B Llama, vocab 128k, seq 2048: 1 GiB per fp32 copy).

How. ``install`` replaces the forward of the model's output embedding (``get_output_embeddings()``:
the plain ``lm_head``, or whatever wraps it — a LoRA adapter, QAT's fake quantisation) *on the
instance*, so the module, its parameters and their names stay what they were and every wrapper's
module hooks (DDP, FSDP2's root unit, DeepSpeed ZeRO-3's gather/release) still run around it. While
``loss_targets`` is active (workers/steps.py forward_loss_sum sets it), that forward returns the
summed token loss instead of the logits; the model's forward hands it back as ``out.logits``.
Each chunk runs under non-reentrant activation checkpointing: forward keeps only the loss and the
chunk's input (a view of the final hidden states), backward recomputes that chunk's logits,
log-softmax and gradient and frees them before the next chunk. The price is the head's forward run
twice (one extra T·h·V matmul per micro-batch).

Peers: torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py)
chunks the output projection and upcasts per chunk, but every chunk's logits and log-softmax stay
saved for backward; Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py)
avoids the recompute by computing the head's gradients during forward, which needs the head's weight
as a plain tensor (not a LoRA-wrapped or ZeRO-3-partitioned one). The recompute is what works under
every strategy here.

The sum is the one ``steps.token_loss_sum`` computes (the same shifted labels, ``ignore_index=-100``,
fp32), in another order of additions: equal to rounding (tests/test_chunked_loss.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from service.domain.training import loss_chunk_problem


@dataclass
class LossTarget:
    """The shifted labels of the micro-batch in flight; ``chunked`` once a chunked head has returned
    their loss sum in place of the logits."""

    labels: torch.Tensor  # (batch, tokens), -100 where no label
    chunked: bool = False
    # chunk start → label positions whose argmax logit is the label (mean token accuracy), counted in forward
    tally: dict = field(default_factory=dict)


_TARGET: contextvars.ContextVar[LossTarget | None] = contextvars.ContextVar("memfit_loss_target", default=None)


@contextlib.contextmanager
def loss_targets(shifted_labels: torch.Tensor):
    """While active, a chunked head returns the loss sum of these labels as the model's ``logits`` (and
    sets ``target.chunked``); a model without one is unaffected. The caller must take the loss from the
    model's output, not from the head: wrappers hook the outputs of the modules they manage (ZeRO-3's
    pre-backward gather, FSDP2's root unshard) and only their hooked tensor leads backward through them."""
    target = LossTarget(shifted_labels)
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)


def install(model, chunk_tokens: int) -> torch.nn.Module:
    """Make ``model``'s output embedding compute the loss in chunks of ``chunk_tokens`` tokens while
    ``loss_targets`` is active. Returns the head module."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    problem = loss_chunk_problem(getattr(model.config, "final_logit_softcapping", None))
    if problem:
        raise ValueError(problem)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding to chunk")
    plain = head.forward  # the class's forward, bound: it reads the weight when called (ZeRO-3, FSDP2 swap it)

    def forward(hidden: torch.Tensor, *args, **kwargs):
        target = _TARGET.get()
        if target is None or args or kwargs:
            return plain(hidden, *args, **kwargs)
        target.chunked = True
        return chunked_loss_sum(plain, hidden, target.labels, chunk_tokens, tally=target.tally)

    head.forward = forward
    head.memfit_loss_chunk_tokens = chunk_tokens
    return head


def _chunk_loss(head_forward, hidden: torch.Tensor, labels: torch.Tensor, tally: dict | None = None,
                key: int = 0) -> torch.Tensor:
    logits = head_forward(hidden).float()
    if tally is not None and key not in tally:  # in forward only: backward's recomputation finds it counted
        with torch.no_grad():
            tally[key] = ((logits.argmax(-1) == labels) & (labels != -100)).sum()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_loss_sum(head_forward, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                     tally: dict | None = None) -> torch.Tensor:
    """Σ over label tokens of the fp32 cross-entropy of ``head_forward(hidden)``, ``chunk_tokens`` rows
    of ``hidden`` at a time. Prompt tuning prepends virtual tokens: only the last len(labels)
    positions predict a label. ``tally`` collects each chunk's count of correct argmax predictions."""
    if hidden.shape[1] > labels.shape[1]:
        hidden = hidden[:, -labels.shape[1]:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1).to(flat.device, non_blocking=True)
    recompute = torch.is_grad_enabled()
    total = None
    for start in range(0, flat.shape[0], chunk_tokens):
        h, y = flat[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if recompute:  # keep only h (a view of the hidden states); backward recomputes the logits
            part = checkpoint(_chunk_loss, head_forward, h, y, tally, start, use_reentrant=False)
        else:  # evaluation: nothing is kept anyway
            part = _chunk_loss(head_forward, h, y, tally, start)
        total = part if total is None else total + part
    return total
