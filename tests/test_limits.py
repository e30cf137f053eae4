"""Limits (OWASP API4, resource consumption), each hit through the real app on real Postgres:
per-tenant quotas (jobs waiting, jobs running at once, bytes stored), the rate limit per API key and
per client IP (429 + Retry-After), header limits (431), the body limit (413, chunked bodies too), the
JSON nesting limit (400, before any parser recurses), the upload limit and the page-size caps."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
from sqlalchemy import select
from starlette.testclient import TestClient

from api.app import create_app
from api.limits import json_depth_exceeds
from service.domain.states import JobStatus
from service.scheduler.loop import Scheduler
from service.scheduler.ray_jobs import RayJobs
from service.store.models import Job
from service.store.transitions import transition
from tests.factories import (
    CHAT_JSONL,
    bearer,
    create_job,
    new_key,
    post_file,
    post_job,
    settings_for,
    upload,
)

NOWHERE = RayJobs("http://127.0.0.1:9")  # claim() never talks to Ray


@pytest.fixture(scope="module")
def db_url(new_database):
    with new_database() as url:
        yield url


@pytest.fixture
def serve(db_url, tmp_path):
    """``with serve(**settings) as (app, client):`` the real app on the module's database."""

    @contextmanager
    def make(client_addr=("testclient", 50000), **overrides):
        app = create_app(settings_for(db_url, tmp_path / "storage", **overrides))
        try:
            with TestClient(app, client=client_addr) as client:
                yield app, client
        finally:
            app.state.engine.dispose()

    return make


def assert_problem(r, status: int, code: str, *words: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == code and body["error"]["code"] == code and body["status"] == status
    for word in words:
        assert word in body["detail"], (word, body["detail"])
    assert body["error"]["message"] == body["detail"]
    return body


# --- quotas -----------------------------------------------------------------------------------------


def test_the_queued_jobs_quota_refuses_the_next_job_naming_limit_and_use(serve):
    with serve(quota_queued_jobs=2) as (app, client):
        key, other = new_key(app.state.sessions), new_key(app.state.sessions)
        file_id = upload(client, key)
        first = create_job(client, key, file_id)
        create_job(client, key, file_id)
        r = post_job(client, key, training_file=file_id)
        body = assert_problem(r, 429, "queued_jobs_quota_exceeded", "2 of at most 2", "MEMFIT_QUOTA_QUEUED_JOBS")
        assert body["error"]["type"] == "rate_limit_error"
        assert body["quota"] == {"name": "queued_jobs", "limit": 2, "used": 2}
        assert r.headers["x-should-retry"] == "false"  # waiting a second does not free a slot
        # A tenant at its quota does not hold up another tenant.
        create_job(client, other, upload(client, other))
        # Cancelling a waiting job frees its slot.
        assert client.post(f"/v1/fine_tuning/jobs/{first['id']}/cancel", headers=bearer(key)).status_code == 200
        create_job(client, key, file_id)
        # A refused create with an Idempotency-Key saves nothing: the key works once there is room.
        r = post_job(client, key, {"Idempotency-Key": "k1"}, training_file=file_id)
        assert_problem(r, 429, "queued_jobs_quota_exceeded")
        with app.state.sessions() as s:
            assert len(s.scalars(select(Job).where(Job.tenant_id == first["organization_id"])).all()) == 3


def test_concurrent_creates_never_pass_the_queued_jobs_quota(serve):
    with serve(quota_queued_jobs=3) as (app, client):
        key = new_key(app.state.sessions)
        file_id = upload(client, key)
        client.get("/v1/files", headers=bearer(key))  # the key is accepted before the race
        barrier = threading.Barrier(8)
        answers: list = []

        def post():
            c = TestClient(app)
            barrier.wait()
            answers.append(post_job(c, key, training_file=file_id).status_code)

        threads = [threading.Thread(target=post) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(answers) == [200] * 3 + [429] * 5
        assert len(client.get("/v1/fine_tuning/jobs", headers=bearer(key)).json()["data"]) == 3


def test_paused_jobs_count_as_waiting(serve):
    with serve(quota_queued_jobs=1) as (app, client):
        key = new_key(app.state.sessions)
        file_id = upload(client, key)
        job = create_job(client, key, file_id)
        with app.state.sessions.begin() as s:
            transition(s, job["id"], JobStatus.queued)
            transition(s, job["id"], JobStatus.paused)
        assert_problem(post_job(client, key, training_file=file_id), 429, "queued_jobs_quota_exceeded", "1 of at most 1")


def test_the_storage_quota_refuses_the_upload_that_would_pass_it(serve, tmp_path):
    size = len(CHAT_JSONL.encode())
    with serve(quota_storage_bytes=2 * size + 10) as (app, client):
        key, other = new_key(app.state.sessions), new_key(app.state.sessions)
        ids = [post_file(client, key).json()["id"] for _ in range(2)]
        r = post_file(client, key)
        body = assert_problem(r, 429, "storage_quota_exceeded", f"{2 * size} of at most {2 * size + 10} bytes",
                              f"adds {size}", "MEMFIT_QUOTA_STORAGE_BYTES")
        assert body["param"] == "file" and body["quota"] == {"name": "storage", "limit": 2 * size + 10, "used": 2 * size}
        assert post_file(client, other).status_code == 200  # another tenant has its own quota
        listed = {f["id"] for f in client.get("/v1/files", headers=bearer(key)).json()["data"]}
        assert listed == set(ids)  # the refused upload was not recorded …
        stored = {p.name for d in (tmp_path / "storage" / "files").iterdir() for p in d.iterdir()}
        assert not any(name.endswith(".part") for name in stored)  # … nor left on disk
        assert client.delete(f"/v1/files/{ids[0]}", headers=bearer(key)).status_code == 200
        assert post_file(client, key).status_code == 200  # deleting a file makes room


# --- the running cap, in the scheduler's claim --------------------------------------------------------


@pytest.fixture(scope="module")
def claim_env(new_database, tmp_path_factory):
    """Its own database: claim() takes every queued job, whichever test made it."""
    with new_database() as url:
        settings = settings_for(url, tmp_path_factory.mktemp("storage"), quota_running_jobs=2)
        app = create_app(settings)
        with TestClient(app) as client:
            yield app, client, settings
        app.state.engine.dispose()


def queued(claim_env, key: str, n: int) -> list[str]:
    app, client, settings = claim_env
    file_id = upload(client, key)
    ids = [create_job(client, key, file_id)["id"] for _ in range(n)]
    Scheduler(app.state.sessions, settings, NOWHERE, batch=100).validate_pending()
    return ids


def statuses(app, ids) -> list[str]:
    with app.state.sessions() as s:
        return [s.get(Job, i).status for i in ids]


def test_the_running_cap_leaves_a_tenants_excess_jobs_queued_and_others_run(claim_env):
    app, _, settings = claim_env
    a, b = new_key(app.state.sessions), new_key(app.state.sessions)
    a_ids = queued(claim_env, a, 4)
    b_ids = queued(claim_env, b, 1)  # newer than all of a's: oldest first, a claim's batch sees a's first
    scheduler = Scheduler(app.state.sessions, settings, NOWHERE, batch=3)
    assert {j for j, _, _ in scheduler.claim()} == set(a_ids[:2])  # a's third, in the batch, stays queued
    scheduler.batch = 2  # a's two waiting jobs would fill the batch: the claim must not even select them
    assert {j for j, _, _ in scheduler.claim()} == set(b_ids)  # a at its cap does not keep b waiting
    assert scheduler.claim() == []
    assert statuses(app, a_ids) == ["running", "running", "queued", "queued"]
    with app.state.sessions.begin() as s:
        transition(s, a_ids[0], JobStatus.succeeded, expected_attempt=1)
    assert [j for j, _, _ in scheduler.claim()] == [a_ids[2]]  # a slot freed: the oldest waiting job
    assert statuses(app, a_ids) == ["succeeded", "running", "running", "queued"]


def test_concurrent_claimers_never_pass_the_running_cap(claim_env):
    app, _, settings = claim_env
    key = new_key(app.state.sessions)
    ids = queued(claim_env, key, 8)
    schedulers = [Scheduler(app.state.sessions, settings, NOWHERE, owner=f"capped-{i}", batch=2) for i in range(4)]
    start = threading.Barrier(len(schedulers))
    won: list[str] = []

    def loop(s: Scheduler):
        start.wait()
        for _ in range(20):
            won.extend(j for j, _, _ in s.claim() if j in ids)

    threads = [threading.Thread(target=loop, args=(s,)) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == len(set(won)) == 2  # which two depends on who locked what first (SKIP LOCKED)
    assert statuses(app, ids).count("running") == 2 and statuses(app, ids).count("queued") == 6


# --- rate limits --------------------------------------------------------------------------------------


def assert_rate_limited(r, setting: str) -> dict:
    body = assert_problem(r, 429, "rate_limit_exceeded", "rate limit exceeded", setting)
    assert body["error"]["type"] == "rate_limit_error"
    assert int(r.headers["Retry-After"]) >= 1 and int(r.headers["retry-after-ms"]) > 0
    assert r.headers["x-should-retry"] == "true"
    assert f"retry after {r.headers['Retry-After']} s" in body["detail"]
    return body


def test_an_api_key_past_its_burst_gets_429_with_retry_after_and_others_do_not(serve):
    with serve(rate_limit_key_per_s=0.01, rate_limit_key_burst=3) as (app, client):
        key, other = new_key(app.state.sessions), new_key(app.state.sessions)
        first = client.get("/v1/fine_tuning/jobs", headers=bearer(key))  # accepted: the key gets its bucket
        assert first.status_code == 200
        assert [client.get("/v1/fine_tuning/jobs", headers=bearer(key)).status_code for _ in range(3)] == [200] * 3
        r = client.get("/v1/files", headers=bearer(key))
        body = assert_rate_limited(r, "MEMFIT_RATE_LIMIT_KEY_PER_S")
        assert "this API key" in body["detail"] and "at most 0.01 requests per second (bursts of 3" in body["detail"]
        # 3 requests per 300 s (bursts of 3 at 0.01/s), counted in a sliding window: the wait is within it
        assert 1 <= int(r.headers["Retry-After"]) <= 300
        assert client.get("/v1/fine_tuning/jobs", headers=bearer(other)).status_code == 200
        # Health, readiness, metrics and the workers' ingest are not the tenant's traffic.
        for path in ("/healthz", "/readyz", "/metrics"):
            assert client.get(path, headers=bearer(key)).status_code == 200
        r = client.post("/v1/internal/jobs/ftjob-x/ingest", headers=bearer(key), json={"records": []})
        assert r.status_code != 429


def test_requests_without_a_key_are_limited_per_client_address(serve):
    with serve(rate_limit_ip_per_s=0.01, rate_limit_ip_burst=2) as (app, client):
        assert [client.get("/openapi.json").status_code for _ in range(2)] == [200, 200]
        body = assert_rate_limited(client.get("/ui/login"), "MEMFIT_RATE_LIMIT_IP_PER_S")
        assert "client address" in body["detail"]
        with TestClient(app, client=("10.0.0.9", 4000)) as elsewhere:  # another address: its own bucket
            assert elsewhere.get("/openapi.json").status_code == 200


def test_invented_keys_spend_their_address_bucket_but_an_accepted_key_keeps_its_own(serve):
    with serve(rate_limit_ip_per_s=0.01, rate_limit_ip_burst=2) as (app, client):
        good = new_key(app.state.sessions)
        assert client.get("/v1/files", headers=bearer(good)).status_code == 200
        codes = [client.get("/v1/files", headers=bearer(f"mf-invented-{i}")).status_code for i in range(3)]
        assert codes == [401, 401, 429]
        assert_rate_limited(client.get("/v1/files", headers=bearer("mf-invented-9")), "MEMFIT_RATE_LIMIT_IP_PER_S")
        assert client.get("/v1/files", headers=bearer(good)).status_code == 200


def test_the_tinker_key_header_gets_its_own_bucket_once_accepted(serve):
    """The tinker SDK's X-API-Key (api/routes/tinker.py) counts as a key: not charged to the address's bucket."""
    with serve(rate_limit_ip_per_s=0.01, rate_limit_ip_burst=2) as (app, client):
        tml = {"X-API-Key": "tml-" + new_key(app.state.sessions)}
        assert [client.get("/api/v1/get_server_capabilities", headers=tml).status_code for _ in range(4)] == [200] * 4
        codes = [client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": f"tml-mf-invented-{i}"}).status_code
                 for i in range(3)]
        assert codes == [401, 401, 429]


def test_the_rate_limit_can_be_turned_off(serve):
    with serve(rate_limit_enabled=False, rate_limit_ip_per_s=0.01, rate_limit_ip_burst=1) as (app, client):
        assert {client.get("/openapi.json").status_code for _ in range(5)} == {200}


# --- headers, bodies, JSON depth ----------------------------------------------------------------------


def test_too_many_or_too_large_headers_are_431(serve):
    with serve(max_header_count=8, max_header_bytes=2048) as (app, client):
        key = new_key(app.state.sessions)
        many = {f"x-h{i}": "1" for i in range(8)}
        assert_problem(client.get("/v1/files", headers={**bearer(key), **many}), 431, "headers_too_large",
                       "MEMFIT_MAX_HEADER_COUNT", "the limits are 8 headers")
        big = {"x-big": "a" * 3000}
        assert_problem(client.get("/healthz", headers=big), 431, "headers_too_large", "2048 bytes",
                       "MEMFIT_MAX_HEADER_BYTES")
        assert client.get("/v1/files", headers=bearer(key)).status_code == 200


def test_a_body_over_the_limit_is_413_declared_or_chunked_on_every_json_route(serve):
    with serve(max_json_body_bytes=4096) as (app, client):
        key = new_key(app.state.sessions)
        file_id = upload(client, key)
        big = b'{"model": "' + b"x" * 5000 + b'"}'

        def chunked():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        # (the workers' ingest has a cap of its own, read after its token: tests/test_ingest_door.py)
        for path in ("/v1/fine_tuning/jobs", "/v1/memory/plan"):
            for content in (big, chunked()):
                r = client.post(path, content=content, headers={**bearer(key), "content-type": "application/json"})
                assert_problem(r, 413, "body_too_large", "4096 bytes", "MEMFIT_MAX_JSON_BODY_BYTES")
        # Under the limit the body reaches the route as it came, chunked or not.
        r = client.post("/v1/fine_tuning/jobs", headers={**bearer(key), "content-type": "application/json"},
                        content=(c for c in [b'{"model": "preset:tiny-llama", ', f'"training_file": "{file_id}"}}'.encode()]))
        assert r.status_code == 200, r.text


def nested(depth: int) -> str:
    return '{"model": "preset:tiny-llama", "metadata": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("path", ["/v1/fine_tuning/jobs", "/v1/memory/plan"])
@pytest.mark.parametrize("depth", [65, 100_000])
def test_json_nested_past_the_limit_is_400_naming_it(serve, path, depth):
    with serve(max_json_body_bytes=1024 * 1024) as (app, client):
        key = new_key(app.state.sessions)
        r = client.post(path, content=nested(depth), headers={**bearer(key), "content-type": "application/json"})
        assert_problem(r, 400, "json_too_deep", "deeper than the limit of 64 levels", "MEMFIT_MAX_JSON_DEPTH")


def test_json_at_the_limit_and_brackets_inside_strings_reach_the_route(serve):
    with serve() as (app, client):
        key = new_key(app.state.sessions)
        r = client.post("/v1/fine_tuning/jobs", content=nested(64), headers={**bearer(key), "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["code"] != "json_too_deep"  # metadata must be an object of strings
        file_id = upload(client, key)
        r = post_job(client, key, training_file=file_id, metadata={"brackets": '\\"' + "[{" * 200})
        assert r.status_code == 200, r.text


def test_json_depth_reads_strings_and_escapes_as_json_does():
    assert not json_depth_exceeds(b'{"a": "[[[[[[[[[["}', 2)
    assert not json_depth_exceeds(b'{"a": "\\"[[[[[[[[[[", "b": [1]}', 2)  # an escaped quote does not end the string
    assert json_depth_exceeds(b'{"a": "\\\\", "b": [[1]]}', 2)  # an escaped backslash does not escape the quote
    assert json_depth_exceeds(b"[" * 3 + b"]" * 3, 2) and not json_depth_exceeds(b"[[]][[]]", 2)


def test_uploads_have_their_own_limit_not_the_json_bodys(serve):
    with serve(max_json_body_bytes=4096, max_upload_bytes=16 * 1024) as (app, client):
        key = new_key(app.state.sessions)
        line = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "' + "y" * 80 + '"}]}\n'
        assert post_file(client, key, line * 80).status_code == 200  # ~12 KB: over the JSON limit, under the upload one
        r = post_file(client, key, line * 200)
        assert_problem(r, 413, "file_too_large", "limit of 16384 bytes")


# --- page sizes and cursors -----------------------------------------------------------------------------


def test_every_list_caps_its_page_size_and_refuses_another_tenants_cursor(serve):
    with serve() as (app, client):
        key, other = new_key(app.state.sessions), new_key(app.state.sessions)
        file_id = upload(client, key)
        job_id = create_job(client, key, file_id)["id"]
        other_file = upload(client, other)
        other_job = create_job(client, other, other_file)["id"]
        lists = ["/v1/fine_tuning/jobs", "/v1/files", f"/v1/fine_tuning/jobs/{job_id}/events",
                 f"/v1/fine_tuning/jobs/{job_id}/checkpoints"]
        for path in lists:
            body = assert_problem(client.get(path, params={"limit": 101}, headers=bearer(key)), 422, "invalid_value")
            assert body["param"] == "limit"
            assert client.get(path, params={"limit": 100}, headers=bearer(key)).status_code == 200
        for path, cursor in (("/v1/fine_tuning/jobs", other_job), ("/v1/files", other_file)):
            r = client.get(path, params={"after": cursor}, headers=bearer(key))
            assert_problem(r, 422, "invalid_cursor", repr(cursor))
        r = client.get(f"/v1/fine_tuning/jobs/{other_job}/events", headers=bearer(key))
        assert r.status_code == 404


# --- over real HTTP (uvicorn) ---------------------------------------------------------------------------


def test_over_real_http_headers_are_431_and_a_chunked_body_is_413_with_the_defaults(db_url, tmp_path):
    from tests.scheduler_support import LiveServer

    app = create_app(settings_for(db_url, tmp_path / "storage"))
    server = LiveServer(app).start()
    try:
        key = new_key(app.state.sessions)
        with server.client() as http:
            r = http.get("/v1/files", headers={**bearer(key), "x-big": "a" * 10_000})
            assert_problem(r, 431, "headers_too_large", "8192 bytes")

            def chunked():
                for _ in range(17):
                    yield b" " * (1024 * 1024)

            r = http.post("/v1/memory/plan", content=chunked(), headers={**bearer(key), "content-type": "application/json"})
            assert "content-length" not in r.request.headers
            assert_problem(r, 413, "body_too_large", f"{16 * 1024 * 1024} bytes")
            assert http.get("/v1/files", headers=bearer(key)).status_code == 200
    finally:
        server.stop()
        app.state.engine.dispose()
