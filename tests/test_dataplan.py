"""Plans that know the data (issue 13, item 1): the service tokenizes a training file as the workers do,
plans the widest micro-batch the sampler can form, keeps the bound at max_seq_length beside it, and
memory_policy=reject decides on the data. (The end-to-end check of the data plan against a real job's
measured peak is tests/test_e2e.py: test_a_job_on_chat_data_peaks_where_its_data_plan_says.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.domain.encoding import row_lengths
from service.domain.presets import PRESETS
from service.domain.spec import validate_spec
from service.memory.data import data_shape, example_lengths, tokenizer_from_dir
from service.memory.preflight import plan_for_spec
from service.settings import Settings

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
TOOL_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."}]}
# A template of the kind models ship: the bos token as text, a system default, loop controls, tojson,
# raise_exception and a {% generation %} block (transformers' AssistantTracker).
SHIPPED_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>\nBe helpful.<|end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role') }}{% endif %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataplan")
    return Settings(database_url=f"sqlite:///{root}/memfit.db", storage_dir=root / "storage", model_dirs=[root])


def spec(**hyperparameters):
    return validate_spec({"model": "preset:tiny-llama", "training_file": "file-x",
                          "training": {"hyperparameters": {"micro_batch_size": 8, **hyperparameters}}}, None)


def test_the_service_tokenizes_rows_as_the_workers_do(tmp_path):
    """Every row's length, for every format, truncation and packing: the service's tokenizer (no torch)
    against the workers' loader with the transformers tokenizer, for a preset and for a model directory
    whose template uses bos_token, tojson and {% generation %}."""
    pytest.importorskip("transformers")
    from workers.data import load_dataset
    from workers.models import load_tokenizer, train_tokenizer

    preset_dir = tmp_path / "preset"
    train_tokenizer(512, 1024).save_pretrained(preset_dir)  # what a preset build writes
    shipped_dir = tmp_path / "shipped"
    shipped = train_tokenizer(512, 1024)
    shipped.chat_template = SHIPPED_TEMPLATE
    shipped.save_pretrained(shipped_dir)
    tools = tmp_path / "tools.jsonl"
    tools.write_text("\n".join(json.dumps(r) for r in [TOOL_ROW] + [
        json.loads(line) for line in (DATA / "chat.jsonl").read_text().splitlines()[:5]]) + "\n")
    files = [DATA / "chat.jsonl", DATA / "completion.jsonl", DATA / "text.jsonl", tools]
    for model_dir in (preset_dir, shipped_dir):
        ours = tokenizer_from_dir(str(model_dir))
        theirs = load_tokenizer(str(model_dir))
        for path in files:
            for max_len, packing in ((4096, False), (40, False), (64, True)):
                planned = row_lengths(list(example_lengths(str(path), ours)), max_len, packing)
                trained = [len(ids) for ids, _ in load_dataset(str(path), theirs, max_len, packing).examples]
                assert planned == trained, (model_dir.name, path.name, max_len, packing)
    # The preset's own tokenizer, built without torch, is the preset build's.
    d = data_shape(spec(max_seq_length=4096), str(DATA / "chat.jsonl"))
    assert d.measured and d.longest_row_tokens == max(
        len(ids) for ids, _ in load_dataset(str(DATA / "chat.jsonl"), load_tokenizer(str(preset_dir)), 4096).examples)


def test_the_data_plan_is_the_bound_when_rows_fill_max_seq_length(settings):
    chat = str(DATA / "chat.jsonl")
    full = plan_for_spec(spec(max_seq_length=32), settings, training_path=chat)  # every chat row is longer
    assert full.data.measured and full.data.planned_seq_length == 32 and not full.data.padded
    assert full.data.truncated_examples == full.data.examples == 64
    bound = full.at_max_seq_length
    assert (full.peak_bytes, full.need_bytes, full.per_rank, full.phases["backward"] > 0) == (
        bound.peak_bytes, bound.need_bytes, bound.per_rank, True)
    assert full.per_rank == plan_for_spec(spec(max_seq_length=32), settings).per_rank  # no file: the same bound

    short = plan_for_spec(spec(max_seq_length=1024), settings, training_path=chat)
    d = short.data
    assert d.measured and d.planned_seq_length == d.longest_row_tokens < 100 and d.padded
    assert d.truncated_examples == 0 and d.rows == d.examples == 64
    assert short.peak_bytes < short.at_max_seq_length.peak_bytes / 4  # 1024 vs ~73 tokens a row
    assert any(a.startswith("rows padded to the longest row") for a in short.assumptions)

    packed = plan_for_spec(spec(max_seq_length=256, packing=True), settings, training_path=chat)
    tokens = round(d.mean_row_tokens * d.rows)  # every chat row whole at 1024
    assert packed.data.planned_seq_length == 256 and packed.data.rows == -(-tokens // 256)
    # rows packed with several examples are attended block-diagonally (a mask, as padding has): planned so, and
    # so is the bound, whose rows are full max_seq_length ones of several examples too
    assert packed.data.padded
    assert packed.per_rank.device.activations == packed.at_max_seq_length.per_rank.device.activations
    unpacked = plan_for_spec(spec(max_seq_length=256), settings)
    assert packed.per_rank.device.activations > unpacked.per_rank.device.activations


def test_without_data_or_tokenizer_the_plan_says_why_and_uses_the_bound(settings):
    no_tokenizer = Path(settings.model_dirs[0]) / "bare"  # a model directory with a config and no tokenizer
    no_tokenizer.mkdir(exist_ok=True)
    (no_tokenizer / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    body = {"model": str(no_tokenizer), "training_file": "file-x"}
    local = validate_spec(body, None)
    p = plan_for_spec(local, settings, training_path=str(DATA / "chat.jsonl"))
    assert not p.data.measured and "no tokenizer.json" in p.data.reason
    assert p.peak_bytes == p.at_max_seq_length.peak_bytes
    hub = plan_for_spec(validate_spec({"model": "meta-llama/Llama-2-7b-hf", "training_file": "file-x"}, None),
                        settings, training_path=str(DATA / "chat.jsonl"))
    assert not hub.data.measured and "hub model" in hub.data.reason


def test_reject_admits_a_job_whose_data_fits_and_refuses_one_whose_data_does_not(client, tenant, upload_file):
    """memory_policy=reject decides on the data's worst micro-batch: a budget between the data's need and
    the bound's admits the job, one below the data's need refuses it."""
    chat = upload_file(tenant, (DATA / "chat.jsonl").read_bytes()).json()["id"]
    training = {"hyperparameters": {"micro_batch_size": 8, "max_seq_length": 4096}}
    planned = client.post("/v1/memory/plan", headers=tenant.headers,
                          json={"model": "preset:tiny-llama", "training_file": chat, "training": training}).json()
    assert planned["data"]["measured"] and planned["data"]["planned_seq_length"] < 100
    data_need, bound_need = planned["need_bytes"], planned["at_max_seq_length"]["need_bytes"]
    assert bound_need > data_need * 1.2

    def create(budget: int):
        return client.post("/v1/fine_tuning/jobs", headers=tenant.headers, json={
            "model": "preset:tiny-llama", "training_file": chat, "training": {
                **training, "memory_policy": "reject", "resources": {"host_memory_budget_bytes": budget}}})

    between = int((data_need + bound_need) / 2 / 0.9)  # usable = budget × (1 − 10%)
    admitted = create(between)
    assert admitted.status_code == 200, admitted.text
    memory = admitted.json()["memory"]
    assert memory["fits"] is True and memory["planned_for_data"] is True
    stored = client.get(f"/v1/fine_tuning/jobs/{admitted.json()['id']}/memory", headers=tenant.headers).json()
    assert stored["plan"]["at_max_seq_length"]["fits"] is False  # the bound alone would have been refused
    assert stored["predicted_at_max_seq_length"] > stored["predicted"]["total"]

    refused = create(int(data_need * 0.98 / 0.9))
    assert refused.status_code == 422 and refused.json()["code"] == "insufficient_memory", refused.text
    assert refused.json()["plan"]["data"]["measured"]
    # another tenant's file is not planned: 404, as at creation
    other = client.post("/v1/memory/plan", headers=tenant.headers,
                        json={"model": "preset:tiny-llama", "training_file": "file-nope"})
    assert other.status_code == 404
