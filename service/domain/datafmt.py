"""Dataset formats: pure, line-by-line validation of fine-tuning JSONL (no database, no torch).

Three formats, detected from the first example and required on every line after it:

- ``chat``: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}``
  with at least one assistant message (an assistant message may be ``tool_calls`` with a null content);
- ``prompt_completion``: ``{"prompt": str, "completion": str}``;
- ``text``: ``{"text": str}``.

The one home of what a good line is: the API validates uploads and the scheduler re-checks stored
files with :func:`validate_jsonl`; the workers load the rows they tokenize with :func:`read_jsonl`.
Errors name the 1-based line (and, from :func:`read_jsonl`, the file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Iterable, Iterator

CHAT, PROMPT_COMPLETION, TEXT = "chat", "prompt_completion", "text"
FORMATS = (CHAT, PROMPT_COMPLETION, TEXT)
ROLES = ("system", "user", "assistant", "tool")
# Keys besides the defining ones that OpenAI's formats allow and memfit ignores.
_CHAT_EXTRA = {"tools", "parallel_tool_calls", "functions"}
_MESSAGE_EXTRA = {"name", "weight", "tool_calls", "tool_call_id", "function_call"}


NO_EXAMPLES = "the file holds no examples"


class DataError(ValueError):
    """A problem with one line of a dataset (``line`` is 1-based; 0 means the file as a whole), naming
    the file when ``path`` is given."""

    def __init__(self, line: int, message: str, path: str | None = None):
        self.line = line
        self.message = message
        self.path = path
        if path:
            where = f"{path}:{line}: " if line else f"{path}: "
        else:
            where = f"line {line}: " if line else ""
        super().__init__(where + message)


@dataclass(frozen=True)
class DatasetSummary:
    format: str
    rows: int


def detect_format(example: dict[str, Any]) -> str:
    if "messages" in example:
        return CHAT
    if "prompt" in example or "completion" in example:
        return PROMPT_COMPLETION
    if "text" in example:
        return TEXT
    raise ValueError(
        f"unknown example format with keys {sorted(example)[:5]}; expected 'messages' (chat), "
        "'prompt' and 'completion', or 'text'"
    )


def check_example(example: Any, fmt: str | None = None) -> str:
    """Check one parsed example; returns its format. Raises ValueError with a message naming the key."""
    if not isinstance(example, dict):
        raise ValueError(f"expected a JSON object, got {type(example).__name__}")
    found = detect_format(example)
    if fmt is not None and found != fmt:
        raise ValueError(f"expected the {fmt} format of the first example, got {found}")
    if found == CHAT:
        extra = set(example) - {"messages"} - _CHAT_EXTRA
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in a chat example")
        messages = example["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        has_assistant = False
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be an object")
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            content = m.get("content")
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise ValueError(f"messages[{i}].content must be a string")
            extra = set(m) - {"role", "content"} - _MESSAGE_EXTRA
            if extra:
                raise ValueError(f"unknown key {sorted(extra)[0]!r} in messages[{i}]")
            has_assistant = has_assistant or role == "assistant"
        if not has_assistant:
            raise ValueError("a chat example needs at least one assistant message to train on")
    elif found == PROMPT_COMPLETION:
        for key in ("prompt", "completion"):
            if not isinstance(example.get(key), str):
                raise ValueError(f"'{key}' must be a string")
        extra = set(example) - {"prompt", "completion"}
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in a prompt/completion example")
        if not example["completion"]:
            raise ValueError("'completion' is empty: there is nothing to train on")
    else:
        if not isinstance(example["text"], str) or not example["text"]:
            raise ValueError("'text' must be a non-empty string")
        extra = set(example) - {"text"}
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in a text example")
    return found


def _lines(source: str | PathLike | Iterable[str] | Iterable[bytes]) -> Iterator[str]:
    if isinstance(source, (str, PathLike)):
        with Path(source).open("rb") as fh:
            for raw in fh:
                yield raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return
    for raw in source:
        yield raw.decode("utf-8") if isinstance(raw, bytes) else raw


def iter_examples(source: str | PathLike | Iterable[str] | Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed and checked example) for each non-blank line; raises DataError."""
    fmt: str | None = None
    line_no = 0
    lines = _lines(source)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise DataError(line_no + 1, f"not UTF-8 ({exc.reason})") from None
        line_no += 1
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(line_no, f"invalid JSON: {exc.msg} at column {exc.colno}") from None
        try:
            fmt = check_example(example, fmt)
        except ValueError as exc:
            raise DataError(line_no, str(exc)) from None
        yield line_no, example


def validate_jsonl(source: str | PathLike | Iterable[str] | Iterable[bytes]) -> DatasetSummary:
    """Check every line of a JSONL dataset (a path or an iterable of lines); return its format and row count."""
    fmt, rows = None, 0
    for _, example in iter_examples(source):
        if fmt is None:
            fmt = detect_format(example)
        rows += 1
    if fmt is None:
        raise DataError(0, NO_EXAMPLES)
    return DatasetSummary(format=fmt, rows=rows)


def read_jsonl(path: str | PathLike) -> tuple[str, list[dict[str, Any]]]:
    """(format, every example) of a JSONL file, checked as :func:`validate_jsonl` checks it; raises
    DataError naming the file and the line."""
    try:
        rows = [example for _, example in iter_examples(path)]
    except DataError as exc:
        raise DataError(exc.line, exc.message, str(path)) from None
    if not rows:
        raise DataError(0, NO_EXAMPLES, str(path))
    return detect_format(rows[0]), rows
