"""The ingest route like any other (issue 37, item 2), on real Postgres and over real HTTP.

- the token is checked from the header before a byte of the body is read: a request that declares a
  large body and never sends it is answered 401/404 at once;
- the body is capped by what one batch of a run legitimately is (MEMFIT_MAX_INGEST_BODY_BYTES), not by
  the 16 MiB of the JSON routes;
- its own rate limit per attempt (429 with Retry-After, which the workers' sink honours: nothing is
  lost), and refused tokens are charged to the client's address as refused API keys are;
- the documented Ingress publishes /v1 without /v1/internal, and a NetworkPolicy admits only the Ray
  pods and the Ingress controller to memfit's pods (tests/test_deploy_configs.py checks the rest of
  the manifests).
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager

import pytest
import yaml
from fastapi.testclient import TestClient

from api.app import create_app
from service.scheduler.loop import Scheduler
from service.scheduler.ray_jobs import RayJobs
from tests.factories import bearer, create_job, new_key, settings_for, upload
from tests.scheduler_support import LiveServer
from tests.test_deploy_configs import KUBERNETES_DIR, ROOT, of_kind
from workers.sink_http import HttpSink

INGEST = "/v1/internal/jobs/{}/ingest"


@pytest.fixture(scope="module")
def db_url(new_database):
    with new_database() as url:
        yield url


@pytest.fixture
def serve(db_url, tmp_path):
    """``with serve(**settings) as (app, client, claim):`` the app, a client, and ``claim()`` → (job id, token)."""

    @contextmanager
    def make(**overrides):
        settings = settings_for(db_url, tmp_path / "storage", **overrides)
        app = create_app(settings)
        sched = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
        try:
            with TestClient(app) as client:
                def claim() -> tuple[str, str]:
                    key = new_key(app.state.sessions)
                    job = create_job(client, key, upload(client, key))
                    sched.validate_pending()
                    return job["id"], {j: t for j, _, t in sched.claim(limit=100)}[job["id"]]

                yield app, client, claim
        finally:
            app.state.engine.dispose()

    return make


def metrics(step: int) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": 0, "step": step, "loss": 1.0}


def head_only(port: int, job_id: str, token: str | None, declared: int) -> tuple[int, float]:
    """Send a request head declaring ``declared`` body bytes, and no body: (status answered, seconds)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall((f"POST {INGEST.format(job_id)} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                      f"Content-Length: {declared}\r\n\r\n").encode())
        answer = sock.recv(4096).decode(errors="replace")
    return int(answer.split(" ", 2)[1]), time.monotonic() - started


def test_the_token_is_checked_before_the_body_is_read(serve):
    with serve() as (app, _, claim):
        job_id, token = claim()
        other_id, _ = claim()
        server = LiveServer(app).start()
        try:
            for who, job, tok, expected in (("no token", job_id, None, 401), ("another job's token", other_id, token, 404),
                                            ("a made-up token", job_id, "mfi_made-up", 404)):
                status, seconds = head_only(server.port, job, tok, 5_000_000)
                assert status == expected and seconds < 5, (who, status, seconds)  # the body was never awaited
        finally:
            server.stop()


def test_the_body_is_capped_by_what_one_batch_can_be(serve):
    with serve(max_ingest_body_bytes=256 * 1024) as (_, client, claim):
        job_id, token = claim()
        big = [{"kind": "event", "attempt": 1, "time": time.time(), "message": "x" * 3000} for _ in range(100)]
        r = client.post(INGEST.format(job_id), json={"records": big}, headers=bearer(token))  # ~310 KB
        assert r.status_code == 413 and r.json()["code"] == "body_too_large", r.text
        assert "MEMFIT_MAX_INGEST_BODY_BYTES" in r.json()["detail"]

        def chunked():
            body = json.dumps({"records": big}).encode()
            for i in range(0, len(body), 64 * 1024):
                yield body[i:i + 64 * 1024]

        r = client.post(INGEST.format(job_id), content=chunked(), headers={**bearer(token), "content-type": "application/json"})
        assert r.status_code == 413, r.text
        nested = '{"records": [' + "[" * 100 + "]" * 100 + "]}"
        r = client.post(INGEST.format(job_id), content=nested, headers={**bearer(token), "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "json_too_deep", r.text
        assert client.post(INGEST.format(job_id), json={"records": big[:50]}, headers=bearer(token)).status_code == 200
        # The default is what a batch of the sink's (200 records) legitimately is, far below the JSON routes' 16 MiB.
    with serve() as (app, _, _):
        assert app.state.settings.max_ingest_body_bytes <= 2 * 1024 * 1024


def test_ingest_has_its_own_limit_per_attempt_and_refused_tokens_cost_their_address(serve):
    with serve(rate_limit_ingest_per_s=0.01, rate_limit_ingest_burst=3, rate_limit_ip_burst=3,
               rate_limit_ip_per_s=0.01) as (app, client, claim):
        job_id, token = claim()
        other_id, other_token = claim()
        codes = [client.post(INGEST.format(job_id), json={"records": [metrics(i)]}, headers=bearer(token)).status_code
                 for i in range(1, 5)]
        assert codes == [200, 200, 200, 429], codes
        r = client.post(INGEST.format(job_id), json={"records": [metrics(9)]}, headers=bearer(token))
        body = r.json()
        assert r.status_code == 429 and body["code"] == "rate_limit_exceeded" and "MEMFIT_RATE_LIMIT_INGEST_PER_S" in body["detail"]
        assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-should-retry"] == "true"
        # Another attempt has its own allowance.
        assert client.post(INGEST.format(other_id), json={"records": [metrics(1)]}, headers=bearer(other_token)).status_code == 200
        # Guessing tokens: each refusal is charged to the address; past its allowance, 429 before any lookup.
        with TestClient(app, client=("10.9.9.9", 1234)) as guesser:
            codes = [guesser.post(INGEST.format(job_id), json={"records": []}, headers=bearer(f"mfi_guess-{i}")).status_code
                     for i in range(4)]
        assert codes == [404, 404, 404, 429], codes


def test_the_sink_waits_out_a_429_and_loses_nothing(serve, tmp_path):
    with serve(rate_limit_ingest_per_s=4, rate_limit_ingest_burst=1) as (app, client, claim):
        job_id, token = claim()
        server = LiveServer(app).start()
        sink = HttpSink(server.url + INGEST.format(job_id), token, batch_size=1, flush_interval_s=0.01,
                        backoff_base_s=0.05, backoff_max_s=0.5, spool=tmp_path / "spool.jsonl")
        try:
            sink.write_many([metrics(i) for i in range(1, 7)])
            assert sink.flush(timeout_s=30) and sink.posted == 6 and sink.dropped == 0
        finally:
            sink.close()
            server.stop()
        key_events = app.state.sessions
        from sqlalchemy import select

        from service.store.models import JobEvent
        with key_events() as s:
            steps = sorted(d["step"] for d in s.scalars(select(JobEvent.data).where(
                JobEvent.job_id == job_id, JobEvent.type == "metrics")))
        assert steps == [1, 2, 3, 4, 5, 6]


# --- the manifests -------------------------------------------------------------------------------------------

INGRESS = KUBERNETES_DIR / "optional" / "ingress.yaml"


def _public_paths(doc: dict) -> list[tuple[str, str]]:
    return [(p["path"], p.get("pathType", "Prefix")) for rule in doc["spec"]["rules"]
            for p in (rule.get("http") or {}).get("paths") or []]


def _routes(path: str, path_type: str, request: str) -> bool:
    if path_type == "Exact":
        return request == path
    prefix = path.rstrip("/")
    return request == prefix or request.startswith(prefix + "/")


def test_the_documented_ingress_publishes_v1_but_not_v1_internal():
    docs = [d for d in yaml.safe_load_all(INGRESS.read_text()) if d]
    [ingress] = [d for d in docs if d["kind"] == "Ingress"]
    paths = _public_paths(ingress)
    assert ingress["spec"].get("tls"), "published without TLS"
    for request in ("/v1/internal/jobs/ftjob-x/ingest", "/v1/internal", "/metrics", "/healthz", "/readyz"):
        assert not any(_routes(p, t, request) for p, t in paths), (request, paths)
    for request in ("/v1/files", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/ftjob-x/events", "/v1/memory/plan",
                    "/ui/jobs", "/ui/static/dashboard.js"):
        assert any(_routes(p, t, request) for p, t in paths), (request, paths)
    # docs/deploy.md points at this file and no longer shows a `/v1` Prefix rule
    deploy_md = (ROOT / "docs" / "deploy.md").read_text()
    assert "deploy/kubernetes/optional/ingress.yaml" in deploy_md and "{ path: /v1, pathType: Prefix" not in deploy_md


def test_memfits_pods_admit_only_the_ray_pods_and_the_ingress_controller():
    memfit = [(w, d) for w, d in of_kind("NetworkPolicy") if d["spec"]["podSelector"].get("matchLabels") == {"app": "memfit"}]
    assert memfit, "no NetworkPolicy selects memfit's pods"
    [(where, policy)] = memfit
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = []
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), f"{where}: a rule without `from` admits everyone"
        assert {p.get("port") for p in rule.get("ports") or []} == {8000}, f"{where}: {rule}"
        peers.extend(rule["from"])
    ray = [p for p in peers if set(p) == {"podSelector"} and p["podSelector"]["matchLabels"] == {"ray.io/cluster": "memfit-ray"}]
    controller = [p for p in peers if set(p) == {"namespaceSelector", "podSelector"}]
    assert len(ray) == 1 and len(controller) == 1 and len(peers) == 2, peers
