"""Serving without Ray: the transformers engine in this process (mixed-adapter batches, stops, n, logprobs,
the context check), the serving memory planner and its admission, OpenAI's shapes, the Serve config memfit
puts, and the API's /v1/models and completions routes where no Serve is configured (both backends)."""

from __future__ import annotations

import threading
import time

import pytest

from service.domain.presets import PRESETS
from service.domain.serving import Assembler, ChatCompletionRequest, CompletionRequest, engine_request
from service.memory.serving import ServingDoesNotFit, admit, kv_bytes_per_token, plan_serving
from service.memory.shape import shape_from_config
from service.scheduler.serve_apps import AppSpec, ServeApps, ServeOptions

QUESTION = [{"role": "user", "content": "What is the launch code?"}]


# --- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from workers.models import build_preset
    from workers.serving_engine import TransformersEngine

    base = str(build_preset("preset:tiny-llama"))
    folder = tmp_path_factory.mktemp("adapters")
    for name, seed in (("a1", 1), ("a2", 2)):
        torch.manual_seed(seed)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                    peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.save_pretrained(folder / name)
    # a batch window long enough for a loaded machine's three submits (each renders its chat template) to meet
    e = TransformersEngine(base, max_batch=8, batch_window_s=0.25)
    e.load_adapter("a1", str(folder / "a1"))
    e.load_adapter("a2", str(folder / "a2"))
    yield e
    e.close()


def run(engine, requests: list[tuple[dict, str | None]]) -> list[list[dict]]:
    """Submit every request at once (one batch); each one's events once all ended."""
    outs: list[list[dict]] = [[] for _ in requests]
    ends = [0] * len(requests)
    want = [r[0].get("n", 1) for r in requests]
    done = threading.Event()
    lock = threading.Lock()

    def sink_for(i):
        def sink(event):
            with lock:
                outs[i].append(event)
                if event["event"] in ("end", "error"):
                    ends[i] += 1
                if all(e >= w for e, w in zip(ends, want)):
                    done.set()
        return sink

    for i, (body, adapter) in enumerate(requests):
        engine.submit(body, adapter, sink_for(i))
    assert done.wait(60)
    return outs


def text(events: list[dict], index: int = 0) -> str:
    return "".join(e["text"] for e in events if e["event"] == "delta" and e["index"] == index)


def chat_body(**sampling) -> dict:
    return {"kind": "chat", "messages": QUESTION, "sampling": {"max_tokens": 10, "temperature": 0, **sampling}}


def test_a_batch_mixing_adapters_gives_each_row_what_it_gets_alone(engine):
    alone = {a: text(run(engine, [(chat_body(), a)])[0]) for a in (None, "a1", "a2")}
    assert len(set(alone.values())) == 3  # the adapters change the answer
    before = engine.max_adapters_in_batch
    mixed = run(engine, [(chat_body(), None), (chat_body(), "a1"), (chat_body(), "a2")])
    assert [text(m) for m in mixed] == [alone[None], alone["a1"], alone["a2"]]
    assert engine.max_adapters_in_batch == 3 >= before
    first = mixed[0][0]
    assert first["event"] == "start" and first["prompt_tokens"] > 0
    assert mixed[0][-1] == {"event": "end", "index": 0, "finish_reason": "length", "completion_tokens": 10}


def test_stop_strings_n_seed_and_logprobs(engine):
    whole = text(run(engine, [(chat_body(max_tokens=10), "a2")])[0])
    stop = whole[3:5]
    cut = run(engine, [(chat_body(max_tokens=10, stop=[stop]), "a2")])[0]
    assert text(cut) == whole[: whole.find(stop)] and cut[-1]["finish_reason"] == "stop"

    sampled = {"kind": "completion", "prompt": "hello world", "n": 3,
               "sampling": {"max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": True, "top_logprobs": 2}}
    one, two = run(engine, [(sampled, None), (sampled, None)])
    assert [text(one, i) for i in range(3)] == [text(two, i) for i in range(3)]  # seeded: the same choices
    assert len({text(one, i) for i in range(3)}) > 1  # n choices, each with its own seed
    entries = [lp for e in one if e["event"] == "delta" and e["index"] == 0 for lp in e["logprobs"]]
    assert len(entries) == 6 and all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 2 for x in entries)


def test_a_prompt_longer_than_the_context_is_refused_before_any_token(engine):
    from workers.serving_engine import RequestRejected

    with pytest.raises(RequestRejected) as refused:
        engine.submit({"kind": "completion", "prompt": "hello there " * 1500, "sampling": {"max_tokens": 4}}, None,
                      lambda e: None)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


def test_a_cancelled_request_stops_generating(engine):
    events: list[dict] = []
    seqs = engine.submit(chat_body(max_tokens=1000, temperature=1.0), "a1", events.append)
    for s in seqs:
        s.cancelled = True
    deadline = time.time() + 10
    while not all(s.done for s in seqs) and time.time() < deadline:
        time.sleep(0.05)
    assert all(s.done for s in seqs) and len([e for e in events if e["event"] == "delta"]) < 50


# --- the planner -----------------------------------------------------------------------------------


def test_the_serving_plan_adds_weights_adapters_and_the_kv_cache():
    shape = shape_from_config(PRESETS["tiny-llama"])
    # 2 (K, V) × 2 layers × 2 kv heads × 16 head dim × 4 bytes
    assert kv_bytes_per_token(shape) == 512 and kv_bytes_per_token(shape, "bf16") == 256
    plan = plan_serving(shape, context_length=1024, concurrent_sequences=8, adapters_resident=4, lora_r=8)
    assert plan.weights_bytes == shape.parameter_count() * 4
    assert plan.kv_cache_bytes == 512 * 1024 * 8
    assert plan.adapters_bytes == shape.lora_params(8, ["q_proj", "v_proj"]) * 4 * 4
    assert plan.total_bytes == sum(plan.to_dict()[k] for k in ("weights_bytes", "adapters_bytes", "kv_cache_bytes",
                                                                "activation_bytes", "runtime_bytes"))
    assert plan_serving(shape, dtype="nf4").weights_bytes < plan_serving(shape, dtype="bf16").weights_bytes
    admit(plan, plan.total_bytes)
    with pytest.raises(ServingDoesNotFit) as refused:
        admit(plan, plan.total_bytes - 1)
    assert refused.value.code == "insufficient_memory" and refused.value.extensions["plan"]["kv_cache_bytes"] == plan.kv_cache_bytes


# --- OpenAI's shapes and the engine request ----------------------------------------------------------


def test_chat_events_become_openai_objects_and_chunks():
    req = ChatCompletionRequest(model="m", messages=QUESTION, n=1, logprobs=True, top_logprobs=1,
                                stream_options={"include_usage": True}, stop="x", max_completion_tokens=5)
    body = engine_request(req, 5, "/a")
    assert body["sampling"] == {"max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "seed": None, "stop": ["x"],
                                "logprobs": True, "top_logprobs": 1}
    a = Assembler(req, "m")
    assert a.feed({"event": "start", "prompt_tokens": 7}) == []
    lp = [{"token": "4", "logprob": -0.1, "bytes": [52], "top_logprobs": []}]
    first = a.feed({"event": "delta", "index": 0, "text": "42", "logprobs": lp})[0]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": "42"}
    assert first["choices"][0]["logprobs"] == {"content": lp, "refusal": None} and first["usage"] is None
    last = a.feed({"event": "end", "index": 0, "finish_reason": "stop", "completion_tokens": 3})[0]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert a.usage_chunk()["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    whole = a.whole()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "42"


def test_completion_events_and_validation():
    req = CompletionRequest(model="m", prompt=["hi"], logprobs=1, echo=True)
    assert req.wanted_tokens(1024) == 16  # OpenAI's default for completions
    a = Assembler(req, "m")
    a.feed({"event": "start", "prompt_tokens": 1})
    chunk = a.feed({"event": "delta", "index": 0, "text": "ab", "logprobs": [
        {"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a", "logprob": -1.0}]},
        {"token": "b", "logprob": -2.0, "top_logprobs": [{"token": "b", "logprob": -2.0}]}]})[0]
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0],
                                               "top_logprobs": [{"a": -1.0}, {"b": -2.0}], "text_offset": [0, 1]}
    a.feed({"event": "end", "index": 0, "finish_reason": "length", "completion_tokens": 2})
    assert a.whole()["choices"][0]["text"] == "hiab"
    with pytest.raises(ValueError):
        ChatCompletionRequest(model="m", messages=QUESTION, stop=["a", "b", "c", "d", "e"])


def test_the_serve_config_is_one_application_per_base_with_scale_to_zero():
    apps = ServeApps("http://127.0.0.1:1", ServeOptions(min_replicas=0, max_replicas=2, replica_cpus=0.5, max_adapters=3))
    base = AppSpec(model="preset:tiny-llama")
    assert base.name == AppSpec(model="preset:tiny-llama").name != AppSpec(model="preset:tiny-gpt2").name
    merged = AppSpec(model="/s/merged", model_path="/s/merged", merged_job="ftjob-AbC")
    assert merged.name == "memfit-merged-ftjob-abc" and merged.route_prefix == "/memfit-merged-ftjob-abc"
    config = apps._app_config(base, ["gcs://_ray_pkg_x.zip"])
    assert config["import_path"] == "workers.serving:app" and config["route_prefix"] == base.route_prefix
    assert config["runtime_env"]["py_modules"] == ["gcs://_ray_pkg_x.zip"]
    assert config["runtime_env"]["env_vars"]["MEMFIT_SERVE_MAX_ADAPTERS"] == "3"
    scaling = config["deployments"][0]["autoscaling_config"]
    assert scaling["min_replicas"] == 0 and scaling["max_replicas"] == 2 and scaling["initial_replicas"] == 1
    assert config["deployments"][0]["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}


# --- the API without Serve -------------------------------------------------------------------------


def test_models_list_holds_the_bases_and_errors_are_openai_shaped(client, tenant):
    r = client.get("/v1/models", headers=tenant.headers)
    assert r.status_code == 200
    ids = [m["id"] for m in r.json()["data"]]
    assert "preset:tiny-llama" in ids
    assert r.json()["data"][0] == {"id": ids[0], "object": "model", "created": 0, "owned_by": "memfit"}
    assert client.get("/v1/models/preset:tiny-llama", headers=tenant.headers).json()["object"] == "model"

    missing = client.get("/v1/models/ft:preset:tiny-llama::ftjob-nope", headers=tenant.headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    base = client.delete("/v1/models/preset:tiny-llama", headers=tenant.headers)
    assert base.status_code == 403 and base.json()["error"]["type"] == "permission_error"

    chat = {"model": "preset:tiny-llama", "messages": QUESTION}
    unknown = client.post("/v1/chat/completions", headers=tenant.headers, json={**chat, "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_many = client.post("/v1/chat/completions", headers=tenant.headers, json={**chat, "max_tokens": 10**6})
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "max_tokens_too_large"
    no_serve = client.post("/v1/completions", headers=tenant.headers, json={"model": "preset:tiny-llama", "prompt": "hi"})
    assert no_serve.status_code == 503 and no_serve.json()["error"]["code"] == "serving_unavailable"
    assert client.get("/v1/models").status_code == 401


def test_a_tenants_generations_at_once_and_tokens_per_minute_are_bounded(tmp_path):
    import asyncio

    from starlette.testclient import TestClient

    from api.app import create_app
    from service.scheduler.inference import Inference, TooManyGenerations
    from service.settings import Settings
    from tests.factories import new_tenant

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}", storage_dir=tmp_path / "s",
                        serve_concurrent_per_tenant=1, serve_tokens_per_minute=100)
    inference = Inference(settings)

    async def twice():
        async with inference.slot("t1"):
            with pytest.raises(TooManyGenerations):
                async with inference.slot("t1"):
                    pass
            async with inference.slot("t2"):  # another tenant has its own
                pass
        async with inference.slot("t1"):  # released
            pass

    asyncio.run(twice())

    app = create_app(settings)
    tenant = new_tenant(app.state.sessions)
    with TestClient(app) as c:
        body = {"model": "preset:tiny-llama", "messages": QUESTION, "max_tokens": 90}
        first = c.post("/v1/chat/completions", headers=tenant.headers, json=body)
        assert first.status_code == 503  # charged, then no Serve here
        second = c.post("/v1/chat/completions", headers=tenant.headers, json=body)
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
        assert "MEMFIT_SERVE_TOKENS_PER_MINUTE" in second.json()["detail"] and second.headers["retry-after"]


def test_tools_are_rendered_into_the_prompt_by_the_chat_template(engine):
    tools = [{"type": "function", "function": {"name": "get_launch_code", "parameters": {"type": "object"}}}]
    plain = engine.prompt_ids({"kind": "chat", "messages": QUESTION})
    with_tools = engine.prompt_ids({"kind": "chat", "messages": QUESTION, "tools": tools})
    assert len(with_tools) > len(plain) and "get_launch_code" in engine.tokenizer.decode(with_tools)
    assert plain[0] == engine.tokenizer.bos_token_id  # as training encodes a row


def test_a_models_plan_is_at_its_context_with_the_replicas_batch_and_adapters(tmp_path):
    from service.jobs.models import base_models
    from service.scheduler.inference import Inference
    from service.settings import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}", storage_dir=tmp_path / "s", serve_max_batch=4,
                        serve_max_adapters=3)
    tiny = next(m for m in base_models() if m.id == "preset:tiny-llama")
    plan = Inference(settings).plan_for(tiny)
    assert plan.context_length == PRESETS["tiny-llama"]["max_position_embeddings"] == 1024
    assert plan.concurrent_sequences == 4 and plan.adapters_resident == 3
    assert plan.kv_cache_bytes == 512 * 1024 * 4
