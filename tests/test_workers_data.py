"""Datasets: the three formats, loss masking on hand-made examples, bad rows, packing, sampling."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from service.domain.datafmt import DataError, read_jsonl  # noqa: E402
from workers.data import (  # noqa: E402
    IGNORE,
    StepSampler,
    encode_example,
    load_dataset,
    pack,
)

# OpenAI's chat format with a tool call: the assistant's turn is the call (content null), a tool answers.
TOOL_CALL_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."},
]}
CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture(scope="module")
def tokenizer():
    from workers.models import build_preset, load_tokenizer

    return load_tokenizer(str(build_preset("preset:tiny-llama")))


def _trained_text(tok, ids, labels):
    return tok.decode([t for t, l in zip(ids, labels) if l != IGNORE], skip_special_tokens=False)


def test_chat_masks_everything_but_assistant_turns(tokenizer):
    row = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Grass?"},
        {"role": "assistant", "content": "Green."},
    ]}
    ids, labels = encode_example(tokenizer, row, "chat")
    assert len(ids) == len(labels)
    full = tokenizer.decode(ids, skip_special_tokens=False)
    assert full == ("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nSky?<|end|>\n<|assistant|>\nBlue.<|end|>\n"
                    "<|user|>\nGrass?<|end|>\n<|assistant|>\nGreen.<|end|>\n<|eos|>")
    # Loss on the assistant contents and their end tags (and the final eos), never on headers or user text.
    assert _trained_text(tokenizer, ids, labels) == "Blue.<|end|>\nGreen.<|end|>\n<|eos|>"


def test_prompt_completion_masks_the_prompt(tokenizer):
    ids, labels = encode_example(tokenizer, {"prompt": "Colour of snow:", "completion": " white."}, "prompt_completion")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|>Colour of snow: white.<|eos|>"
    assert _trained_text(tokenizer, ids, labels) == " white.<|eos|>"
    assert labels[0] == IGNORE


def test_text_trains_on_every_token(tokenizer):
    ids, labels = encode_example(tokenizer, {"text": "The sun is yellow."}, "text")
    assert labels == ids


def test_truncation_and_packing(tokenizer, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * n}) + "\n" for n in (3, 50, 7)))
    data = load_dataset(str(path), tokenizer, max_seq_length=16)
    assert max(len(i) for i, _ in data.examples) == 16
    packed = pack([([1, 2, 3], [1, 2, 3]), ([4, 5, 6, 7], [IGNORE, 5, 6, 7])], max_seq_length=4)
    # Rows of 4 tokens; the first token of each example never gets a label (no cross-document target).
    assert packed == [([1, 2, 3, 4], [IGNORE, 2, 3, IGNORE]), ([5, 6, 7], [5, 6, 7])]


@pytest.mark.parametrize(
    "lines, line, needle",
    [
        (['{"text": "ok"}', '{"text": "ok"}', '{"text": oops}'], 3, "invalid JSON"),
        (['{"prompt": "a", "completion": "b"}', '{"prompt": "a"}'], 2, "completion"),
        # a file of prompt rows alone is a reinforcement file (service/domain/datafmt.py); in a chat file it is refused
        (['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
          '{"messages": [{"role": "user", "content": "hi"}]}'], 2, "assistant"),
        (['{"text": "a"}', '{"prompt": "a", "completion": "b"}'], 2, "text"),
        (['{"text": "a"}', '', '{"foo": 1}'], 3, ""),
        (['{"messages": [{"role": "robot", "content": "x"}]}'], 1, "role"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, lines, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        read_jsonl(str(path))
    assert err.value.line == line
    assert needle in str(err.value)
    assert f"bad.jsonl:{line}" in str(err.value)


def test_a_tool_call_line_is_accepted_by_the_upload_and_trained_on_by_the_loader(upload_file, tenant, tokenizer,
                                                                                tmp_path):
    content = json.dumps(CHAT_ROW) + "\n" + json.dumps(TOOL_CALL_ROW) + "\n"
    r = upload_file(tenant, content)
    assert r.status_code == 200, r.text
    path = tmp_path / "tools.jsonl"
    path.write_text(content)
    data = load_dataset(str(path), tokenizer, max_seq_length=1024)
    assert data.fmt == "chat" and len(data) == 2
    ids, labels = data.examples[1]
    # memfit's default template renders the call as JSON after the (null, so absent) content, never a rendered "None".
    calls = json.dumps(TOOL_CALL_ROW["messages"][1]["tool_calls"])
    assert _trained_text(tokenizer, ids, labels) == f"{calls}<|end|>\nIt is 18C.<|end|>\n<|eos|>"
    assert "None" not in tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("bad", [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": [],
                                                      "audio": {}}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
    {"messages": [{"role": "tool", "content": "18C"}]},
], ids=["null-content-without-calls", "unknown-key", "unknown-role", "no-assistant"])
def test_a_bad_line_gets_the_same_error_from_the_upload_and_the_loader(upload_file, tenant, tmp_path, bad):
    content = json.dumps(CHAT_ROW) + "\n" + json.dumps(bad) + "\n"
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        read_jsonl(str(path))
    assert (err.value.line, err.value.path) == (2, str(path))
    assert str(err.value) == f"{path}:2: {err.value.message}"
    r = upload_file(tenant, content, filename="bad.jsonl")
    assert r.status_code == 400 and r.json()["code"] == "invalid_file"
    assert r.json()["detail"] == f"Invalid JSONL in 'bad.jsonl': line 2: {err.value.message}"


def test_run_entry_rejects_bad_rows_before_any_worker(tmp_path):
    """workers.run validates data in the driver: no Ray needed to get the structured error."""
    from service.domain.spec import RunRequest
    from workers.run import RunFailed, fit

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 12}\n')
    req = RunRequest(job_id="ftjob-bad", spec={"model": "preset:tiny-llama", "training_file": "file-1"},
                     training_path=str(bad), output_dir=str(tmp_path / "out"), metrics_path=str(tmp_path / "m.jsonl"))
    with pytest.raises(RunFailed) as err:
        fit(req)
    assert err.value.error["code"] == "data_error"
    assert err.value.error["line"] == 2
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "failure" and records[-1]["code"] == "data_error"
    assert records[-1]["details"]["line"] == 2


def test_sampler_is_a_function_of_the_step():
    big = StepSampler(n_examples=10, micro_batch_size=4, accumulation=1, world_size=1, seed=3)
    split = StepSampler(n_examples=10, micro_batch_size=2, accumulation=2, world_size=1, seed=3)
    two_ranks = StepSampler(n_examples=10, micro_batch_size=1, accumulation=2, world_size=2, seed=3)
    for step in range(6):  # crosses epoch boundaries
        one = big.micro_batches(step, 0)[0]
        assert sum(split.micro_batches(step, 0), []) == one
        assert sorted(sum(two_ranks.micro_batches(step, 0) + two_ranks.micro_batches(step, 1), [])) == sorted(one)
    # Resuming at step 4 in a fresh sampler gives the same examples.
    fresh = StepSampler(n_examples=10, micro_batch_size=4, accumulation=1, world_size=1, seed=3)
    assert fresh.micro_batches(4, 0) == big.micro_batches(4, 0)
    assert big.total_steps(n_epochs=2, max_steps=None) == 5
