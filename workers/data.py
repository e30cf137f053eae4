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

from service.domain.datafmt import DataError, read_jsonl_numbered
from service.domain.encoding import (
    IGNORE,
    encode_example,
    pack,
    pack_segments,
    packed_position_ids,
    truncate,
)
from service.domain.sampling import StepOrder

__all__ = ["IGNORE", "encode_example", "pack"]  # the encoding rule lives in service/domain/encoding.py


@dataclass
class TokenizedData:
    fmt: str
    examples: list[tuple[list[int], list[int]]]
    pad_id: int
    # packing: each row's position ids, restarting at every example's piece (encoding.packed_position_ids);
    # None when every row is one example
    positions: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.examples)


def encode_rows(path: str, tokenizer, encode=encode_example) -> tuple[str, list]:
    """(format, ``encode(tokenizer, row, fmt)`` of every row); a row the encoding refuses (a chat template
    that cannot render its tools) raises DataError naming the file and the line."""
    fmt, rows = read_jsonl_numbered(path)
    out = []
    for line, row in rows:
        try:
            out.append(encode(tokenizer, row, fmt))
        except ValueError as exc:
            raise DataError(line, str(exc), str(path)) from None
    return fmt, out


def load_dataset(path: str, tokenizer, max_seq_length: int, packing: bool = False) -> TokenizedData:
    fmt, examples = encode_rows(path, tokenizer)
    examples = truncate(examples, max_seq_length)
    positions = None
    if packing:
        positions = [packed_position_ids(row) for row in pack_segments([len(i) for i, _ in examples], max_seq_length)]
        examples = pack(examples, max_seq_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TokenizedData(fmt=fmt, examples=examples, pad_id=pad, positions=positions)


def rows_without_labels(data: TokenizedData) -> int:
    """Examples with no label token left (e.g. the assistant's reply cut off by max_seq_length):
    they cost a forward and backward and teach nothing."""
    return sum(1 for _, labels in data.examples if all(t == IGNORE for t in labels[1:]))


def collate(examples, pad_id: int, positions: list[list[int]] | None = None):
    """Right-pad to the longest row; padded positions have attention 0 and label -100.

    Packed rows (``positions``: each row's position ids, restarting at every example) also get
    ``position_ids``, and the padding of a shorter row positions of its own from 0: the model then
    masks attention block-diagonally, each example (and the padding) attending only within itself
    (transformers/masking_utils.py: create_causal_mask reads restarts of position_ids as sequence
    boundaries when it is given no 2D attention mask — forward_loss_sum passes it none for them)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (i, l) in enumerate(examples):
        ids[row, : len(i)] = torch.tensor(i)
        labels[row, : len(l)] = torch.tensor(l)
        mask[row, : len(i)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if positions is not None:
        pos = torch.zeros((len(examples), width), dtype=torch.long)
        for row, p in enumerate(positions):
            pos[row, : len(p)] = torch.tensor(p)
            pos[row, len(p):] = torch.arange(width - len(p))
        batch["position_ids"] = pos
    return batch


# --- sampling -----------------------------------------------------------------------------------


class StepSampler(StepOrder):
    """Which examples each rank trains on at each optimizer step, as a pure function of the step: the rule of
    service/domain/sampling.py (the planner predicts each step's micro-batches from the same rule)."""


def step_batches(data: TokenizedData, sampler: StepSampler, step: int, rank: int) -> list[dict]:
    return [collate([data.examples[i] for i in idx], data.pad_id,
                    [data.positions[i] for i in idx] if data.positions is not None else None)
            for idx in sampler.micro_batches(step, rank)]


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


