"""JSONL → token ids and labels, and a deterministic, resumable distributed sampler.

Three formats, one per line, the format told by the keys of the first row:
- chat: ``{"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}`` — rendered with
  the tokenizer's chat template; loss only on assistant turns (content and end tag, not the header);
- prompt/completion: ``{"prompt": "...", "completion": "..."}`` — loss only on the completion;
- text: ``{"text": "..."}`` — loss on every token.

Labels are aligned with inputs (Hugging Face convention): the loss shifts them by one. -100 marks a
position that does not count. Row validation is :mod:`service.domain.datafmt`'s (the API runs it on
uploads); the small parser here is only a fallback for an older service package.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

IGNORE = -100
ROLES = {"system", "user", "assistant", "tool"}


class DataError(ValueError):
    """A bad row: names the file and the 1-based line."""

    def __init__(self, line: int, message: str, path: str | None = None):
        self.line = line
        self.path = path
        self.message = message
        where = f"{path}:{line}" if path else f"line {line}"
        super().__init__(f"{where}: {message}")


def _check_row(row, fmt: str | None, line: int, path: str) -> str:
    if not isinstance(row, dict):
        raise DataError(line, "each line must be a JSON object", path)
    if "messages" in row:
        kind = "chat"
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(line, "'messages' must be a non-empty list", path)
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    line, f"messages[{i}] needs a role ({', '.join(sorted(ROLES))}) and a string content", path
                )
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(line, "a chat example needs at least one assistant message", path)
    elif "prompt" in row or "completion" in row:
        kind = "prompt_completion"
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise DataError(line, f"'{key}' must be a string", path)
        if not row["completion"]:
            raise DataError(line, "'completion' is empty", path)
    elif "text" in row:
        kind = "text"
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(line, "'text' must be a non-empty string", path)
    else:
        raise DataError(line, "unknown format: expected 'messages', 'prompt'/'completion' or 'text'", path)
    if fmt is not None and kind != fmt:
        raise DataError(line, f"row is {kind} but the file started as {fmt}; one format per file", path)
    return kind


def read_jsonl(path: str) -> tuple[str, list[dict]]:
    """Parse and validate every row; raise DataError (file and line) at the first bad one.
    Returns (format, rows). Uses service.domain.datafmt — the validator the API runs on uploads — so
    the driver, the workers and the API agree on what a good row is."""
    try:
        from service.domain import datafmt
    except ImportError:  # pragma: no cover - only where service/ is older than the workers
        return _read_jsonl_local(path)
    rows: list[dict] = []
    try:
        for _, row in datafmt.iter_examples(path):
            rows.append(row)
    except datafmt.DataError as exc:
        raise DataError(exc.line, exc.message, path) from None
    if not rows:
        raise DataError(0, "the file holds no examples", path)
    return datafmt.detect_format(rows[0]), rows


def _read_jsonl_local(path: str) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    fmt: str | None = None
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise DataError(n, f"invalid JSON: {exc.msg} at column {exc.colno}", path) from None
            fmt = _check_row(row, fmt, n, path)
            rows.append(row)
    if not rows:
        raise DataError(0, "the file holds no examples", path)
    return fmt, rows


# --- tokenization -------------------------------------------------------------------------------


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _delta(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("the chat template does not render prefixes consistently")
    return longer[len(shorter) :]


def encode_example(tokenizer, row: dict, fmt: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one row. Each rendered piece is tokenized on its own so that the mask
    boundary is exact: the template's role tags are special tokens, so pieces never merge across."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        ids = bos + _ids(tokenizer, row["text"]) + eos
        return ids, list(ids)
    if fmt == "prompt_completion":
        prompt = bos + _ids(tokenizer, row["prompt"])
        completion = _ids(tokenizer, row["completion"]) + eos
        return prompt + completion, [IGNORE] * len(prompt) + completion
    ids, labels = list(bos), [IGNORE] * len(bos)
    msgs = row["messages"]
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            header = _delta(_render(tokenizer, msgs[:i], add_generation_prompt=True), done)
            full = _render(tokenizer, msgs[: i + 1])
            body = _delta(full, done + header)
            h, b = _ids(tokenizer, header), _ids(tokenizer, body)
            ids += h + b
            labels += [IGNORE] * len(h) + b
        else:
            full = _render(tokenizer, msgs[: i + 1])
            piece = _ids(tokenizer, _delta(full, done))
            ids += piece
            labels += [IGNORE] * len(piece)
        done = full
    ids += eos
    labels += eos
    return ids, labels


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
    examples = [(i[:max_seq_length], l[:max_seq_length]) for i, l in examples]
    if packing:
        examples = pack(examples, max_seq_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TokenizedData(fmt=fmt, examples=examples, pad_id=pad)


def rows_without_labels(data: TokenizedData) -> int:
    """Examples with no label token left (e.g. the assistant's reply cut off by max_seq_length):
    they cost a forward and backward and teach nothing."""
    return sum(1 for _, labels in data.examples if all(t == IGNORE for t in labels[1:]))


def pack(examples, max_seq_length: int):
    """Concatenate examples into rows of max_seq_length tokens. The first token of each example gets
    label -100 so that no position learns to predict across a document boundary."""
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    for ids, labels in examples:
        flat_ids += ids
        flat_labels += [IGNORE] + labels[1:]
    rows = []
    for start in range(0, len(flat_ids), max_seq_length):
        rows.append((flat_ids[start : start + max_seq_length], flat_labels[start : start + max_seq_length]))
    return rows


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


def count_lines(path: str | Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())
