"""Direct preference optimization (``method.type: "dpo"``) on OpenAI's preference rows: the data, the
reference model's log-probabilities, the loss and one accumulated step. The strategies (ddp, fsdp,
deepspeed) run it in their own loop in place of workers/steps.py's ``accumulate_gradients``.

The loss (Rafailov et al. 2023; TRL's ``loss_type="sigmoid"``, trl/trainer/dpo_trainer.py): for a pair with
chosen completion c and rejected r, with log-probabilities summed over each completion's tokens,

    loss = −log σ(β · ((log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r)))),

the mean over every pair of the global batch. The rewards are β · (log π − log π_ref); the reward margin
is chosen minus rejected and the preference accuracy the share of pairs where the chosen one's reward is
the higher — what the job's metrics report.

A micro-batch of m pairs is one forward of 2m rows (the m chosen, then the m rejected sequences, padded to
the longest), so the policy sees twice the rows of an SFT micro-batch of m — as the planner plans it
(service/memory/dpo.py). The reference (spec.dpo_reference_mode):

- ``adapter_disabled``: the same model with its PEFT adapter switched off (peft's ``disable_adapter``), a
  forward without graph before the policy's: no second model;
- ``frozen_copy``: a second copy of the base, frozen, in the regime's frozen dtype (sharded like the policy
  under fsdp);
- ``precomputed``: every pair's reference log-probabilities computed once, before the first step, by the
  model as it starts (the reference, before training moves it), and kept: 2 floats a pair, no reference
  forward during training; saved with each checkpoint, so a resumed run keeps the very same reference.

Accumulation follows workers/steps.py's maths: each backward takes the sum of its pairs' losses × world /
(pairs in the global batch), so DDP's, FSDP2's and DeepSpeed's averaging over ranks gives the mean over all.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from service.domain.encoding import encode_preference, truncate
from service.domain.spec import dpo_reference_mode
from workers.data import StepSampler, collate, encode_rows
from workers.steps import all_reduce_sum, autocast, distributed, model_inputs, run_backward, shifted_labels

REFERENCE_FILE = "dpo_reference.pt"


# --- data ---------------------------------------------------------------------------------------


@dataclass
class PreferenceData:
    """A preference file, each row (chosen, rejected), each (input_ids, labels) cut to max_seq_length."""

    pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]]
    pad_id: int
    fmt: str = "preference"

    def __len__(self) -> int:
        return len(self.pairs)


def load_preferences(path: str, tokenizer, max_seq_length: int) -> PreferenceData:
    _, pairs = encode_rows(path, tokenizer, lambda tok, row, fmt: encode_preference(tok, row))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return PreferenceData([tuple(truncate(list(p), max_seq_length)) for p in pairs], pad)


def pair_batch(data: PreferenceData, idx: list[int]) -> dict:
    """m pairs as one batch of 2m rows: the chosen sequences, then the rejected ones; ``index``: the pairs'."""
    batch = collate([data.pairs[i][0] for i in idx] + [data.pairs[i][1] for i in idx], data.pad_id)
    batch["index"] = torch.tensor(idx, dtype=torch.long)
    return batch


def pair_step_batches(data: PreferenceData, sampler: StepSampler, step: int, rank: int) -> list[dict]:
    return [pair_batch(data, idx) for idx in sampler.micro_batches(step, rank)]


def strided_batches(data: PreferenceData, micro: int, rank: int, world: int):
    """Every pair once over the ranks, each rank its strided share in micro-batches; every rank forms the
    same number of batches (sharded models run collectives in forward): a rank short of pairs repeats
    pair 0, marked -1 in ``index`` so that its result is dropped."""
    per_rank = math.ceil(len(data) / world)
    idx = [rank + k * world for k in range(per_rank)]
    for start in range(0, len(idx), micro):
        chunk = idx[start:start + micro]
        batch = pair_batch(data, [i if i < len(data) else 0 for i in chunk])
        batch["index"] = torch.tensor([i if i < len(data) else -1 for i in chunk], dtype=torch.long)
        yield batch


# --- log-probabilities and the loss -----------------------------------------------------------------


def sequence_logps(model, batch: dict, device: torch.device, amp_dtype=None) -> torch.Tensor:
    """Each row's log-probability of its labelled tokens (the completion), summed, in fp32: (rows,)."""
    labels = batch["labels"].to(device, non_blocking=True)
    with autocast(device, amp_dtype):
        logits = model(**model_inputs(batch, device)).logits
    if logits.shape[1] > labels.shape[1]:  # prompt tuning's virtual tokens
        logits = logits[:, -labels.shape[1]:]
    target = shifted_labels(labels)
    token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100,
                            reduction="none")
    return -token.view(target.shape).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: (the sigmoid DPO loss, the chosen reward, the rejected reward); the rewards detached."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


# --- the reference ------------------------------------------------------------------------------------


def _peft_model(model):
    """The PeftModel under a DDP wrapper or DeepSpeed's engine."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "disable_adapter") else model


class Reference:
    """The reference's log-probabilities of a batch's rows (no graph), by ``mode`` (see the module docstring)."""

    def __init__(self, mode: str, policy, device: torch.device, amp_dtype=None, copy=None):
        self.mode, self.policy, self.device, self.amp_dtype, self.copy = mode, policy, device, amp_dtype, copy
        self.tables: dict[str, torch.Tensor] = {}  # precomputed: dataset → (pairs, 2) [chosen, rejected]

    @torch.no_grad()
    def logps(self, batch: dict, dataset: str = "train") -> torch.Tensor:
        if self.mode == "precomputed":
            table = self.tables[dataset][batch["index"].clamp(min=0)]
            return torch.cat([table[:, 0], table[:, 1]]).to(self.device)
        if self.mode == "frozen_copy":
            return sequence_logps(self.copy, batch, self.device, self.amp_dtype)
        with _peft_model(self.policy).disable_adapter():
            return sequence_logps(self.policy, batch, self.device, self.amp_dtype)

    @torch.no_grad()
    def precompute(self, dataset: str, data: PreferenceData | None, micro: int, rank: int, world: int) -> None:
        """precomputed: every pair's reference log-probabilities, by the model as it is now (before its first
        step), each rank its share, summed over the ranks so that every rank holds the whole table."""
        if self.mode != "precomputed" or data is None:
            return
        table = torch.zeros(len(data), 2, dtype=torch.float64, device=self.device)
        was_training = self.policy.training
        self.policy.eval()
        for batch in strided_batches(data, micro, rank, world):
            logps = sequence_logps(self.policy, batch, self.device, self.amp_dtype).double()
            m = len(batch["index"])
            keep = batch["index"] >= 0
            table[batch["index"][keep], 0] = logps[:m][keep.to(logps.device)]
            table[batch["index"][keep], 1] = logps[m:][keep.to(logps.device)]
        self.policy.train(was_training)
        if distributed():
            import torch.distributed as dist

            dist.all_reduce(table)
        self.tables[dataset] = table.float().cpu()

    def save(self, d: str, rank: int) -> None:
        if self.mode == "precomputed" and rank == 0:
            torch.save(self.tables, Path(d, REFERENCE_FILE))

    def load(self, d: str | None) -> bool:
        """The tables a checkpoint holds (precomputed); whether there were some."""
        if self.mode != "precomputed" or d is None or not Path(d, REFERENCE_FILE).is_file():
            return False
        self.tables = torch.load(Path(d, REFERENCE_FILE), weights_only=True)
        return True


def reference_mode(args) -> str:
    """The reference this job's arguments ask for (service/domain/spec.py dpo_reference_mode: one rule)."""
    from service.domain.spec import PeftOptions, TrainingOptions

    return dpo_reference_mode(TrainingOptions(dpo_reference=args.dpo_reference, peft=PeftOptions(method=args.peft_method)))


def make_reference(args, s, model, env, amp_dtype=None, copy=None) -> Reference:
    """The job's reference for the policy ``model`` (as wrapped; ``copy``: the frozen copy, for frozen_copy),
    its tables loaded from the checkpoint the run resumes from or computed now."""
    reference = Reference(reference_mode(args), model, env.device, amp_dtype, copy)
    with env.latest_checkpoint() as d:
        resumed = reference.load(d)
    if not resumed:
        reference.precompute("train", s.train, args.micro_batch_size, env.rank, env.world_size)
        reference.precompute("val", s.val, args.micro_batch_size, env.rank, env.world_size)
    return reference


# --- one accumulated step, and the evaluation -----------------------------------------------------------


def dpo_accumulate(model, micro_batches: list[dict], *, reference: Reference, beta: float, device: torch.device,
                   world_size: int, amp_dtype=None, scaler=None, tel=None, no_sync: Callable | None = None,
                   backward: Callable | None = None, where: dict | None = None, offload_activations: bool = False,
                   stats: dict | None = None):
    """workers/steps.py accumulate_gradients for DPO: (mean loss over the global batch's pairs, pairs, input
    tokens); ``stats`` gets the reward margin, the preference accuracy and the mean chosen and rejected rewards."""
    where = where if where is not None else {}
    local_pairs = sum(len(b["index"]) for b in micro_batches)
    global_pairs = all_reduce_sum(local_pairs, device)
    scale = world_size / max(global_pairs, 1.0)
    sums = None  # loss, margin, correct, chosen, rejected — summed over the pairs, on the loss's device
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        m = len(batch["index"])
        where["phase"] = "forward"
        ref = reference.logps(batch)
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            logps = sequence_logps(model, batch, device, amp_dtype)
            losses, chosen, rejected = dpo_loss(logps[:m], logps[m:], ref[:m].to(logps.device), ref[m:].to(logps.device),
                                                beta)
            if tel is not None:
                tel.mark("forward")
            loss = losses.sum() * scale
            where["phase"] = "backward"
            run_backward(loss, backward, scaler)
            if tel is not None:
                tel.mark("backward")
        part = torch.stack([losses.detach().sum(), (chosen - rejected).sum(), (chosen > rejected).sum(), chosen.sum(),
                            rejected.sum()]).double()
        sums = part if sums is None else sums + part
    if distributed():
        import torch.distributed as dist

        dist.all_reduce(sums)
    input_tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
    means = (sums / max(global_pairs, 1.0)).tolist()
    if stats is not None:
        stats.update(reward_margin=means[1], preference_accuracy=means[2], chosen_reward=means[3],
                     rejected_reward=means[4])
    return means[0], int(global_pairs), input_tokens


@torch.no_grad()
def dpo_evaluate(model, val: PreferenceData | None, reference: Reference, beta: float, micro: int, env,
                 amp_dtype=None) -> dict | None:
    """The validation pairs' mean DPO loss (eval_loss), reward margin and preference accuracy, across ranks."""
    if val is None:
        return None
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)
    for batch in strided_batches(val, micro, env.rank, env.world_size):
        m, keep = len(batch["index"]), batch["index"] >= 0
        ref = reference.logps(batch, "val")
        logps = sequence_logps(model, batch, env.device, amp_dtype)
        losses, chosen, rejected = dpo_loss(logps[:m], logps[m:], ref[:m].to(logps.device), ref[m:].to(logps.device), beta)
        keep = keep.to(losses.device)
        sums += torch.stack([losses[keep].sum(), (chosen - rejected)[keep].sum(), (chosen > rejected)[keep].sum(),
                             keep.sum()]).double().cpu()
    model.train(was_training)
    if distributed():
        import torch.distributed as dist

        sums = sums.to(env.device)
        dist.all_reduce(sums)
    loss, margin, correct, n = sums.tolist()
    n = max(n, 1.0)
    return {"eval_loss": loss / n, "eval_reward_margin": margin / n, "eval_preference_accuracy": correct / n}
