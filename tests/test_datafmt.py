"""Dataset JSONL validation, usable without the API (the workers import it)."""

from __future__ import annotations

import pytest

from service.domain.datafmt import DataError, DatasetSummary, validate_jsonl

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
