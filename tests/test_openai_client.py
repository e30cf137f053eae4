"""The official openai client against a real uvicorn server on Postgres (base_url=http://…/v1)."""

from __future__ import annotations

import io
import secrets
import threading
import time

import openai
import pytest
import uvicorn

from service.raycluster import free_port
from tests.conftest import CHAT_JSONL


@pytest.fixture(scope="module")
def server(pg_migrated, tmp_path_factory):
    from api.app import create_app
    from service.settings import Settings

    settings = Settings(database_url=pg_migrated, storage_dir=tmp_path_factory.mktemp("oai") / "storage")
    app = create_app(settings)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield app, f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def oai(server):
    from service import auth
    from service.db import session_scope

    app, base_url = server
    with session_scope(app.state.sessions) as s:
        issued = auth.create_key(s, f"oai-{secrets.token_hex(4)}")
    return openai.OpenAI(api_key=issued.key, base_url=base_url, max_retries=0, timeout=20)


def test_upload_create_list_retrieve_cancel(oai):
    f = oai.files.create(file=("train.jsonl", io.BytesIO(CHAT_JSONL.encode())), purpose="fine-tune")
    assert f.id.startswith("file-") and f.bytes == len(CHAT_JSONL) and f.purpose == "fine-tune"
    job = oai.fine_tuning.jobs.create(
        model="preset:tiny-llama",
        training_file=f.id,
        suffix="oai",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
        metadata={"run": "client-test"},
        extra_body={"training": {"peft": {"method": "lora", "r": 4}, "hyperparameters": {"max_steps": 5}}},
    )
    assert job.id.startswith("ftjob-") and job.status == "validating_files"
    assert job.hyperparameters.n_epochs == 2 and job.training_file == f.id
    assert job.model_extra["training"]["peft"]["r"] == 4  # memfit's extension rides along
    second = oai.fine_tuning.jobs.create(model="preset:tiny-gpt2", training_file=f.id)
    listed = [j.id for j in oai.fine_tuning.jobs.list(limit=1)]  # auto-paginates with `after`
    assert listed == [second.id, job.id]
    filtered = oai.fine_tuning.jobs.list(metadata={"run": "client-test"})
    assert [j.id for j in filtered.data] == [job.id]
    got = oai.fine_tuning.jobs.retrieve(job.id)
    assert got.id == job.id and got.metadata == {"run": "client-test"}
    cancelled = oai.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    events = oai.fine_tuning.jobs.list_events(job.id)
    assert [e.message for e in events.data][:1] == ["Job cancelled"]
    assert oai.fine_tuning.jobs.checkpoints.list(job.id).data == []


def test_client_exception_classes(oai, server):
    _, base_url = server
    f = oai.files.create(file=("t.jsonl", io.BytesIO(CHAT_JSONL.encode())), purpose="fine-tune")
    with pytest.raises(openai.AuthenticationError) as exc:
        openai.OpenAI(api_key="mf_live_notakeyatall", base_url=base_url, max_retries=0).fine_tuning.jobs.list()
    assert exc.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as exc:
        oai.fine_tuning.jobs.retrieve("ftjob-missing")
    assert exc.value.code == "job_not_found"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=f.id, extra_body={"training": {"bogus": 1}})
    assert exc.value.code == "unknown_field" and exc.value.param == "training.bogus"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.files.create(file=("bad.jsonl", io.BytesIO(b'{"text": 1}\n')), purpose="fine-tune")
    assert exc.value.param == "file" and "line 1" in exc.value.message
    job = oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=f.id)
    oai.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.ConflictError) as exc:
        oai.fine_tuning.jobs.cancel(job.id)
    assert exc.value.code == "invalid_transition"
