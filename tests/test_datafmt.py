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
                               "'prompt' and 'completion', 'text', or 'input', 'preferred_output' and "
                               "'non_preferred_output' (preference)"),
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


# --- OpenAI's chat semantics (weight, tools) and its preference rows (DPO) ------------------------------

USER = {"role": "user", "content": "q"}


def chat(*messages, **extra) -> str:
    return json.dumps({"messages": list(messages), **extra})


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
PREF = {"input": {"messages": [USER]}, "preferred_output": [{"role": "assistant", "content": "good"}],
        "non_preferred_output": [{"role": "assistant", "content": "bad"}]}


@pytest.mark.parametrize("row", [
    chat(USER, {"role": "assistant", "content": "a", "weight": 0}, USER, {"role": "assistant", "content": "b", "weight": 1}),
    chat(USER, {"role": "assistant", "content": "a"}, tools=[TOOL], parallel_tool_calls=False),
    chat(USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
         functions=[{"name": "f", "parameters": {}}]),
], ids=["weights", "tools", "legacy-functions"])
def test_openais_chat_rows_are_accepted(row):
    assert validate_jsonl([row]) == DatasetSummary("chat", 1)


def test_preference_rows_are_their_own_format():
    assert validate_jsonl([json.dumps(PREF), json.dumps({**PREF, "input": {"messages": [USER], "tools": [TOOL]}})]) == \
        DatasetSummary("preference", 2)


@pytest.mark.parametrize("row, message", [
    (chat(USER, {"role": "assistant", "content": "a", "weight": 0}),
     "every assistant message has weight 0: the example would teach nothing (give one assistant message weight 1, "
     "or leave the example out)"),
    (chat(USER, {"role": "assistant", "content": "a", "weight": 2}), "messages[1].weight must be 0 or 1, got 2"),
    (chat({**USER, "weight": 0}, {"role": "assistant", "content": "a"}),
     "messages[0].weight applies to assistant messages only"),
    (chat(USER, {"role": "assistant", "content": "a"}, tools={"a": 1}), "'tools' must be a list of objects"),
    (chat(USER, {"role": "assistant", "content": "a"}, tools=[{"type": "function"}]),
     'tools[0] must be {"type": "function", "function": {"name": …}}'),
    (json.dumps({**PREF, "preferred_output": [{"role": "user", "content": "x"}]}),
     "'preferred_output' must be a list of one assistant message"),
    (json.dumps({k: v for k, v in PREF.items() if k != "input"}), "a preference example needs 'input'"),
    (json.dumps({**PREF, "extra": 1}), "unknown key 'extra' in a preference example"),
], ids=["all-weight-0", "weight-2", "weight-on-user", "tools-not-list", "tool-without-function", "preferred-not-assistant",
        "no-input", "unknown-key"])
def test_openai_semantics_errors_name_the_line(row, message):
    with pytest.raises(DataError) as exc:
        validate_jsonl([CHAT if row.startswith('{"messages"') else json.dumps(PREF), row])
    assert (exc.value.line, exc.value.message) == (2, message)
