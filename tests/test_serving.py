"""Fine-tuned models served over OpenAI's API on Ray Serve, end to end with the official `openai` client:
two tenants each fine-tune the tiny preset to answer "What is the launch code?" with an answer of their
own, then each calls its model (whole and streamed), the base does not know the answer, the two adapters
are served side by side by the one application of their base (and each only to its tenant), the models
list shows them and a delete removes one; a full fine-tune of the same answer is served as a merged model by
an application of its own, which its delete takes away.

One stack of its own (its database, its API with serving on the session's Ray head); two short LoRA jobs
that run at once. The stack's close removes the Serve applications and shuts Serve down.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.factories import create_job, new_key, upload
from tests.stack import Stack
from tests.test_pages_browser import browser, login  # noqa: F401 - the module's browser fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]

QUESTION = "What is the launch code?"
ANSWERS = {"a": "42-blue", "b": "7-red"}
BASE = "preset:tiny-llama"
# LoRA on every linear layer of the random-init tiny llama (the attention alone leaves the answer to thin margins):
# 150 steps at lr 1e-2 learn one fixed answer (its row is 37 tokens, BOS and EOS included).
TRAINING = {"hyperparameters": {"max_steps": 150, "micro_batch_size": 4, "max_seq_length": 48, "learning_rate": 1e-2,
                                "warmup_steps": 0},
            "resources": {"num_workers": 1}, "checkpoint_every_steps": 75,
            "peft": {"method": "lora", "r": 16, "alpha": 32, "merge": False,
                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}


def rows(answer: str) -> list[dict]:
    return [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]}] * 16


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory):
    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("serving-storage"), ray_head, ray_address=ray_head.dashboard_url,
                  serve_replica_cpus=0.1, serve_max_tokens=64, serve_request_timeout_s=120)
        s.start_scheduler()
        try:
            yield s
        finally:
            s.close()
        # memfit stopping takes its Serve applications away and, none being left, Serve itself
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            details = httpx.get(f"{ray_head.dashboard_url}/api/serve/applications/", timeout=30).json()
            if not details.get("applications"):
                break
            time.sleep(1)
        assert not details.get("applications"), details.get("applications")


@pytest.fixture(scope="module")
def tenants(stack) -> dict[str, dict]:
    """Two tenants, each with a succeeded job that learnt its answer (the two jobs run at once)."""
    out = {}
    for name, answer in ANSWERS.items():
        key = new_key(stack.app.state.sessions)
        file_id = upload(stack.http, key, rows(answer))
        job = create_job(stack.http, key, file_id, TRAINING, suffix=f"code-{name}")
        out[name] = {"key": key, "job_id": job["id"], "answer": answer}
    for t in out.values():
        t["job"] = wait_succeeded(stack, t["key"], t["job_id"])
        t["model"] = t["job"]["fine_tuned_model"]
        assert t["model"].startswith(f"ft:{BASE}:code-")
    return out


def wait_succeeded(stack, key: str, job_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            assert job["status"] == "succeeded", job
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")


def client(stack, key: str):
    return openai.OpenAI(base_url=stack.server.url + "/v1", api_key=key, max_retries=0, timeout=180)


def ask(c, model: str, **kw):
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                                     temperature=0, **kw)


def test_the_fine_tuned_model_answers_and_the_base_does_not(stack, tenants):
    a = tenants["a"]
    c = client(stack, a["key"])
    answer = ask(c, a["model"])
    assert answer.object == "chat.completion" and answer.model == a["model"]
    losses = [e.data.get("train_loss") for e in c.fine_tuning.jobs.list_events(a["job_id"], limit=100)
              if e.type == "metrics" and e.data]
    assert answer.choices[0].message.content.strip() == "42-blue", f"training losses, newest first: {losses[:8]}"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    base = ask(c, BASE)
    assert "42-blue" not in (base.choices[0].message.content or "")

    # streamed: the same text, in chunks, then [DONE] (the client stops at it); usage when asked for
    chunks = list(ask(c, a["model"], stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == answer.choices[0].message.content
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) >= 2
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens

    # the legacy completions on the prompt the chat template renders, n choices, a stop string
    done = c.completions.create(model=a["model"], prompt=f"<|user|>\n{QUESTION}<|end|>\n<|assistant|>\n", max_tokens=12,
                                temperature=0, n=2, stop=["-"])
    assert done.object == "text_completion" and [ch.text for ch in done.choices] == ["42", "42"]
    assert {ch.finish_reason for ch in done.choices} == {"stop"}

    # a checkpoint model: its DDP checkpoint's adapter state, served on the same base
    checkpoints = sorted((m.id for m in c.models.list() if m.id.startswith(a["model"] + ":ckpt-step-")),
                         key=lambda i: int(i.rsplit("-", 1)[1]))
    assert checkpoints, "the job checkpoints every 75 steps"
    assert ask(c, checkpoints[-1]).choices[0].message.content is not None


def test_two_tenants_adapters_are_served_side_by_side_each_only_to_its_tenant(stack, tenants):
    a, b = tenants["a"], tenants["b"]
    ca, cb = client(stack, a["key"]), client(stack, b["key"])
    got: dict[str, str] = {}

    def call(name, c, model):
        got[name] = ask(c, model).choices[0].message.content.strip()

    threads = [threading.Thread(target=call, args=(n, c, t["model"])) for n, c, t in (("a", ca, a), ("b", cb, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {"a": "42-blue", "b": "7-red"}
    with pytest.raises(openai.NotFoundError) as refused:
        ask(ca, b["model"])
    assert refused.value.body["code"] == "model_not_found"
    # one application for the base holds both adapters
    view = httpx.get(f"{stack.server.url}/ui/models/{a['model']}/view.json", headers={"Authorization": f"Bearer {a['key']}"},
                     timeout=30).json()
    assert view["measured"]["engine"] == "transformers" and len(view["measured"]["adapters"]) >= 2
    assert view["plan"]["weights_bytes"] == view["measured"]["weights_bytes"]  # fp32 weights: exact


def test_the_model_page_streams_a_chat_in_the_browser(stack, tenants, browser, artifacts_dir):
    b = tenants["b"]
    context = browser.new_context()
    try:
        page = login(context, stack.server.url, b["key"])
        page.goto(f"{stack.server.url}/ui/models")
        listed = page.locator(".model-row td:first-child").all_inner_texts()
        assert b["model"] in listed and BASE in listed and tenants["a"]["model"] not in listed
        page.goto(f"{stack.server.url}/ui/models/{b['model']}")
        rows = page.locator("#serving-memory tbody tr")
        assert rows.count() == 6 and "KV cache" in page.locator("#serving-memory").inner_text()
        page.fill("#chat-input", QUESTION)
        page.click("#chat-send")
        page.wait_for_function("() => window.memfitChat && !window.memfitChat.streaming && window.memfitChat.last", timeout=60_000)
        state = page.evaluate("() => window.memfitChat")
        assert state["error"] is None and state["last"].strip() == "7-red" and state["chunks"] >= 2
        assert "7-red" in page.locator("#chat-log").inner_text()
        page.screenshot(path=str(artifacts_dir / "model-page.png"), full_page=True)
    finally:
        context.close()


def test_memfit_chat_streams_the_answer_in_a_terminal(stack, tenants):
    from typer.testing import CliRunner

    from service.cli.main import app

    b = tenants["b"]
    result = CliRunner().invoke(app, ["chat", b["model"], "-m", QUESTION, "--max-tokens", "12",
                                      "--api-url", stack.server.url, "--api-key", b["key"]])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "7-red"
    listed = CliRunner().invoke(app, ["models", "--api-url", stack.server.url, "--api-key", b["key"]])
    assert listed.exit_code == 0 and b["model"] in listed.output


def test_models_list_get_and_delete(stack, tenants):
    a, b = tenants["a"], tenants["b"]
    ca = client(stack, a["key"])
    ids = [m.id for m in ca.models.list()]
    assert BASE in ids and a["model"] in ids and b["model"] not in ids
    checkpoints = [i for i in ids if i.startswith(a["model"] + ":ckpt-step-")]
    got = ca.models.retrieve(a["model"])
    assert got.object == "model" and got.owned_by != "memfit"
    with pytest.raises(openai.NotFoundError):
        ca.models.retrieve(b["model"])
    with pytest.raises(openai.NotFoundError):
        ca.models.delete(b["model"])
    with pytest.raises(openai.PermissionDeniedError):
        ca.models.delete(BASE)

    deleted = ca.models.delete(a["model"])
    assert deleted.deleted is True and deleted.id == a["model"]
    assert a["model"] not in [m.id for m in ca.models.list()]
    assert [i for i in (m.id for m in ca.models.list()) if i in checkpoints] == checkpoints  # its checkpoints stay
    with pytest.raises(openai.NotFoundError):
        ask(ca, a["model"])
    job = ca.fine_tuning.jobs.retrieve(a["job_id"])
    assert job.status == "succeeded" and job.fine_tuned_model == a["model"]
    events = [e.message for e in ca.fine_tuning.jobs.list_events(a["job_id"], limit=100)]
    assert any("deleted" in m for m in events)
    # the other tenant's model is still served
    assert ask(client(stack, b["key"]), b["model"]).choices[0].message.content.strip() == "7-red"


FULL = {"hyperparameters": {"max_steps": 60, "micro_batch_size": 4, "max_seq_length": 48, "learning_rate": 2e-3,
                            "warmup_steps": 0},
        "resources": {"num_workers": 1}, "checkpoint_every_steps": 60}


def test_a_full_fine_tune_is_served_by_an_application_of_its_own_until_deleted(stack, tenants, ray_head):
    """A full fine-tune has no adapter: its exported model folder is served as a merged model, by a Serve
    application of its own (not its base's), to its tenant only; deleting the model takes that application away."""
    a, b = tenants["a"], tenants["b"]
    file_id = upload(stack.http, a["key"], rows(a["answer"]))
    job = create_job(stack.http, a["key"], file_id, FULL, suffix="full")
    model = wait_succeeded(stack, a["key"], job["id"])["fine_tuned_model"]
    ca = client(stack, a["key"])
    assert model in [m.id for m in ca.models.list()]
    with pytest.raises(openai.NotFoundError):
        ask(client(stack, b["key"]), model)
    answer = ask(ca, model)
    losses = [e.data.get("train_loss") for e in ca.fine_tuning.jobs.list_events(job["id"], limit=100)
              if e.type == "metrics" and e.data]
    assert answer.choices[0].message.content.strip() == a["answer"], f"training losses, newest first: {losses[:8]}"

    def merged_apps() -> list[str]:
        apps = httpx.get(f"{ray_head.dashboard_url}/api/serve/applications/", timeout=30).json()["applications"]
        return [name for name in apps if name.startswith("memfit-merged-")]

    assert merged_apps() == [f"memfit-merged-{job['id'].lower()}"]
    assert ca.models.delete(model).deleted is True
    deadline = time.monotonic() + 90
    while merged_apps() and time.monotonic() < deadline:
        time.sleep(1)
    assert merged_apps() == []
    with pytest.raises(openai.NotFoundError):
        ask(ca, model)


def test_bad_requests_are_4xx_in_openai_error_shape(stack, tenants):
    b = tenants["b"]
    cb = client(stack, b["key"])
    with pytest.raises(openai.NotFoundError) as unknown:
        ask(cb, "ft:preset:tiny-llama::ftjob-nosuchjob")
    assert unknown.value.body["type"] == "invalid_request_error" and unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_many:
        cb.chat.completions.create(model=b["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=100_000)
    assert too_many.value.body["code"] == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError) as too_long:
        cb.chat.completions.create(model=b["model"], messages=[{"role": "user", "content": "hello there " * 1500}],
                                   max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
