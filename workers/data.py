"""JSONL → token ids and labels, and a deterministic, resumable distributed sampler.

How a row becomes tokens (the three formats, loss masking, truncation, packing) is
service/domain/encoding.py, torch-free, so that the planner measures the same rows the workers train on
(service/memory/data.py). What a good row is — and the rows themselves — come from
service/domain/datafmt.py (:func:`read_jsonl`), the validator the API runs on uploads. Here: the rows
tokenized with the model's tokenizer, collated into padded micro-batches, and the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from service.domain.datafmt import read_jsonl
from service.domain.encoding import IGNORE, encode_example, pack, truncate

__all__ = ["IGNORE", "encode_example", "pack"]  # the encoding rule lives in service/domain/encoding.py


@dataclass
class TokenizedData:
    fmt: str
    examples: list[tuple[list[int], list[int]]]
    pad_id: int

    def __len__(self) -> int:
        return len(self.examples)


def load_dataset(path: str, tokenizer, max_seq_length: int, packing: bool = False) -> TokenizedData:
    fmt, rows = read_jsonl(path)
    examples = [encode_example(tokenizer, r, fmt) for r in rows]
    examples = truncate(examples, max_seq_length)
    if packing:
        examples = pack(examples, max_seq_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TokenizedData(fmt=fmt, examples=examples, pad_id=pad)


def rows_without_labels(data: TokenizedData) -> int:
    """Examples with no label token left (e.g. the assistant's reply cut off by max_seq_length):
    they cost a forward and backward and teach nothing."""
    return sum(1 for _, labels in data.examples if all(t == IGNORE for t in labels[1:]))


def collate(examples, pad_id: int):
    """Right-pad to the longest row; padded positions have attention 0 and label -100."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (i, l) in enumerate(examples):
        ids[row, : len(i)] = torch.tensor(i)
        labels[row, : len(l)] = torch.tensor(l)
        mask[row, : len(i)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --- sampling -----------------------------------------------------------------------------------


@dataclass
class StepSampler:
    """Which examples each rank trains on at each optimizer step, as a pure function of the step.

    The data is an endless stream of epochs, each a seeded permutation. Optimizer step ``s`` consumes
    stream positions [s·G, (s+1)·G) with G = micro × accumulation × world; micro-batch m of rank r
    takes the slice starting at s·G + (m·world + r)·micro. Resuming at step s needs nothing but s,
    and the same global batch split differently (more accumulation, fewer ranks) covers the same
    examples in the same step.
    """

    n_examples: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    seed: int

    def __post_init__(self):
        self._perms: dict[int, list[int]] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    def total_steps(self, n_epochs: int, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(n_epochs * self.n_examples / self.global_batch))

    def epoch_at(self, step: int) -> float:
        return step * self.global_batch / self.n_examples

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            import torch

            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_examples, generator=g).tolist()}
        return self._perms[epoch]

    def _index(self, position: int) -> int:
        return self._perm(position // self.n_examples)[position % self.n_examples]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        base = step * self.global_batch
        out = []
        for m in range(self.accumulation):
            start = base + (m * self.world_size + rank) * self.micro_batch_size
            out.append([self._index(p) for p in range(start, start + self.micro_batch_size)])
        return out


def step_batches(data: TokenizedData, sampler: StepSampler, step: int, rank: int) -> list[dict]:
    return [collate([data.examples[i] for i in idx], data.pad_id) for idx in sampler.micro_batches(step, rank)]


def eval_batches(data: TokenizedData, micro_batch_size: int, rank: int, world_size: int) -> Iterator[dict]:
    """The validation set in order, each rank its strided share. Every rank yields the same number
    of batches (sharded models run collectives in forward): a rank short of examples pads with a
    copy of example 0 whose labels are all -100, so it adds nothing to the loss."""
    per_rank = math.ceil(len(data) / world_size)
    rows = []
    for k in range(per_rank):
        i = rank + k * world_size
        if i < len(data):
            rows.append(data.examples[i])
        else:
            ids = data.examples[0][0]
            rows.append((ids, [IGNORE] * len(ids)))
    for start in range(0, len(rows), micro_batch_size):
        yield collate(rows[start : start + micro_batch_size], data.pad_id)


