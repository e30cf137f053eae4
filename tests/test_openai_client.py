"""The official openai client against a real uvicorn server on Postgres (base_url=http://…/v1)."""

from __future__ import annotations

import io
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone

import openai
import pytest
import uvicorn

from service.scheduler.local_head import free_port
from tests.factories import CHAT_JSONL


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
    from service.store import auth
    from service.store.db import session_scope

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


# --- OpenAI's own hyperparameters, and every field the SDK's types declare ----------------------


def stored(server, job_id: str):
    """The job row as the scheduler and workers read it."""
    from service.store.db import session_scope
    from service.store.models import Job

    app, _ = server
    with session_scope(app.state.sessions) as s:
        job = s.get(Job, job_id)
        s.expunge(job)
        return job


def upload(oai) -> str:
    return oai.files.create(file=("train.jsonl", io.BytesIO(CHAT_JSONL.encode())), purpose="fine-tune").id


@pytest.mark.parametrize(
    "batch_size, workers, micro, accumulation",
    [(1, 1, 1, 1), (2, 1, 2, 1), (3, 1, 3, 1), (64, 1, 4, 16), (2, 2, 1, 1), (64, 2, 4, 8)],
)
def test_openai_batch_size_alone_is_split_and_used_by_planner_and_workers(oai, server, batch_size, workers, micro,
                                                                         accumulation):
    from service.domain.spec import JobSpec, RunRequest
    from workers.args import train_args

    extra = {"extra_body": {"training": {"resources": {"num_workers": workers}}}} if workers > 1 else {}
    job = oai.fine_tuning.jobs.create(
        model="preset:tiny-llama", training_file=upload(oai),
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "batch_size": batch_size, "learning_rate_multiplier": 0.5}}},
        **extra,
    )
    assert job.hyperparameters.batch_size == batch_size and job.hyperparameters.learning_rate_multiplier == 0.5
    assert job.hyperparameters.n_epochs == 25  # 'auto' for 2 examples: OpenAI's rule
    assert job.method.supervised.hyperparameters.model_dump() == job.hyperparameters.model_dump()
    hp = job.model_extra["training"]["hyperparameters"]
    assert (hp["micro_batch_size"], hp["gradient_accumulation_steps"]) == (micro, accumulation)
    # The derivation is an event with its numbers.
    derived = {e.data["derived"]: e for e in oai.fine_tuning.jobs.list_events(job.id, limit=100).data
               if isinstance(e.data, dict) and "derived" in e.data}
    worker_word = "worker" if workers == 1 else "workers"
    assert derived["batch_size"].message == (f"batch_size {batch_size} → micro_batch_size {micro} × "
                                             f"gradient_accumulation_steps {accumulation} × {workers} {worker_word}")
    assert derived["batch_size"].data["micro_batch_size"] == micro and derived["batch_size"].level == "info"
    assert derived["learning_rate"].data["learning_rate"] == 1e-4
    # The stored spec states the split; the planner planned it and the workers get it.
    row = stored(server, job.id)
    spec = JobSpec.model_validate(row.spec)
    assert spec.training.hyperparameters.micro_batch_size == micro
    assert spec.training.hyperparameters.gradient_accumulation_steps == accumulation
    assert spec.method.supervised.hyperparameters.model_dump() == {
        "n_epochs": 25, "batch_size": batch_size, "learning_rate_multiplier": 0.5}
    assert f"micro-batch {micro}, {accumulation} accumulation step(s)" in row.plan["assumptions"][0]
    args = train_args(RunRequest(job_id=job.id, spec=spec, training_path="t.jsonl", output_dir="out"))
    assert (args.micro_batch_size, args.accumulation, args.n_epochs, args.learning_rate) == (micro, accumulation, 25, 1e-4)


@pytest.mark.parametrize(
    "kwargs, param, code, names",
    [
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 6}}},
          "extra_body": {"training": {"hyperparameters": {"micro_batch_size": 4}}}},
         "method.supervised.hyperparameters.batch_size", "invalid_value", "training.hyperparameters.micro_batch_size 4"),
        ({"hyperparameters": {"batch_size": 6}, "extra_body": {"training": {"hyperparameters": {"micro_batch_size": 4}}}},
         "hyperparameters.batch_size", "invalid_value", "training.hyperparameters.micro_batch_size 4"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 3}}},
          "extra_body": {"training": {"resources": {"num_workers": 2}}}},
         "method.supervised.hyperparameters.batch_size", "invalid_value", "training.resources.num_workers = 2"),
        ({"method": {"type": "reinforcement"}}, "method.reinforcement", "invalid_value",
         "needs method.reinforcement with its grader"),
    ],
    ids=["batch-vs-micro", "deprecated-batch-vs-micro", "batch-vs-workers", "reinforcement-without-grader"],
)
def test_only_combinations_the_caller_asked_for_are_refused(oai, kwargs, param, code, names):
    """Refused with the field the caller set in the message, so they know which of their values to change."""
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=upload(oai), **kwargs)
    assert exc.value.status_code == 422 and exc.value.param == param and exc.value.code == code
    [problem] = exc.value.response.json()["errors"]
    assert (problem["param"], problem["code"]) == (param, code) and problem["message"] in exc.value.message
    assert names in problem["message"]


def assert_conforms(model, value, where: str, *, status_outside_sdk: str | None = None) -> None:
    """``value`` (the JSON the API answered) validates as the SDK's ``model`` — types and literals, not
    just "parses", since the SDK's own parsing is lenient — and conforms to OpenAI's published schema of
    the same name (tests/openai_schema.py: every member it requires present, every member typed, absent
    rather than null where it allows no null)."""
    from tests import openai_schema

    checked = dict(value)
    if status_outside_sdk is not None:  # memfit's 'paused', which the SDK's Literal lacks
        assert checked["status"] == status_outside_sdk
        checked["status"] = "queued"
    model.model_validate(checked)
    found = openai_schema.problems(model.__name__, value)
    assert not found, f"{where}: " + "; ".join(found)


def assert_page_conforms(item_model, page, where: str, **kw) -> list[dict]:
    from openai.pagination import SyncCursorPage

    assert page["object"] == "list"
    for key in SyncCursorPage.model_fields:
        assert key in page, f"{where}: {key} missing"
    assert isinstance(page["has_more"], bool)
    for i, item in enumerate(page["data"]):
        assert_conforms(item_model, item, f"{where}.data[{i}]", **kw)
    return page["data"]


def test_every_field_of_the_sdks_types_is_accepted_and_answered(oai, server):
    from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
    from openai.types.fine_tuning.job_create_params import JobCreateParams
    from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

    from service.domain.states import JobStatus
    from service.jobs import crud as jobs
    from service.store.db import session_scope
    from service.store.transitions import transition

    app, _ = server
    train, valid = upload(oai), upload(oai)
    wandb = {"project": "p", "entity": "team", "name": "run-1", "tags": ["memfit"]}
    body = dict(
        model="preset:tiny-llama", training_file=train, validation_file=valid, suffix="every-field", seed=11,
        metadata={"k": "v"}, integrations=[{"type": "wandb", "wandb": wandb}],
        hyperparameters={"batch_size": 2, "learning_rate_multiplier": 2.0, "n_epochs": 3},  # deprecated, still taken
        method={"type": "supervised"},
    )
    assert set(body) == set(JobCreateParams.__optional_keys__ | JobCreateParams.__required_keys__)
    raw = oai.fine_tuning.jobs.with_raw_response.create(**body)
    created = raw.http_response.json()
    assert_conforms(FineTuningJob, created, "create")
    job_id = created["id"]
    # The deprecated hyperparameters come back resolved, at the top and under method, as OpenAI answers.
    assert created["hyperparameters"] == {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 2.0}
    assert created["method"]["type"] == "supervised"
    assert created["method"]["supervised"]["hyperparameters"] == created["hyperparameters"]
    assert created["integrations"] == [{"type": "wandb", "wandb": wandb}]
    assert (created["seed"], created["suffix"], created["metadata"], created["validation_file"]) == (
        11, "every-field", {"k": "v"}, valid)
    assert created["organization_id"] and created["result_files"] == [] and created["trained_tokens"] is None
    parsed = raw.parse()
    assert parsed.integrations[0].wandb.project == "p" and parsed.hyperparameters.batch_size == 2

    # A running job with an estimate, a failed one with its error, a paused and resumed one.
    with session_scope(app.state.sessions) as s:
        transition(s, job_id, JobStatus.queued)
        transition(s, job_id, JobStatus.running, attempt=1)
        jobs.update_job(s, job_id, estimated_finish=datetime.now(timezone.utc) + timedelta(minutes=5),
                        trained_tokens=1234)
        jobs.add_checkpoint(s, job_id, attempt=1, step=2, path="/ckpt/2", metrics={"loss": 1.25, "eval_loss": 1.5})
    running = oai.fine_tuning.jobs.with_raw_response.retrieve(job_id).http_response.json()
    assert_conforms(FineTuningJob, running, "retrieve running")
    assert running["status"] == "running" and running["trained_tokens"] == 1234
    assert running["estimated_finish"] > running["created_at"]

    [ckpt] = assert_page_conforms(
        FineTuningJobCheckpoint, oai.fine_tuning.jobs.checkpoints.with_raw_response.list(job_id).http_response.json(),
        "checkpoints")
    assert ckpt["metrics"]["train_loss"] == 1.25 and ckpt["metrics"]["valid_loss"] == 1.5
    assert ckpt["step_number"] == 2 and ckpt["metrics"]["step"] == 2

    with session_scope(app.state.sessions) as s:
        transition(s, job_id, JobStatus.failed, error={"code": "out_of_memory", "message": "boom", "param": None})
    failed = oai.fine_tuning.jobs.with_raw_response.retrieve(job_id).http_response.json()
    assert_conforms(FineTuningJob, failed, "retrieve failed")
    assert failed["error"]["code"] == "out_of_memory" and failed["finished_at"] is not None

    events = assert_page_conforms(
        FineTuningJobEvent, oai.fine_tuning.jobs.with_raw_response.list_events(job_id, limit=100).http_response.json(),
        "events")
    # the W&B integration runs with the job (workers/integrations.py): nothing to warn about at creation
    assert [e for e in events if e["level"] == "warn"] == []

    other = oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=train).id
    with session_scope(app.state.sessions) as s:
        transition(s, other, JobStatus.queued)
    paused = oai.fine_tuning.jobs.with_raw_response.pause(other).http_response.json()
    assert_conforms(FineTuningJob, paused, "pause", status_outside_sdk="paused")
    assert_conforms(FineTuningJob, oai.fine_tuning.jobs.with_raw_response.resume(other).http_response.json(), "resume")
    cancelled = oai.fine_tuning.jobs.with_raw_response.cancel(other).http_response.json()
    assert_conforms(FineTuningJob, cancelled, "cancel")
    assert cancelled["integrations"] is None and cancelled["method"]["supervised"]["hyperparameters"]["batch_size"] == 4

    listed = assert_page_conforms(
        FineTuningJob, oai.fine_tuning.jobs.with_raw_response.list(limit=2).http_response.json(), "list")
    assert [j["id"] for j in listed] == [other, job_id]


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory):
    """API + scheduler + the session's Ray head (tests/test_e2e.py's Stack) for a real run."""
    from tests.stack import Stack

    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("oai-run-storage"), ray_head)
        s.start_scheduler()
        yield s
        s.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_given_only_openais_hyperparameters_trains_with_the_derived_split(stack):
    """Two workers are memfit's one knob here (extra_body); the batch, rate and epochs are OpenAI's.
    batch_size 18 over 2 workers: 9 each, which the default micro-batch of 4 does not divide."""
    client = openai.OpenAI(api_key=stack.key, base_url=f"http://127.0.0.1:{stack.port}/v1", max_retries=0, timeout=30)
    created = client.fine_tuning.jobs.create(
        model="preset:tiny-llama", training_file=stack.train_file, suffix="oai-run",
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "batch_size": 18, "n_epochs": 1, "learning_rate_multiplier": 0.5}}},
        extra_body={"training": {"resources": {"num_workers": 2}}},
    )
    job = stack.wait(created.id, ("succeeded",))
    hp = job["training"]["hyperparameters"]
    assert (hp["micro_batch_size"], hp["gradient_accumulation_steps"]) == (3, 3)
    events = stack.events(created.id)
    assert "batch_size 18 → micro_batch_size 3 × gradient_accumulation_steps 3 × 2 workers" in [
        e["message"] for e in events]
    # The workers ran that split: ⌈64 examples / 18 per step⌉ = 4 steps, at the multiplied rate.
    metrics = [e["data"] for e in events if e["type"] == "metrics" and e["data"]["rank"] == 0]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and {m["total_steps"] for m in metrics} == {4}
    assert metrics[0]["learning_rate"] == pytest.approx(1e-4)
    assert job["hyperparameters"] == {"n_epochs": 1, "batch_size": 18, "learning_rate_multiplier": 0.5}
    # A finished job, its events (metrics ones included) and checkpoints answer every field of the SDK's types.
    from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
    from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

    assert_conforms(FineTuningJob, job, "succeeded")
    assert job["result_files"] and job["trained_tokens"] > 0
    assert job["fine_tuned_model"] == f"ft:preset:tiny-llama:oai-run:{created.id}"  # OpenAI's form, the suffix in it
    raw = client.fine_tuning.jobs.with_raw_response
    assert_page_conforms(FineTuningJobEvent, raw.list_events(created.id, limit=100).http_response.json(), "events")
    ckpts = assert_page_conforms(FineTuningJobCheckpoint,
                                 raw.checkpoints.list(created.id).http_response.json(), "checkpoints")
    assert [c["step_number"] for c in ckpts] == [4] and ckpts[0]["metrics"]["train_loss"] > 0  # the final one
