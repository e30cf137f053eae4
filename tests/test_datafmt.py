"""Dataset JSONL validation, usable without the API (the workers import it)."""

from __future__ import annotations

import json

import pytest

from service.domain.datafmt import DataError, DatasetSummary, read_jsonl, validate_jsonl

CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


@pytest.mark.parametrize(
    "lines, summary",
    [
        ([CHAT, CHAT], DatasetSummary("chat", 2)),
        (['{"prompt": "a", "completion": "b"}'], DatasetSummary("prompt_completion", 1)),
        (['{"text": "a"}', "", '{"text": "b"}\n'], DatasetSummary("text", 2)),
    ],
)
def test_formats(lines, summary):
    assert validate_jsonl(lines) == summary


@pytest.mark.parametrize(
    "lines, line, message",
    [
        ([CHAT, "[1, 2]"], 2, "expected a JSON object, got list"),
        ([CHAT, "{oops"], 2, "invalid JSON: Expecting property name enclosed in double quotes at column 2"),
        (['{"messages": []}'], 1, "'messages' must be a non-empty list"),
        (['{"messages": [{"role": "bot", "content": "x"}]}'], 1,
         "messages[0].role must be one of system, user, assistant, tool, got 'bot'"),
        (['{"messages": [{"role": "user", "content": 5}]}'], 1, "messages[0].content must be a string"),
        ([CHAT, '{"prompt": "a", "completion": "b"}'], 2,
         "expected the chat format of the first example, got prompt_completion"),
        (['{"prompt": "a"}'], 1, "'completion' must be a string"),
        (['{"text": "a", "label": 1}'], 1, "unknown key 'label' in a text example"),
        (['{"input": "a"}'], 1, "unknown example format with keys ['input']; expected 'messages' (chat), "
                               "'prompt' and 'completion', or 'text'"),
        ([], 0, "the file holds no examples"),
    ],
)
def test_errors_name_the_line(lines, line, message):
    with pytest.raises(DataError) as exc:
        validate_jsonl(lines)
    assert (exc.value.line, exc.value.message) == (line, message)


def test_path_and_bytes(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes((CHAT + "\n").encode() * 3 + b"\xff\xfe\n")
    with pytest.raises(DataError) as exc:
        validate_jsonl(p)
    assert exc.value.line == 4 and "not UTF-8" in exc.value.message
    assert validate_jsonl([CHAT.encode()]) == DatasetSummary("chat", 1)


def test_assistant_tool_calls_with_null_content_are_a_chat_example():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    row = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "done"}, {"role": "assistant", "content": "ok"}]}
    assert validate_jsonl([json.dumps(row)]) == DatasetSummary("chat", 1)


def test_read_jsonl_returns_the_rows_and_names_the_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(CHAT + "\n\n" + CHAT + "\n")
    assert read_jsonl(p) == ("chat", [json.loads(CHAT)] * 2)
    p.write_text(CHAT + "\n" + '{"text": 1}' + "\n")
    with pytest.raises(DataError) as exc:
        read_jsonl(p)
    assert (exc.value.line, exc.value.message, exc.value.path) == (2, "expected the chat format of the first example, got text", str(p))
    assert str(exc.value) == f"{p}:2: expected the chat format of the first example, got text"
    p.write_text("\n")
    with pytest.raises(DataError) as exc:
        read_jsonl(p)
    assert str(exc.value) == f"{p}: the file holds no examples"
