"""Dataset formats: pure, line-by-line validation of fine-tuning JSONL (no database, no torch).

Four formats, detected from the first example and required on every line after it:

- ``chat``: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}``
  with at least one assistant message to train on (an assistant message may be ``tool_calls`` with a
  null content; OpenAI's per-message ``"weight": 0`` excludes an assistant turn from training, so a row
  needs one assistant turn without it), and optionally ``tools`` (OpenAI's function definitions, or the
  legacy ``functions``) rendered by the chat template;
- ``prompt_completion``: ``{"prompt": str, "completion": str}``;
- ``text``: ``{"text": str}``;
- ``preference`` (DPO, OpenAI's form): ``{"input": {"messages": [...], "tools"?: [...]},
  "preferred_output": [assistant message], "non_preferred_output": [assistant message]}``;
- ``reinforcement`` (RFT, OpenAI's form): ``{"messages": [...the prompt, not ending with an assistant
  turn], "<field>": any, ...}`` — a ``messages`` row with no assistant turn, or with keys a chat row does not
  have; those keys are what the job's grader reads as ``{{item.<field>}}`` (service/domain/graders.py), and
  the job's creation checks every row has the ones its grader reads (check_grader_fields).

A row whose every assistant turn has weight 0 is refused (naming its line), as a chat row with no
assistant turn is: it would cost a forward and backward and teach nothing, and it is always a mistake
in the data rather than a row to skip quietly (docs/data.md).

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

CHAT, PROMPT_COMPLETION, TEXT, PREFERENCE = "chat", "prompt_completion", "text", "preference"
REINFORCEMENT = "reinforcement"
FORMATS = (CHAT, PROMPT_COMPLETION, TEXT, PREFERENCE, REINFORCEMENT)
ROLES = ("system", "user", "assistant", "tool")
# Keys besides ``messages`` that OpenAI's chat format allows: the tools rendered by the chat template
# (service/domain/encoding.py), and parallel_tool_calls, which memfit accepts and does not use.
_CHAT_EXTRA = {"tools", "parallel_tool_calls", "functions"}
_MESSAGE_EXTRA = {"name", "weight", "tool_calls", "tool_call_id", "function_call"}
_PREFERENCE_KEYS = {"input", "preferred_output", "non_preferred_output"}


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
        messages = example["messages"]
        has_assistant = isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "assistant"
                                                           for m in messages)
        if set(example) - {"messages"} - _CHAT_EXTRA or not has_assistant:
            return REINFORCEMENT
        return CHAT
    if "prompt" in example or "completion" in example:
        return PROMPT_COMPLETION
    if "text" in example:
        return TEXT
    if "preferred_output" in example or "non_preferred_output" in example:
        return PREFERENCE
    raise ValueError(
        f"unknown example format with keys {sorted(example)[:5]}; expected 'messages' (chat), "
        "'prompt' and 'completion', 'text', or 'input', 'preferred_output' and 'non_preferred_output' (preference)"
    )


def _check_tools(example: dict[str, Any], where: str = "") -> None:
    for key in ("tools", "functions"):
        if key in example and (not isinstance(example[key], list) or not all(isinstance(t, dict) for t in example[key])):
            raise ValueError(f"'{where}{key}' must be a list of objects")
    if "tools" in example and "functions" in example:
        raise ValueError(f"give '{where}tools' or the legacy '{where}functions', not both")
    for i, tool in enumerate(example.get("tools") or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}")
    for i, fn in enumerate(example.get("functions") or []):
        if not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}functions[{i}] needs a 'name'")


def _check_messages(messages: Any, where: str = "messages") -> int:
    """Check a list of chat messages; returns how many assistant turns train (weight not 0)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'{where}' must be a non-empty list")
    trained = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        calls = m.get("tool_calls") or m.get("function_call")
        if not isinstance(content, str) and not (content is None and calls):
            raise ValueError(f"{where}[{i}].content must be a string")
        extra = set(m) - {"role", "content"} - _MESSAGE_EXTRA
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in {where}[{i}]")
        if "weight" in m:
            if role != "assistant":
                raise ValueError(f"{where}[{i}].weight applies to assistant messages only")
            if type(m["weight"]) not in (int, float) or m["weight"] not in (0, 1):
                raise ValueError(f"{where}[{i}].weight must be 0 or 1, got {m['weight']!r}")
        if "tool_calls" in m and (not isinstance(m["tool_calls"], list) or role != "assistant"):
            raise ValueError(f"{where}[{i}].tool_calls must be a list, on an assistant message")
        trained += role == "assistant" and m.get("weight", 1) != 0
    return trained


def _check_preference(example: dict[str, Any]) -> None:
    extra = set(example) - _PREFERENCE_KEYS
    if extra:
        raise ValueError(f"unknown key {sorted(extra)[0]!r} in a preference example")
    for key in sorted(_PREFERENCE_KEYS):
        if key not in example:
            raise ValueError(f"a preference example needs '{key}'")
    inp = example["input"]
    if not isinstance(inp, dict):
        raise ValueError("'input' must be an object with 'messages'")
    extra = set(inp) - {"messages"} - _CHAT_EXTRA
    if extra:
        raise ValueError(f"unknown key {sorted(extra)[0]!r} in 'input'")
    _check_messages(inp.get("messages"), "input.messages")
    _check_tools(inp, "input.")
    for key in ("preferred_output", "non_preferred_output"):
        out = example[key]
        if not isinstance(out, list) or len(out) != 1 or not isinstance(out[0], dict) or out[0].get("role") != "assistant":
            raise ValueError(f"'{key}' must be a list of one assistant message")
        if "weight" in out[0]:
            raise ValueError(f"{key}[0].weight: the preferred and non-preferred outputs are always trained on")
        _check_messages(out, key)


def _check_reinforcement(example: dict[str, Any]) -> None:
    messages = example["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    _check_messages([{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                     for m in messages])
    if messages[-1].get("role") == "assistant":
        raise ValueError("a reinforcement example's messages are the prompt: the last one must not be an "
                         "assistant's (the model writes that)")
    if any("weight" in m for m in messages):
        raise ValueError("'weight' has no meaning in a reinforcement example's prompt")
    _check_tools(example)


def check_grader_fields(rows: Iterable[tuple[int, dict[str, Any]]], fields: set[str]) -> None:
    """Every reinforcement row has the fields its grader reads (``{{item.<field>}}``); DataError naming the line."""
    for line, row in rows:
        missing = sorted(f for f in fields if f not in row)
        if missing:
            raise DataError(line, f"the grader reads {{{{item.{missing[0]}}}}}, which this example lacks")


def check_example(example: Any, fmt: str | None = None) -> str:
    """Check one parsed example; returns its format. Raises ValueError with a message naming the key."""
    if not isinstance(example, dict):
        raise ValueError(f"expected a JSON object, got {type(example).__name__}")
    found = detect_format(example)
    if fmt == CHAT and found == REINFORCEMENT:  # in a chat file, a row that would be a prompt is a chat row gone wrong
        extra = set(example) - {"messages"} - _CHAT_EXTRA
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in a chat example")
        _check_messages(example["messages"])
        raise ValueError("a chat example needs at least one assistant message to train on")
    if fmt is not None and found != fmt:
        raise ValueError(f"expected the {fmt} format of the first example, got {found}")
    if found == REINFORCEMENT:
        _check_reinforcement(example)
    elif found == CHAT:
        extra = set(example) - {"messages"} - _CHAT_EXTRA
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} in a chat example")
        messages = example["messages"]
        trained = _check_messages(messages)
        _check_tools(example)
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError("a chat example needs at least one assistant message to train on")
        if not trained:
            raise ValueError("every assistant message has weight 0: the example would teach nothing (give one "
                             "assistant message weight 1, or leave the example out)")
    elif found == PREFERENCE:
        _check_preference(example)
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
    fmt, numbered = read_jsonl_numbered(path)
    return fmt, [row for _, row in numbered]


def read_jsonl_numbered(path: str | PathLike) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """:func:`read_jsonl` with each example's 1-based line number, for errors found later (a chat
    template that cannot render a row's tools) to name the line too."""
    try:
        rows = list(iter_examples(path))
    except DataError as exc:
        raise DataError(exc.line, exc.message, str(path)) from None
    if not rows:
        raise DataError(0, NO_EXAMPLES, str(path))
    return detect_format(rows[0][1]), rows
