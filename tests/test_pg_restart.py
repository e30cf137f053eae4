"""A Postgres restart under a real `memfit serve` (issue 14, item 2).

The database is a throwaway server of this module's own (tests/pgserver.py), never the shared one:
the test stops and starts it. What must hold:

- a quick restart with no traffic in between: the FIRST requests after it succeed (the pool does not
  hand out the connections the old server closed);
- while the server is away: /healthz 200, /readyz 503, an authenticated GET and an ingest POST 503
  problem+json with Retry-After (retryable: the workers' sink tries again), never a 500;
- once it is back: /readyz 200 within seconds, the same job visible;
- the scheduler's loop logs and carries on through ticks on a database that is away.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.scheduler.local_head import free_port
from service.store import db
from tests import pgserver
from tests.factories import bearer, create_job, new_key, upload
from workers.sink_http import HttpSink

ROOT = Path(__file__).resolve().parent.parent
HTTP_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def server():
    pg = pgserver.start_or_skip("no throwaway Postgres server can be started here")
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="module")
def db_url(server):
    with pgserver.database(server.admin_url) as url:
        db.upgrade(url)
        yield url


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def status_of(http: httpx.Client, path: str, **kw) -> int | None:
    try:
        return http.get(path, **kw).status_code
    except httpx.HTTPError:
        return None


def assert_retryable_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert float(response.headers["retry-after"]) > 0
    body = response.json()
    assert body["status"] == 503 and body["code"] == "database_unavailable"
    assert "Traceback" not in response.text


def claim(engine, db_url: str, tmp_path: Path, job_id: str) -> str:
    """Validate and claim ``job_id`` as the scheduler would (its Ray address never answers: nothing is
    submitted); the attempt's ingest token."""
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs
    from tests.factories import settings_for

    sched = Scheduler(db.make_sessionmaker(engine), settings_for(db_url, tmp_path / "storage"),
                      RayJobs("http://127.0.0.1:9"))
    sched.validate_pending()
    return {jid: token for jid, _, token in sched.claim(limit=100)}[job_id]


def metrics(step: int) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": 0, "step": step, "total_steps": 10,
            "loss": 3.0 / step, "tokens_per_s": 100.0, "trained_tokens": 64 * step, "step_time_s": 0.1}


@pytest.mark.timeout(90)
def test_memfit_serve_survives_a_postgres_restart(server, db_url, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": db_url,
           "MEMFIT_STORAGE_DIR": str(tmp_path / "storage"), "MEMFIT_SCHEDULER_ENABLED": "0"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli.main", "serve", "--port", str(port),
                                 "--log-level", "warning"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    engine = db.make_engine(db_url, pool_size=1)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HTTP_TIMEOUT_S) as http:
            wait_until(lambda: proc.poll() is None and status_of(http, "/readyz") == 200
                       or proc.poll() is not None, 40, "memfit serve to be ready")
            assert proc.poll() is None, log_path.read_text()[-3000:]
            key = new_key(db.make_sessionmaker(engine))
            job_id = create_job(http, key, upload(http, key))["id"]
            job_path = f"/v1/fine_tuning/jobs/{job_id}"
            token = claim(engine, db_url, tmp_path, job_id)  # running, attempt 1, with its ingest token
            engine.dispose()  # the test's own connections must not hold the server up

            # Fill the API's pool with several idle connections (concurrent requests), then restart
            # with no traffic in between: every pooled connection is now stale.
            with ThreadPoolExecutor(6) as pool:
                assert set(pool.map(lambda _: http.get(job_path, headers=bearer(key)).status_code, range(12))) == {200}
            server.restart()
            first = [http.get(job_path, headers=bearer(key)) for _ in range(3)]
            assert [r.status_code for r in first] == [200, 200, 200], first[0].text
            assert first[0].json()["id"] == job_id

            # The database away: liveness holds, readiness drops, requests answer a retryable 503.
            server.stop(remove=False)
            assert http.get("/healthz").status_code == 200
            ready = http.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert_retryable_503(http.get(job_path, headers=bearer(key)))
            ingest = http.post(f"/v1/internal/jobs/{job_id}/ingest", headers=bearer(token),
                               json={"records": [metrics(1)]})
            assert_retryable_503(ingest)
            # The workers' sink, posting while the database is away, keeps its records and retries.
            sink = HttpSink(f"{http.base_url}/v1/internal/jobs/{job_id}/ingest", token, spool=tmp_path / "spool.jsonl",
                            backoff_base_s=0.05, backoff_max_s=0.3, flush_interval_s=0.01, close_timeout_s=5)
            try:
                sink.write_many([metrics(1), metrics(2)])
                wait_until(lambda: sink.attempts >= 2, 10, "the sink to post (and be refused) twice")
                assert sink.posted == 0 and sink.stopped_reason is None and sink.dropped == 0

                server.start_again()
                assert sink.flush(timeout_s=15) and sink.posted == 2 and sink.stopped_reason is None
            finally:
                sink.abandon()
            started = time.monotonic()
            wait_until(lambda: status_of(http, "/readyz") == 200, 10, "/readyz to answer 200 again")
            assert time.monotonic() - started < 10
            again = http.get(job_path, headers=bearer(key))
            assert again.status_code == 200 and again.json()["id"] == job_id
            evs = http.get(f"{job_path}/events?limit=100", headers=bearer(key)).json()["data"]
            assert sorted(e["data"]["step"] for e in evs if e["type"] == "metrics") == [1, 2]  # each once
            assert proc.poll() is None
        assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]
    finally:
        if server.process.poll() is not None:
            server.start_again()  # the module's teardown drops the database on it
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        engine.dispose()


@pytest.mark.timeout(60)
def test_the_scheduler_loop_carries_on_while_the_database_is_away(server, db_url, tmp_path, caplog):
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs
    from tests.factories import settings_for

    settings = settings_for(db_url, tmp_path / "storage", poll_seconds=0.05)
    engine = db.make_engine(db_url, pool_size=2)
    sched = Scheduler(db.make_sessionmaker(engine), settings, RayJobs("http://127.0.0.1:9"))
    try:
        sched.tick()  # pooled connections to the server that is about to go
        server.stop(remove=False)
        sched.tick()  # must not raise
        stop = threading.Event()
        errors: list[BaseException] = []

        def run():
            try:
                sched.run(stop)
            except BaseException as exc:  # noqa: BLE001 - what the test checks
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(0.5)  # several ticks on a database that is away
        assert thread.is_alive(), errors
        stop.set()  # a shutdown while it is still away: the leases it cannot release simply expire
        thread.join(10)
        assert not thread.is_alive() and errors == []
        assert any("database" in r.getMessage().lower() for r in caplog.records if r.name == "memfit.scheduler")
        server.start_again()
        assert sched.heartbeat(force=True) >= 0  # and the same engine works again at once (no raise)
    finally:
        if server.process.poll() is not None:
            server.start_again()
        engine.dispose()
