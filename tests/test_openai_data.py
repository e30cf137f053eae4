"""OpenAI's data semantics, as the workers tokenize them and the planner measures them (one rule,
service/domain/encoding.py): per-message ``weight``, ``tools`` (and the legacy ``functions``) through the
chat template, trained tool calls, a template that cannot render tools refused naming the line (by the
loader and by POST /v1/fine_tuning/jobs), DPO's preference rows; the model names OpenAI's way; and the
mean token accuracy the workers report."""

from __future__ import annotations

import json

import pytest

from service.domain.encoding import DEFAULT_CHAT_TEMPLATE, IGNORE, encode_example, encode_preference
from service.domain.model_names import (
    ModelNameError,
    checkpoint_model_name,
    fine_tuned_model_name,
    parse_model_name,
)

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS_ROW = {"tools": [TOOL], "parallel_tool_calls": False, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."}]}
TWO_TURNS = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky?"},
    {"role": "assistant", "content": "Blue, mostly."}, {"role": "user", "content": "Grass?"},
    {"role": "assistant", "content": "Green."}]}


@pytest.fixture(scope="module")
def preset_dir():
    from workers.models import build_preset

    return build_preset("preset:tiny-llama")


@pytest.fixture(scope="module")
def tokenizers(preset_dir):
    """(the workers' transformers tokenizer, the planner's torch-free one) of the same preset."""
    from service.domain.presets import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, preset_config, preset_tokenizer
    from service.memory.data import JsonTokenizer
    from workers.models import load_tokenizer

    vocab = int(preset_config("preset:tiny-llama")["vocab_size"])
    ours = JsonTokenizer(preset_tokenizer(vocab), {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
                         DEFAULT_CHAT_TEMPLATE, key="test")
    return load_tokenizer(str(preset_dir)), ours


def trained(tok, ids, labels) -> str:
    return tok.decode([t for t, l in zip(ids, labels) if l != IGNORE], skip_special_tokens=False)


def test_a_weight_0_turn_has_exactly_its_tokens_masked(tokenizers):
    theirs, ours = tokenizers
    weighted = {"messages": [{**m, "weight": 0} if m["content"] == "Blue, mostly." else m for m in TWO_TURNS["messages"]]}
    ids, labels = encode_example(theirs, TWO_TURNS, "chat")
    w_ids, w_labels = encode_example(theirs, weighted, "chat")
    assert w_ids == ids  # the turn is still context: the same tokens
    changed = [i for i, (a, b) in enumerate(zip(labels, w_labels)) if a != b]
    assert all(w_labels[i] == IGNORE for i in changed)
    assert theirs.decode([ids[i] for i in changed], skip_special_tokens=False) == "Blue, mostly.<|end|>\n"
    assert trained(theirs, w_ids, w_labels) == "Green.<|end|>\n<|eos|>"
    # the last turn at weight 0 takes the row's end with it
    last = {"messages": TWO_TURNS["messages"][:-1] + [{**TWO_TURNS["messages"][-1], "weight": 0}]}
    assert trained(theirs, *encode_example(theirs, last, "chat")) == "Blue, mostly.<|end|>\n"
    assert encode_example(ours, weighted, "chat") == (w_ids, w_labels)  # the planner's tokenizer: the same rule


def test_tools_are_rendered_by_the_template_and_tool_calls_trained(tokenizers):
    theirs, ours = tokenizers
    ids, labels = encode_example(theirs, TOOLS_ROW, "chat")
    text = theirs.decode(ids, skip_special_tokens=False)
    # transformers' apply_chat_template(tools=…) renders the tools first; the model sees what it may call
    assert text.startswith("<|bos|><|tools|>\n" + json.dumps([TOOL]) + "<|end|>\n<|user|>\nWeather in Paris?")
    assert text == "<|bos|>" + theirs.apply_chat_template(TOOLS_ROW["messages"], tools=[TOOL], tokenize=False) + "<|eos|>"
    assert trained(theirs, ids, labels) == json.dumps([CALL]) + "<|end|>\nIt is 18C.<|end|>\n<|eos|>"
    assert encode_example(ours, TOOLS_ROW, "chat") == (ids, labels)
    # the legacy form: functions and function_call are the same tools and call
    legacy = {"functions": [TOOL["function"]], "messages": [
        TOOLS_ROW["messages"][0], {"role": "assistant", "content": None, "function_call": CALL["function"]}]}
    l_ids, l_labels = encode_example(theirs, legacy, "chat")
    assert theirs.decode(l_ids, skip_special_tokens=False).startswith("<|bos|><|tools|>\n" + json.dumps([TOOL]))
    assert trained(theirs, l_ids, l_labels) == json.dumps([{"type": "function", "function": CALL["function"]}]) + \
        "<|end|>\n<|eos|>"
    assert encode_example(ours, legacy, "chat") == (l_ids, l_labels)


def test_a_template_that_cannot_render_tools_is_refused_naming_the_line(tokenizers, tmp_path):
    from service.domain.datafmt import DataError
    from workers.data import load_dataset

    theirs, _ = tokenizers
    blind = type(theirs).from_pretrained(theirs.name_or_path)
    blind.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}" \
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(TWO_TURNS) + "\n\n" + json.dumps(TOOLS_ROW) + "\n")
    with pytest.raises(DataError) as exc:
        load_dataset(str(path), blind, 256)
    assert (exc.value.line, exc.value.path) == (3, str(path))
    assert "does not render them" in exc.value.message


def test_post_job_refuses_a_file_whose_tools_the_models_template_cannot_render(new_database, tmp_path, tokenizers):
    """A local model whose chat template ignores ``tools``: 400 naming the training file's line."""
    from tests.factories import bearer, new_key, upload
    from tests.scheduler_support import app_without_ray

    theirs, _ = tokenizers
    models = tmp_path / "models"
    blind = models / "blind"
    import shutil

    shutil.copytree(theirs.name_or_path, blind)
    config = json.loads((blind / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    (blind / "tokenizer_config.json").write_text(json.dumps(config))
    (blind / "chat_template.jinja").unlink(missing_ok=True)
    with app_without_ray(new_database, tmp_path / "storage", model_dirs=[models]) as (app, client, _):
        key = new_key(app.state.sessions)
        file_id = upload(client, key, [TWO_TURNS, TOOLS_ROW])
        r = client.post("/v1/fine_tuning/jobs", headers=bearer(key), json={"model": str(blind), "training_file": file_id})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["param"] == "training_file" and body["error"]["code"] == "invalid_file"
        assert f"training_file {file_id} line 2:" in body["detail"] and "does not render them" in body["detail"]
        ok = upload(client, key, [TWO_TURNS])  # without tools the same model is fine
        assert client.post("/v1/fine_tuning/jobs", headers=bearer(key),
                           json={"model": str(blind), "training_file": ok}).status_code == 200
        # a row whose every assistant turn has weight 0 teaches nothing: refused at upload, naming its line
        silent = {"messages": [{**m, "weight": 0} if m["role"] == "assistant" else m for m in TWO_TURNS["messages"]]}
        r = client.post("/v1/files", headers=bearer(key), data={"purpose": "fine-tune"},
                        files={"file": ("w.jsonl", (json.dumps(TWO_TURNS) + "\n" + json.dumps(silent) + "\n").encode())})
        assert r.status_code == 400 and "line 2: every assistant message has weight 0" in r.json()["detail"], r.text


def test_a_preference_row_is_two_sequences_labelled_on_their_outputs(tokenizers):
    theirs, ours = tokenizers
    row = {"input": {"messages": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Hm."},
                                  {"role": "user", "content": "Colour?"}]},
           "preferred_output": [{"role": "assistant", "content": "Blue."}],
           "non_preferred_output": [{"role": "assistant", "content": "Loud."}]}
    (c_ids, c_labels), (r_ids, r_labels) = encode_preference(theirs, row)
    assert trained(theirs, c_ids, c_labels) == "Blue.<|end|>\n<|eos|>"  # the input's assistant turn is context
    assert trained(theirs, r_ids, r_labels) == "Loud.<|end|>\n<|eos|>"
    prompt = len(c_ids) - sum(l != IGNORE for l in c_labels)
    assert c_ids[:prompt] == r_ids[:prompt]  # the same prompt before each output
    assert encode_preference(ours, row) == ((c_ids, c_labels), (r_ids, r_labels))


def test_model_names_are_openais_form_and_parse_back():
    assert fine_tuned_model_name("preset:tiny-llama", "my-run", "ftjob-abc") == "ft:preset:tiny-llama:my-run:ftjob-abc"
    assert fine_tuned_model_name("gpt2", None, "ftjob-abc") == "ft:gpt2::ftjob-abc"  # no suffix: an empty segment
    name = checkpoint_model_name("org/Model-7B", "x_1", "ftjob-abc", 88)
    assert name == "ft:org/Model-7B:x_1:ftjob-abc:ckpt-step-88"
    parsed = parse_model_name(name)
    assert (parsed.base, parsed.suffix, parsed.job_id, parsed.step) == ("org/Model-7B", "x_1", "ftjob-abc", 88)
    assert str(parsed) == name
    assert parse_model_name("ft:preset:tiny-llama::ftjob-abc").suffix is None
    for bad in ("gpt-4o", "ft:gpt2:ftjob-abc", "ft:gpt2::notajob", "ft:gpt2:bad suffix:ftjob-abc"):
        with pytest.raises(ModelNameError):
            parse_model_name(bad)
    with pytest.raises(ValueError):
        fine_tuned_model_name("gpt2", "a:b", "ftjob-abc")


def test_mean_token_accuracy_is_the_argmax_over_label_positions():
    import torch

    from workers.steps import token_correct

    labels = torch.tensor([[5, 1, 2, 3, -100], [5, 4, -100, 4, 0]])
    logits = torch.zeros(2, 5, 8)
    # position t predicts label t+1: row 0 right at positions 0 and 2 (labels 1, 3), wrong at 1 (label 2)
    for t, token in ((0, 1), (1, 7), (2, 3), (3, 6)):
        logits[0, t, token] = 1.0
    for t, token in ((0, 4), (2, 4), (3, 1)):  # row 1: labels 4, (-100), 4, 0 → right twice, wrong once
        logits[1, t, token] = 1.0
    assert int(token_correct(logits, labels)) == 4  # of the 6 label positions
