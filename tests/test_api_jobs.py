"""The fine-tuning jobs API on Postgres and SQLite: exact status codes and problem bodies."""

from __future__ import annotations

from service.domain.states import JobStatus
from service.store.db import session_scope
from service.store.models import IdempotencyKey, utcnow
from service.store.transitions import transition

PROBLEM = "application/problem+json"


def assert_problem(r, status: int, code: str, param: str | None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    body = r.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["param"] == param
    assert body["type"].endswith("/" + code)
    assert body["instance"] == r.request.url.path
    assert body["error"] == {"message": body["detail"], "type": body["error"]["type"], "param": param, "code": code}
    return body


def test_create_returns_openai_job(create_job, tenant):
    r = create_job(tenant, suffix="demo", seed=7, metadata={"team": "nlp"},
                   training={"hyperparameters": {"micro_batch_size": 2, "gradient_accumulation_steps": 4},
                             "peft": {"method": "lora", "r": 4}})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["id"].startswith("ftjob-")
    assert job["object"] == "fine_tuning.job"
    assert job["status"] == "validating_files"
    assert job["organization_id"] == tenant.id
    assert job["model"] == "preset:tiny-llama"
    assert job["seed"] == 7 and job["suffix"] == "demo" and job["metadata"] == {"team": "nlp"}
    assert job["result_files"] == [] and job["fine_tuned_model"] is None and job["error"] is None
    # n_epochs 'auto' for the 2-example file: OpenAI's rule, raised to see 100 examples, capped at 25.
    assert job["hyperparameters"] == {"n_epochs": 25, "batch_size": 8, "learning_rate_multiplier": 1.0}
    # OpenAI's schema types method.dpo and method.reinforcement as objects: a supervised job leaves them out
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    assert job["training"]["peft"]["method"] == "lora" and job["training"]["peft"]["r"] == 4
    assert job["training"]["strategy"] == "ddp"  # defaults are filled in
    assert job["attempt"] == 0
    # The memory pre-flight's short summary (issue 5): planned, nothing measured yet.
    assert job["memory"]["fits"] is True and job["memory"]["measured_peak_bytes"] is None
    assert isinstance(job["created_at"], int)


def test_several_bad_fields_reported_together(create_job, tenant):
    r = create_job(tenant, seed=-1, training={
        "hyperparameters": {"learning_rate": 0, "micro_batch_size": 0},
        "precision": "fp64",
    })
    body = assert_problem(r, 422, "invalid_spec", "seed")
    params = [e["param"] for e in body["errors"]]
    assert params == ["seed", "training.hyperparameters.learning_rate",
                      "training.hyperparameters.micro_batch_size", "training.precision"]
    assert all(e["code"] == "invalid_value" and e["message"] for e in body["errors"])


def test_cross_field_rules_reported_together(create_job, tenant):
    r = create_job(tenant, training={"precision": "fp16", "strategy": "deepspeed", "peft": {"method": "qlora"},
                                     "deepspeed": {"offload_param": "cpu"}})
    body = assert_problem(r, 422, "invalid_spec", "training.deepspeed.offload_param")
    assert {e["param"] for e in body["errors"]} == {
        "training.deepspeed.offload_param", "training.precision", "training.peft.method"}


def test_unknown_field_is_rejected_by_name(create_job, tenant):
    body = assert_problem(create_job(tenant, training={"lora_rank": 8}), 422, "unknown_field", "training.lora_rank")
    assert body["errors"] == [{"param": "training.lora_rank", "message": "unknown field", "code": "unknown_field"}]


def test_pipeline_rules_name_their_fields(create_job, tenant):
    """Pipeline jobs are accepted; what cannot run is refused before any worker starts, by field."""
    ok = create_job(tenant, training={"strategy": "pipeline", "pipeline": {"stages": 2}, "resources": {"num_workers": 4}})
    assert ok.status_code == 200, ok.text
    r = create_job(tenant, training={"strategy": "pipeline", "pipeline": {"stages": 2}, "resources": {"num_workers": 3}})
    body = assert_problem(r, 422, "invalid_value", "training.pipeline.stages")
    assert "multiple of pipeline stages" in body["errors"][0]["message"]
    r = create_job(tenant, training={"strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 3},
                                     "hyperparameters": {"micro_batch_size": 4}, "resources": {"num_workers": 2}})
    assert_problem(r, 422, "invalid_value", "training.pipeline.microbatches")
    r = create_job(tenant, training={"strategy": "pipeline", "pipeline": {"stages": 2}, "peft": {"method": "prompt_tuning"},
                                     "resources": {"num_workers": 2}})
    assert_problem(r, 422, "invalid_value", "training.peft.method")
    r = create_job(tenant, training={"strategy": "pipeline", "pipeline": {"stages": 4}, "resources": {"num_workers": 4}})
    body = assert_problem(r, 422, "invalid_value", "training.pipeline.stages")  # tiny-llama has 2 blocks
    assert "at least 4 decoder blocks" in body["errors"][0]["message"]


def test_server_owned_fields_cannot_be_set(create_job, tenant):
    r = create_job(tenant, status="succeeded", result_files=["file-x"], organization_id="org-other")
    body = assert_problem(r, 422, "invalid_spec", "status")
    assert {e["param"] for e in body["errors"]} == {"status", "result_files", "organization_id"}
    assert all(e["code"] == "unknown_field" for e in body["errors"])


def test_malformed_json_is_400(client, tenant):
    r = client.post("/v1/fine_tuning/jobs", content=b'{"model": ', headers={**tenant.headers, "content-type": "application/json"})
    assert_problem(r, 400, "invalid_json", None)


def test_model_must_be_preset_allowed_dir_or_hub_id(create_job, tenant, api_settings):
    for model in ("preset:nope", "/etc", "../../etc/passwd", "not a model", str(api_settings.model_dirs[0] / "missing")):
        body = assert_problem(create_job(tenant, model=model), 422, "invalid_model", "model")
        assert body["errors"][0]["param"] == "model"
    assert create_job(tenant, model=str(api_settings.model_dirs[0] / "tiny")).status_code == 200
    assert create_job(tenant, model="Qwen/Qwen2.5-0.5B").status_code == 200


def test_training_file_must_exist_for_this_tenant(create_job, upload_file, tenant, make_tenant):
    assert_problem(create_job(tenant, training_file="file-doesnotexist"), 404, "file_not_found", "training_file")
    other_file = upload_file(make_tenant()).json()["id"]
    assert_problem(create_job(tenant, training_file=other_file), 404, "file_not_found", "training_file")
    assert_problem(create_job(tenant, validation_file=other_file), 404, "file_not_found", "validation_file")


def test_auth_missing_malformed_unknown_revoked(client, tenant, api_app):
    from service.store import auth

    assert_problem(client.get("/v1/fine_tuning/jobs"), 401, "invalid_api_key", None)
    assert_problem(client.get("/v1/fine_tuning/jobs", headers={"Authorization": "Basic abc"}), 401, "invalid_api_key", None)
    bad = tenant.key[:-4] + ("AAAA" if not tenant.key.endswith("AAAA") else "BBBB")
    assert_problem(client.get("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {bad}"}), 401, "invalid_api_key", None)
    assert client.get("/v1/fine_tuning/jobs", headers=tenant.headers).status_code == 200
    with session_scope(api_app.state.sessions) as s:
        auth.revoke_key(s, tenant.prefix)
    r = client.get("/v1/fine_tuning/jobs", headers=tenant.headers)
    assert_problem(r, 401, "revoked_api_key", None)
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_other_tenants_job_is_404_and_never_listed(client, create_job, tenant, make_tenant):
    job = create_job(tenant).json()
    other = make_tenant()
    create_job(other)
    for method, path in [("get", ""), ("post", "/cancel"), ("post", "/pause"), ("post", "/resume"),
                         ("get", "/events"), ("get", "/checkpoints")]:
        r = client.request(method, f"/v1/fine_tuning/jobs/{job['id']}{path}", headers=other.headers)
        assert_problem(r, 404, "job_not_found", None)
    listed = client.get("/v1/fine_tuning/jobs", headers=other.headers).json()["data"]
    assert job["id"] not in [j["id"] for j in listed] and len(listed) == 1
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=tenant.headers).status_code == 200


def test_idempotent_replay_and_conflicting_reuse(client, create_job, tenant, make_tenant, upload_file):
    file_id = upload_file(tenant).json()["id"]
    key = {"Idempotency-Key": "create-1"}
    first = create_job(tenant, headers=key, training_file=file_id, seed=1)
    again = create_job(tenant, headers=key, training_file=file_id, seed=1)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert len(client.get("/v1/fine_tuning/jobs", headers=tenant.headers).json()["data"]) == 1
    body = assert_problem(create_job(tenant, headers=key, training_file=file_id, seed=2), 422,
                          "idempotency_key_reused", "Idempotency-Key")
    assert "different request body" in body["detail"]
    # A refused first request saves nothing: the key can be used again once the body is fixed.
    assert create_job(tenant, headers={"Idempotency-Key": "k2"}, training_file=file_id, seed=-5).status_code == 422
    assert create_job(tenant, headers={"Idempotency-Key": "k2"}, training_file=file_id, seed=5).status_code == 200
    # Keys belong to one tenant: another tenant's "create-1" is a new request.
    other = create_job(make_tenant(), headers=key, seed=1)
    assert other.status_code == 200 and other.json()["id"] != first.json()["id"]


def test_idempotency_key_in_flight_is_409(client, create_job, tenant, upload_file, api_app):
    from service.jobs.crud import request_hash

    file_id = upload_file(tenant).json()["id"]
    body = {"training_file": file_id, "model": "preset:tiny-llama"}
    with session_scope(api_app.state.sessions) as s:
        s.add(IdempotencyKey(tenant_id=tenant.id, key="busy", request_hash=request_hash(body), created_at=utcnow()))
    r = client.post("/v1/fine_tuning/jobs", json=body, headers={**tenant.headers, "Idempotency-Key": "busy"})
    assert_problem(r, 409, "idempotency_key_in_use", "Idempotency-Key")
    assert r.headers["retry-after"] == "1" and r.headers["x-should-retry"] == "true"


def test_cancel_pause_resume_and_illegal_transitions(client, create_job, tenant, api_app):
    job_id = create_job(tenant).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}"
    h = tenant.headers
    # validating_files: pause is recorded as a request for the scheduler; resume withdraws it.
    r = client.post(url + "/pause", headers=h)
    assert r.status_code == 200 and r.json()["status"] == "validating_files" and r.json()["desired_state"] == "pause"
    assert client.post(url + "/resume", headers=h).json()["desired_state"] is None
    body = assert_problem(client.post(url + "/resume", headers=h), 409, "invalid_transition", None)
    assert body["detail"] == f"Job {job_id} is validating_files; only a paused job can be resumed"
    with session_scope(api_app.state.sessions) as s:
        transition(s, job_id, JobStatus.queued)
    assert client.post(url + "/pause", headers=h).json()["status"] == "paused"
    assert_problem(client.post(url + "/pause", headers=h), 409, "invalid_transition", None)
    assert client.post(url + "/resume", headers=h).json()["status"] == "queued"
    r = client.post(url + "/cancel", headers=h)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None
    for action in ("cancel", "pause", "resume"):
        r = client.post(f"{url}/{action}", headers=h)
        assert_problem(r, 409, "invalid_transition", None)
        assert r.headers["x-should-retry"] == "false"
    assert client.get(url, headers=h).json()["status"] == "cancelled"


def test_list_pagination_has_no_gaps_or_duplicates(client, create_job, tenant, upload_file):
    file_id = upload_file(tenant).json()["id"]
    created = [create_job(tenant, training_file=file_id, metadata={"i": str(i)}).json()["id"] for i in range(7)]
    seen, after, pages = [], None, 0
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = client.get("/v1/fine_tuning/jobs", params=params, headers=tenant.headers).json()
        pages += 1
        assert page["object"] == "list" and len(page["data"]) <= 3
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert pages == 3
    assert seen == list(reversed(created))  # newest first, each exactly once


def test_list_limit_bounds_and_metadata_filter(client, create_job, tenant, upload_file):
    file_id = upload_file(tenant).json()["id"]
    a = create_job(tenant, training_file=file_id, metadata={"team": "a"}).json()["id"]
    create_job(tenant, training_file=file_id, metadata={"team": "b"})
    r = client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a"}, headers=tenant.headers)
    assert [j["id"] for j in r.json()["data"]] == [a]
    assert_problem(client.get("/v1/fine_tuning/jobs", params={"limit": 101}, headers=tenant.headers), 422, "invalid_value", "limit")
    assert_problem(client.get("/v1/fine_tuning/jobs", params={"limit": 0}, headers=tenant.headers), 422, "invalid_value", "limit")
    assert_problem(client.get("/v1/fine_tuning/jobs", params={"after": "ftjob-nope"}, headers=tenant.headers),
                   422, "invalid_cursor", "after")


def test_events_paginate_newest_first(client, create_job, tenant, api_app):
    from service.jobs import crud as jobs

    job = create_job(tenant).json()
    job_id, file_id = job["id"], job["training_file"]
    with session_scope(api_app.state.sessions) as s:
        for i in range(5):
            jobs.add_event(s, job_id, f"step {i}", type="metrics", data={"step": i}, dedupe_key=f"m{i}")
        assert not jobs.add_event(s, job_id, "step 0 again", dedupe_key="m0")
    url = f"/v1/fine_tuning/jobs/{job_id}/events"
    first = client.get(url, params={"limit": 4}, headers=tenant.headers).json()
    assert first["has_more"] is True
    assert [e["message"] for e in first["data"]] == ["step 4", "step 3", "step 2", "step 1"]
    assert first["data"][0]["object"] == "fine_tuning.job.event" and first["data"][0]["type"] == "metrics"
    rest = client.get(url, params={"limit": 100, "after": first["data"][-1]["id"]}, headers=tenant.headers).json()
    # Older than the steps: create's events, newest first — the derived hyperparameters, then the file check.
    derived = [e["data"]["derived"] for e in rest["data"][1:-1]]
    assert derived == ["seed", "n_epochs", "learning_rate", "batch_size"]
    assert [rest["data"][0]["message"], rest["data"][-1]["message"]] == ["step 0", "Validating training file: " + file_id]
    assert rest["has_more"] is False


def test_checkpoints_listed_by_step(client, create_job, tenant, api_app):
    from service.jobs import crud as jobs

    job_id = create_job(tenant).json()["id"]
    with session_scope(api_app.state.sessions) as s:
        for step in (10, 20, 30):
            assert jobs.add_checkpoint(s, job_id, attempt=1, step=step, path=f"/ckpt/{step}", metrics={"train_loss": 1.0 / step})
        assert not jobs.add_checkpoint(s, job_id, attempt=2, step=20, path="/dup")
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
    page = client.get(url, params={"limit": 2}, headers=tenant.headers).json()
    assert [c["step_number"] for c in page["data"]] == [30, 20] and page["has_more"]
    c = page["data"][0]
    assert c["object"] == "fine_tuning.job.checkpoint" and c["fine_tuning_job_id"] == job_id
    # The metrics OpenAI's checkpoint declares are numbers: what a checkpoint has no value for is left out, not null.
    assert c["metrics"] == {"step": 30, "train_loss": 1.0 / 30}
    # Its model is named as OpenAI names one (service/domain/model_names.py); memfit's `path` says where it is.
    assert c["fine_tuned_model_checkpoint"] == f"ft:preset:tiny-llama::{job_id}:ckpt-step-30"
    assert c["path"] == "/ckpt/30"
    rest = client.get(url, params={"after": page["data"][-1]["id"]}, headers=tenant.headers).json()
    assert [c["step_number"] for c in rest["data"]] == [10] and not rest["has_more"]


def test_unknown_route_and_job_are_problems(client, tenant):
    assert_problem(client.get("/v1/nope", headers=tenant.headers), 404, "not_found", None)
    assert_problem(client.get("/v1/fine_tuning/jobs/ftjob-missing", headers=tenant.headers), 404, "job_not_found", None)


def test_oversized_json_body_is_413(client, tenant):
    from api.app import MAX_JSON_BODY_BYTES

    body = b'{"model": "' + b"x" * MAX_JSON_BODY_BYTES + b'"}'
    r = client.post("/v1/fine_tuning/jobs", content=body, headers={**tenant.headers, "content-type": "application/json"})
    assert_problem(r, 413, "body_too_large", None)


def test_concurrent_requests_with_one_key_create_one_job(api_app, tenant, upload_file):
    import threading

    from starlette.testclient import TestClient

    file_id = upload_file(tenant).json()["id"]
    body = {"model": "preset:tiny-llama", "training_file": file_id}
    answers: list = []
    barrier = threading.Barrier(6)

    def post():
        c = TestClient(api_app)
        barrier.wait()
        answers.append(c.post("/v1/fine_tuning/jobs", json=body, headers={**tenant.headers, "Idempotency-Key": "race"}))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.status_code for r in answers} <= {200, 409}
    assert len({r.json()["id"] for r in answers if r.status_code == 200}) == 1
    listed = TestClient(api_app).get("/v1/fine_tuning/jobs", headers=tenant.headers).json()["data"]
    assert len(listed) == 1
