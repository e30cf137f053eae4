"""The ingest endpoint on real Postgres: idempotent retries, token scope, stale attempts, late posts
after a terminal status, result and failure records — and the HttpSink's delivery rules against the
real app over HTTP."""

from __future__ import annotations

import time

import pytest

from service.scheduler.local_head import free_port
from service.store.models import Job
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import LiveServer, app_without_ray
from workers.sink_http import HttpSink

INGEST = "/v1/internal/jobs/{}/ingest"


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    # Its own database: the scheduler's validate/claim batches must see only this module's jobs,
    # whatever other modules left queued in the session's database. The scheduler's claim gives each
    # job its attempt and ingest token; Ray is never reached here.
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


def running_job(env) -> tuple[str, str, str]:
    """(job id, ingest token, tenant key) for a job that the scheduler has claimed (attempt 1)."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]], key


def metrics(step: int, rank: int = 0, attempt: int = 1, total: int = 10) -> dict:
    return {"kind": "metrics", "attempt": attempt, "time": time.time(), "rank": rank, "step": step,
            "total_steps": total, "loss": 3.0 / step, "tokens_per_s": 100.0, "trained_tokens": 64 * step,
            "step_time_s": 0.1}


def post(client, job_id, token, records):
    return client.post(INGEST.format(job_id), json={"records": records},
                       headers={"Authorization": f"Bearer {token}"} if token else {})


def events(client, key, job_id) -> list[dict]:
    r = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    return list(reversed(r.json()["data"]))


def job(client, key, job_id) -> dict:
    return client.get(f"/v1/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()


def test_retried_batch_is_stored_once(env):
    _, client, _ = env
    job_id, token, key = running_job(env)
    now = time.time()
    batch = [metrics(1), metrics(1, rank=1), metrics(2), metrics(2, rank=1),
             {"kind": "memory", "attempt": 1, "time": now, "rank": 0, "step": 2, "parameters_bytes": 1000,
              "peak_bytes": 5000},
             {"kind": "checkpoint", "attempt": 1, "time": now, "step": 2, "path": "ray/x/checkpoint_000002",
              "metrics": {"train_loss": 1.5}},
             {"kind": "event", "attempt": 1, "time": now, "message": "worker group restarted", "dedupe": "restart-1"}]
    first = post(client, job_id, token, batch)
    assert first.status_code == 200, first.text
    assert first.json() == {"accepted": 8, "duplicates": 0, "status": "running"}  # 7 + the checkpoint event
    again = post(client, job_id, token, batch)
    assert again.status_code == 200
    assert again.json()["accepted"] == 0

    evs = events(client, key, job_id)
    steps = [(e["data"]["step"], e["data"]["rank"]) for e in evs if e["type"] == "metrics"]
    assert steps == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [e["message"] for e in evs].count("worker group restarted") == 1
    ckpts = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers={"Authorization": f"Bearer {key}"}).json()
    assert [c["step_number"] for c in ckpts["data"]] == [2]
    assert ckpts["data"][0]["metrics"]["train_loss"] == 1.5
    j = job(client, key, job_id)
    assert j["trained_tokens"] == 128
    assert j["estimated_finish"] is not None and j["estimated_finish"] >= int(now) - 1


def test_token_scope_and_missing_token(env):
    _, client, _ = env
    job_a, token_a, _ = running_job(env)
    job_b, token_b, key_b = running_job(env)
    r = post(client, job_b, token_a, [metrics(1)])
    assert r.status_code == 404  # as for an unknown id: a token says nothing of other jobs
    assert r.json()["code"] == "job_not_found"
    assert post(client, job_b, None, [metrics(1)]).json()["code"] == "invalid_ingest_token"
    assert post(client, job_b, None, [metrics(1)]).status_code == 401
    assert post(client, job_b, "mfi_not-a-token", [metrics(1)]).status_code == 404
    assert post(client, "ftjob-doesnotexist", token_a, [metrics(1)]).status_code == 404
    assert [e for e in events(client, key_b, job_b) if e["type"] == "metrics"] == []
    assert post(client, job_a, token_a, [metrics(1)]).status_code == 200


def test_stale_attempt_is_rejected_whole(env):
    _, client, _ = env
    job_id, token, key = running_job(env)
    r = post(client, job_id, token, [metrics(1), metrics(2, attempt=2)])
    assert r.status_code == 409
    assert r.json()["code"] == "stale_attempt"
    assert [e for e in events(client, key, job_id) if e["type"] == "metrics"] == []


def test_result_succeeds_and_late_posts_change_nothing(env):
    app, client, _ = env
    job_id, token, key = running_job(env)
    now = time.time()
    r = post(client, job_id, token, [
        metrics(10, total=10),
        {"kind": "result", "attempt": 1, "time": now, "fine_tuned_model": f"ft:preset:tiny-llama:{job_id}",
         "artifacts": {"adapter": "adapter"}, "trained_tokens": 4096},
    ])
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "succeeded"
    j = job(client, key, job_id)
    assert j["status"] == "succeeded" and j["fine_tuned_model"] == f"ft:preset:tiny-llama:{job_id}"
    assert j["trained_tokens"] == 4096 and j["finished_at"] is not None
    csv_id, json_id = j["result_files"]  # OpenAI's per-step metrics CSV, then memfit's results.json
    content = client.get(f"/v1/files/{json_id}/content", headers={"Authorization": f"Bearer {key}"})
    # Stored relative to the attempt's folder (paths outside it are refused: tests/test_worker_claims.py), shown where it is.
    with app.state.sessions() as s:
        attempt_folder = s.get(Job, job_id).output_dir
    assert content.status_code == 200 and content.json()["artifacts"] == {"adapter": f"{attempt_folder}/adapter"}
    csv = client.get(f"/v1/files/{csv_id}/content", headers={"Authorization": f"Bearer {key}"})
    assert csv.headers["content-type"].startswith("text/csv")
    assert csv.text.splitlines()[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"

    before = events(client, key, job_id)
    late = post(client, job_id, token, [metrics(11, total=10),
                                        {"kind": "failure", "attempt": 1, "time": now, "code": "worker_error",
                                         "message": "late"}])
    assert late.status_code == 409
    assert late.json()["code"] == "job_not_accepting"
    assert events(client, key, job_id) == before
    with app.state.sessions() as s:
        row = s.get(Job, job_id)
        assert row.status == "succeeded" and row.error is None and row.trained_tokens == 4096


def test_failure_record_fails_the_job_with_a_structured_error(env):
    _, client, _ = env
    job_id, token, key = running_job(env)
    r = post(client, job_id, token, [{
        "kind": "failure", "attempt": 1, "time": time.time(), "code": "out_of_memory",
        "message": "rank 1 ran out of memory in backward at step 3", "rank": 1, "step": 3, "phase": "backward",
        "details": {"dominant": "activations_bytes", "suggestions": ["gradient_checkpointing"]}}])
    assert r.status_code == 200, r.text
    j = job(client, key, job_id)
    assert j["status"] == "failed"
    assert j["error"]["code"] == "out_of_memory"
    with env[0].state.sessions() as s:
        err = s.get(Job, job_id).error
    assert (err["rank"], err["step"], err["phase"]) == (1, 3, "backward")
    assert err["details"]["dominant"] == "activations_bytes"


def test_http_sink_retries_until_the_api_is_up_and_stops_on_409(env):
    app, client, _ = env
    job_id, token, key = running_job(env)
    port = free_port()
    sink = HttpSink(f"http://127.0.0.1:{port}" + INGEST.format(job_id), token,
                    backoff_base_s=0.05, backoff_max_s=0.3, flush_interval_s=0.01)
    try:
        sink.write_many([metrics(1), metrics(2)])
        time.sleep(0.5)  # nothing listens yet: connection refused, retried with backoff
        assert sink.posted == 0 and sink.attempts >= 2
        server = LiveServer(app, port=port).start()
        try:
            assert sink.flush(timeout_s=20)
            assert sink.posted == 2
            sink.write({"kind": "result", "attempt": 1, "time": time.time(), "fine_tuned_model": "ft:x",
                        "artifacts": {}})
            assert sink.flush(timeout_s=20)
            sink.write(metrics(3))  # the job is terminal now: 409, the sink stops for good
            assert sink.flush(timeout_s=20)
            assert sink.stopped_reason and sink.stopped_reason.startswith("HTTP 409")
            sink.write(metrics(4))
            assert sink.dropped == 2
        finally:
            sink.close()
            server.stop()
    finally:
        sink.close()
    assert [e["data"]["step"] for e in events(client, key, job_id) if e["type"] == "metrics"] == [1, 2]
