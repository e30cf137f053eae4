"""memfit's answers against OpenAI's published OpenAPI description (tests/data/openai_openapi_subset.json,
vendored at the commit it names; tests/openai_schema.py validates with jsonschema), and the official
client in strict mode (``_strict_response_validation=True``: every answer parsed against the SDK's types,
as a client generated from the schema would) through the whole flow.

Every files and fine-tuning operation is called and each answer validated: upload, list (with items and
empty), retrieve and delete a file, a file's content; create (with every OpenAI knob), list (and by
metadata), retrieve, cancel, pause, resume a job, its events and checkpoints, a job running, succeeded,
failed, paused; and the errors (OpenAI's ``error`` object). The two places where OpenAI's schema
contradicts OpenAI's API are named in tests/openai_schema.py (KNOWN_DEPARTURES) and allowed there only.
A finished job's answers — and its result file, OpenAI's per-step metrics CSV — are checked on the
session's one finished job (tests/conftest.py ``finished_job``)."""

from __future__ import annotations

import csv
import io
import json
import time

import openai
import pytest

from tests import openai_schema
from tests.factories import CHAT_JSONL, bearer, new_key
from tests.scheduler_support import app_without_ray

WANDB = {"type": "wandb", "wandb": {"project": "memfit-tests"}}  # no name, entity nor tags: left out, never null


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("oa-schema")) as stack:
        yield stack


def conforms(operation: str, response, status: int = 200) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    openai_schema.assert_conforms(operation, body)
    return body


def upload(client, key: str, content: str = CHAT_JSONL, name: str = "train.jsonl"):
    return client.post("/v1/files", headers=bearer(key), files={"file": (name, content)}, data={"purpose": "fine-tune"})


def ingest(client, job_id: str, token: str, records: list[dict]) -> None:
    r = client.post(f"/v1/internal/jobs/{job_id}/ingest", headers=bearer(token), json={"records": records})
    assert r.status_code == 200, r.text


def claim(sched, job_id: str) -> str:
    sched.validate_pending()
    return {jid: token for jid, _, token in sched.claim(limit=100)}[job_id]


def metrics(step: int, **extra) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": 0, "step": step, "total_steps": 4,
            "loss": 2.0 / step, "mean_token_accuracy": 0.2 * step, **extra}


def test_every_files_and_fine_tuning_operation_answers_openais_schema(env):
    app, client, sched = env
    key = new_key(app.state.sessions)
    auth = bearer(key)
    J = "/fine_tuning/jobs/{fine_tuning_job_id}"

    # Files: upload, list (with items, and a page with none), retrieve.
    train = conforms("POST /files", upload(client, key))
    assert "status_details" not in train and train["status"] == "processed"  # OpenAI: a string, or left out
    valid = conforms("POST /files", upload(client, key, name="valid.jsonl"))
    listed = conforms("GET /files", client.get("/v1/files", headers=auth))
    assert [f["id"] for f in listed["data"]] == [valid["id"], train["id"]]
    empty = conforms("GET /files", client.get("/v1/files", params={"purpose": "fine-tune-results"}, headers=auth))
    assert empty["data"] == [] and empty["first_id"] is None  # the one departure, named in KNOWN_DEPARTURES
    conforms("GET /files/{file_id}", client.get(f"/v1/files/{train['id']}", headers=auth))

    # Create with every OpenAI knob; list, by metadata too; retrieve.
    body = {"model": "preset:tiny-llama", "training_file": train["id"], "validation_file": valid["id"],
            "suffix": "schema-1", "seed": 7, "metadata": {"team": "a"}, "integrations": [WANDB],
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}},
            "training": {"hyperparameters": {"max_steps": 4}}}
    job = conforms("POST /fine_tuning/jobs", client.post("/v1/fine_tuning/jobs", json=body, headers=auth))
    job_id = job["id"]
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    assert job["integrations"] == [WANDB] and job["seed"] == 7
    by_meta = conforms("GET /fine_tuning/jobs", client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a"},
                                                           headers=auth))
    assert [j["id"] for j in by_meta["data"]] == [job_id]
    conforms(f"GET {J}", client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth))

    # Running: metrics, a checkpoint whose step has only some of OpenAI's metrics, a pause asked and taken back.
    token = claim(sched, job_id)
    ingest(client, job_id, token, [
        metrics(1), metrics(2, eval_loss=2.5, eval_mean_token_accuracy=0.3),
        {"kind": "checkpoint", "attempt": 1, "time": time.time(), "step": 2, "path": "ray/ckpt/2",
         "metrics": {"loss": 1.0, "mean_token_accuracy": 0.4}},
        {"kind": "event", "attempt": 1, "time": time.time(), "level": "info", "message": "no data here"}])
    running = conforms(f"GET {J}", client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth))
    assert running["status"] == "running"
    events = conforms(f"GET {J}/events", client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100},
                                                    headers=auth))
    assert any(e["message"] == "no data here" and "data" not in e for e in events["data"])  # an object, or left out
    step2 = next(e["data"] for e in events["data"] if e["type"] == "metrics" and e["data"]["step"] == 2)
    assert (step2["train_mean_token_accuracy"], step2["valid_mean_token_accuracy"]) == (0.4, 0.3)
    ckpts = conforms(f"GET {J}/checkpoints", client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth))
    [ckpt] = ckpts["data"]
    assert ckpt["metrics"] == {"step": 2, "train_loss": 1.0, "loss": 1.0, "train_mean_token_accuracy": 0.4,
                               "mean_token_accuracy": 0.4}  # numbers only: no value, no key
    assert ckpt["fine_tuned_model_checkpoint"] == f"ft:preset:tiny-llama:schema-1:{job_id}:ckpt-step-2"
    paused = conforms(f"POST {J}/pause", client.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=auth))
    assert (paused["status"], paused["desired_state"]) == ("running", "pause")
    conforms(f"POST {J}/resume", client.post(f"/v1/fine_tuning/jobs/{job_id}/resume", headers=auth))

    # Succeeded: the model's name carries the suffix; the first result file is OpenAI's metrics CSV.
    ingest(client, job_id, token, [metrics(4, eval_loss=2.0, eval_mean_token_accuracy=0.5, full_eval_loss=2.0,
                                           full_eval_mean_token_accuracy=0.5),
                                   {"kind": "result", "attempt": 1, "time": time.time(),
                                    "fine_tuned_model": f"ft:preset:tiny-llama:schema-1:{job_id}", "artifacts": {}}])
    done = conforms(f"GET {J}", client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth))
    assert done["status"] == "succeeded" and done["fine_tuned_model"] == f"ft:preset:tiny-llama:schema-1:{job_id}"
    results = conforms("GET /files/{file_id}", client.get(f"/v1/files/{done['result_files'][0]}", headers=auth))
    assert (results["filename"], results["purpose"]) == ("step_metrics.csv", "fine-tune-results")
    rows = list(csv.reader(io.StringIO(client.get(f"/v1/files/{results['id']}/content", headers=auth).text)))
    assert rows == [["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"],
                    ["1", "2.0", "0.2", "", ""], ["2", "1.0", "0.4", "2.5", "0.3"], ["4", "0.5", "0.8", "2.0", "0.5"]]

    # Queued → paused (OpenAI's own answer, outside its enum: the other named departure), resumed, cancelled.
    other = conforms("POST /fine_tuning/jobs", client.post("/v1/fine_tuning/jobs", json={
        "model": "preset:tiny-llama", "training_file": train["id"]}, headers=auth))
    page = conforms("GET /fine_tuning/jobs", client.get("/v1/fine_tuning/jobs", headers=auth))
    assert [j["id"] for j in page["data"]] == [other["id"], job_id]
    sched.validate_pending()
    paused = conforms(f"POST {J}/pause", client.post(f"/v1/fine_tuning/jobs/{other['id']}/pause", headers=auth))
    assert paused["status"] == "paused"
    conforms(f"POST {J}/resume", client.post(f"/v1/fine_tuning/jobs/{other['id']}/resume", headers=auth))
    cancelled = conforms(f"POST {J}/cancel", client.post(f"/v1/fine_tuning/jobs/{other['id']}/cancel", headers=auth))
    assert cancelled["status"] == "cancelled" and cancelled["integrations"] is None

    # Failed: OpenAI's error object (code, message, param), memfit's members beside it.
    failing = client.post("/v1/fine_tuning/jobs", json={"model": "preset:tiny-llama", "training_file": train["id"]},
                          headers=auth).json()["id"]
    ingest(client, failing, claim(sched, failing), [{"kind": "failure", "attempt": 1, "time": time.time(),
                                                     "code": "worker_error", "message": "boom", "rank": 1}])
    failed = conforms(f"GET {J}", client.get(f"/v1/fine_tuning/jobs/{failing}", headers=auth))
    assert failed["error"]["code"] == "worker_error" and failed["error"]["param"] is None

    # Delete a file; and errors carry OpenAI's error object.
    conforms("DELETE /files/{file_id}", client.delete(f"/v1/files/{valid['id']}", headers=auth))
    for response, status in ((client.get("/v1/fine_tuning/jobs/ftjob-nope", headers=auth), 404),
                             (client.post("/v1/fine_tuning/jobs", json={"model": 1}, headers=auth), 422),
                             (upload(client, key, '{"text": 1}\n'), 400),
                             (client.get("/v1/files", headers=bearer("mf_live_nope")), 401)):
        conforms("ErrorResponse", response, status)


def test_the_official_client_in_strict_mode_drives_the_whole_flow(env):
    """openai.OpenAI(_strict_response_validation=True) parses every answer against the SDK's types (a wrong
    type or a null where a string is declared raises APIResponseValidationError)."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    oai = openai.OpenAI(api_key=key, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0,
                        _strict_response_validation=True)
    train = oai.files.create(file=("train.jsonl", io.BytesIO(CHAT_JSONL.encode())), purpose="fine-tune")
    valid = oai.files.create(file=("valid.jsonl", io.BytesIO(CHAT_JSONL.encode())), purpose="fine-tune")
    assert train.status == "processed" and oai.files.retrieve(train.id).bytes == len(CHAT_JSONL)
    assert [f.id for f in oai.files.list()] == [valid.id, train.id]
    job = oai.fine_tuning.jobs.create(
        model="preset:tiny-llama", training_file=train.id, validation_file=valid.id, suffix="strict", seed=3,
        metadata={"flow": "strict"}, integrations=[WANDB],
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "learning_rate_multiplier": 2}}},
        extra_body={"training": {"hyperparameters": {"max_steps": 2}}})
    assert (job.seed, job.metadata, job.method.type, job.method.dpo) == (3, {"flow": "strict"}, "supervised", None)
    assert job.integrations[0].wandb.project == "memfit-tests" and job.integrations[0].wandb.tags is None
    assert job.model_extra["training"]["hyperparameters"]["max_steps"] == 2  # memfit's extension rides along
    second = oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=train.id)
    assert [j.id for j in oai.fine_tuning.jobs.list(metadata={"flow": "strict"})] == [job.id]
    assert {j.id for j in oai.fine_tuning.jobs.list()} == {job.id, second.id}

    token = claim(sched, job.id)
    ingest(client, job.id, token, [metrics(1), {"kind": "checkpoint", "attempt": 1, "time": time.time(), "step": 1,
                                                "path": "ray/ckpt/1", "metrics": {"loss": 2.0}}])
    assert oai.fine_tuning.jobs.retrieve(job.id).status == "running"
    events = oai.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert any(e.type == "metrics" and e.data["train_mean_token_accuracy"] == 0.2 for e in events)
    [ckpt] = oai.fine_tuning.jobs.checkpoints.list(job.id).data
    assert ckpt.fine_tuned_model_checkpoint == f"ft:preset:tiny-llama:strict:{job.id}:ckpt-step-1"
    assert ckpt.metrics.train_loss == 2.0 and ckpt.metrics.valid_loss is None
    # pause and resume a running job (its status stays running until the scheduler stops it at a checkpoint)
    assert oai.fine_tuning.jobs.pause(job.id).status == "running"
    assert oai.fine_tuning.jobs.resume(job.id).status == "running"
    ingest(client, job.id, token, [metrics(2), {"kind": "result", "attempt": 1, "time": time.time(),
                                                "fine_tuned_model": f"ft:preset:tiny-llama:strict:{job.id}"}])
    done = oai.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.fine_tuned_model.endswith(f":strict:{job.id}")
    table = oai.files.content(done.result_files[0]).text.splitlines()
    assert table == ["step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy", "1,2.0,0.2,,", "2,1.0,0.4,,"]
    assert oai.fine_tuning.jobs.cancel(second.id).status == "cancelled"
    assert oai.files.delete(valid.id).deleted


@pytest.mark.timeout(900)
def test_a_finished_job_answers_openais_schema_and_its_result_file_is_openais_csv(shared_stack, finished_job):
    """The session's finished job (DDP + LoRA, 6 steps, a validation file): every answer about it conforms,
    the strict client reads it, its result file is OpenAI's per-step CSV with the measured token accuracy,
    evaluation ran at its own interval (4 evaluations a run by default: steps 2, 4, 6), and the last
    checkpoint has the full validation's loss and accuracy."""
    stack, job = shared_stack, finished_job
    job_id = job["id"]
    openai_schema.assert_conforms("FineTuningJob", job)
    assert job["fine_tuned_model"] == f"ft:preset:tiny-llama::{job_id}"
    oai = openai.OpenAI(api_key=stack.key, base_url=f"{stack.server.url}/v1", max_retries=0, timeout=30,
                        _strict_response_validation=True)
    assert oai.fine_tuning.jobs.retrieve(job_id).status == "succeeded"
    events = list(oai.fine_tuning.jobs.list_events(job_id, limit=50))  # every page, each strictly parsed
    raw = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}, headers=stack.auth).json()
    openai_schema.assert_conforms("ListFineTuningJobEventsResponse", raw)
    ckpts = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=stack.auth).json()
    openai_schema.assert_conforms("ListFineTuningJobCheckpointsResponse", ckpts)
    assert [c.step_number for c in oai.fine_tuning.jobs.checkpoints.list(job_id).data] == [6, 3]
    final = ckpts["data"][0]["metrics"]
    assert 0 < final["full_valid_mean_token_accuracy"] <= 1 and final["full_valid_loss"] == final["valid_loss"] > 0
    assert "valid_loss" not in ckpts["data"][1]["metrics"]  # step 3: a checkpoint, not an evaluation

    table = list(csv.DictReader(io.StringIO(oai.files.content(job["result_files"][0]).text)))
    assert [int(r["step"]) for r in table] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= float(r["train_accuracy"]) <= 1 and float(r["train_loss"]) > 0 for r in table)
    assert [bool(r["valid_loss"]) for r in table] == [False, True, False, True, False, True]
    by_step = {e.data["step"]: e.data for e in events if e.type == "metrics" and e.data["rank"] == 0}
    assert [float(r["train_accuracy"]) for r in table] == [by_step[s]["train_mean_token_accuracy"] for s in range(1, 7)]
    assert float(table[-1]["valid_mean_token_accuracy"]) == final["valid_mean_token_accuracy"]
    results = json.loads(oai.files.content(job["result_files"][1]).text)  # memfit's results.json beside it
    assert results["fine_tuned_model"] == job["fine_tuned_model"] and results["artifacts"]["adapter"]
