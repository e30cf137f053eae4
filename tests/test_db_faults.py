"""The database can hang without hanging memfit (issue 37, item 4).

A Postgres server of this module's own (tests/pgserver.py, never the shared one), reached through a TCP
proxy the test controls (tests/tcp_proxy.py), with the timeouts set short by the test
(MEMFIT_DB_CONNECT_TIMEOUT_S, MEMFIT_DB_STATEMENT_TIMEOUT_S, MEMFIT_DB_KEEPALIVE_IDLE_S). Real:
the server, its crash (SIGKILL of every process of it) and its crash recovery, the API over HTTP,
the schedulers, the Ray job and its training. Simulated: the network fault is the proxy's (it stops
forwarding; its kernel still acknowledges, so only memfit's own deadline can notice).

1. black-holed: every route that needs the database answers 503 database_unavailable within its
   timeout (not a hung request), /readyz 503 within it, /healthz 200 at once, a scheduler tick ends;
   once the proxy forwards again the same processes answer 200;
2. mid-job, with two schedulers running (two replicas): the server SIGKILLed, the job's scheduler
   stopped meanwhile (its replica went too), the server kept down longer than the lease and started
   again (crash recovery) — the other replica adopts the job, which is not resubmitted — and then
   black-holed for a while: the job still succeeds on attempt 1, one Ray submission, every
   (rank, step) of its metrics stored once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from api.app import create_app
from service.scheduler.loop import Scheduler, start_in_thread
from service.scheduler.paths import submission_id
from service.scheduler.ray_jobs import RayJobs
from service.store import db
from service.store.models import Job, JobEvent
from tests import pgserver
from tests.factories import bearer, create_job, new_key, settings_for, upload
from tests.scheduler_support import LiveServer
from tests.tcp_proxy import TcpProxy

TIMEOUTS = {"db_connect_timeout_s": 2, "db_statement_timeout_s": 2, "db_keepalive_idle_s": 2}
DEADLINE_S = 3  # statement timeout + 1 s: the longest any wait on the database may take
STEPS = 60  # the crash test's job: its steps must outlast the outage (the lease twice, a restart, a black hole)


@pytest.fixture(scope="module")
def server():
    pg = pgserver.start_or_skip("no throwaway Postgres server can be started here")
    try:
        yield pg
    finally:
        if pg.process.poll() is None:
            pg.stop()


@pytest.fixture(scope="module")
def proxy(server):
    p = TcpProxy(server.port)
    yield p
    p.close()


@pytest.fixture(scope="module")
def urls(server, proxy):
    """(direct URL, URL through the proxy) of a migrated database of this module."""
    with pgserver.database(server.admin_url) as url:
        db.upgrade(url)
        # The throwaway server runs with synchronous_commit off (tests/pgserver.py: it lives for a session);
        # a crash then loses the last commits it acknowledged. Production commits synchronously: so does
        # this database, so that a SIGKILL loses nothing that was acknowledged, as on a real server.
        with pgserver.connect(server.admin_url) as admin:
            admin.execute(f'ALTER DATABASE "{make_url(url).database}" SET synchronous_commit TO on')
        yield url, url.replace(f":{server.port}/", f":{proxy.port}/")


def timed(fn):
    started = time.monotonic()
    value = fn()
    return value, time.monotonic() - started


def crash(server) -> None:
    """SIGKILL the postmaster and every backend at once (a crashed host): the next start recovers from the WAL."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(10)


def test_a_black_holed_database_is_a_503_within_the_timeout_not_a_hang(urls, proxy, tmp_path):
    direct, proxied = urls
    settings = settings_for(proxied, tmp_path / "storage", **TIMEOUTS)
    app = create_app(settings)
    server = LiveServer(app).start()
    scheduler = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            key = new_key(app.state.sessions)
            job_id = create_job(http, key, upload(http, key))["id"]
            job_path = f"/v1/fine_tuning/jobs/{job_id}"
            assert http.get(job_path, headers=bearer(key)).status_code == 200
            time.sleep(1.1)  # the key's cached check expires: the next request asks the database

            proxy.black_hole()
            try:
                r, took = timed(lambda: http.get(job_path, headers=bearer(key)))
                assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
                assert took < DEADLINE_S + 5, took
                assert float(r.headers["retry-after"]) > 0
                r, took = timed(lambda: http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=bearer(key)))
                assert r.status_code == 503 and took < 2 * DEADLINE_S + 5, (r.text, took)
                r, took = timed(lambda: http.get("/readyz"))
                assert r.status_code == 503 and "database" in r.json() and took < DEADLINE_S + 5, (r.text, took)
                r, took = timed(lambda: http.get("/healthz"))
                assert r.status_code == 200 and took < 2
                # A scheduler's tick (six steps, each its own transactions) ends: each wait is bounded.
                ticked = threading.Thread(target=scheduler.tick, daemon=True)
                ticked.start()
                ticked.join(12 * DEADLINE_S + 10)
                assert not ticked.is_alive(), "a scheduler tick hung on the black-holed database"
            finally:
                proxy.forward()

            r = http.get(job_path, headers=bearer(key))
            assert r.status_code == 200 and r.json()["status"] == "validating_files", r.text
            assert http.get("/readyz").status_code == 200
            assert http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=bearer(key)).json()["status"] == "cancelled"
    finally:
        server.stop()
        app.state.engine.dispose()


def _status(http: httpx.Client, job_id: str, key: str) -> str | None:
    try:
        r = http.get(f"/v1/fine_tuning/jobs/{job_id}", headers=bearer(key))
    except httpx.HTTPError:
        return None
    return r.json()["status"] if r.status_code == 200 else None


def _adopted(stack, job_id: str) -> list[str]:
    """The job's 'adopted the job' events' messages (none while the database is away)."""
    try:
        with stack.app.state.sessions() as s:
            return s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id,
                                                            JobEvent.message.like("%adopted the job%"))
                            .order_by(JobEvent.id)).all()
    except OperationalError:
        return []


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_lives_through_a_crash_an_outage_past_its_lease_and_a_black_hole(urls, server, proxy, ray_head, tmp_path):
    from tests.stack import Stack

    _, proxied = urls
    stack = Stack(proxied, tmp_path / "storage", ray_head, **TIMEOUTS)
    other = Scheduler(stack.app.state.sessions, stack.settings, stack.ray, owner="replica-2")
    threads = []
    try:
        stack.start_scheduler()
        threads.append(start_in_thread(other))
        http, key = stack.http, stack.key
        # long enough to outlive the outage on a loaded machine: a job whose buffered result reaches the database
        # before the other replica's first tick ends with no lease left to adopt, which is right but tests nothing
        job_id = stack.create(hyperparameters={"max_steps": STEPS}, checkpoint_every_steps=STEPS // 3)
        _wait(lambda: _status(http, job_id, key) == "running" and len(stack.metrics_steps(job_id)) >= 2, 300,
              "the job to train")

        with stack.app.state.sessions() as s:
            owner = s.get(Job, job_id).lease_owner
        crash(server)  # every process of the server SIGKILLed: a crash, not a shutdown
        r, took = timed(lambda: http.get(f"/v1/fine_tuning/jobs/{job_id}", headers=bearer(key)))
        # a refused connection (the pool's, then a new one's): seconds, not a hang (a loaded CI machine is slow)
        assert r.status_code == 503 and took < 30, (r.text, took)
        assert http.get("/readyz").status_code == 503
        # the job's scheduler goes with the outage (its replica restarted): it cannot release its lease
        if owner == other.owner:
            thread, stop = threads.pop()
            stop.set()
            thread.join(30)
            adopter = stack.scheduler.owner
        else:
            stack.stop_scheduler()
            adopter = other.owner
        time.sleep(2 * stack.settings.lease_seconds)  # down longer than the lease: it expires meanwhile
        server.start_again()  # crash recovery on the same data directory

        _wait(lambda: _status(http, job_id, key), 30, "the API to answer again")
        assert _status(http, job_id, key) == "running", "the job ended during the outage: make STEPS larger"
        _wait(lambda: _adopted(stack, job_id), 60, "the other replica to adopt the job")  # then the black hole
        proxy.black_hole()
        try:
            r, took = timed(lambda: http.get(f"/v1/fine_tuning/jobs/{job_id}", headers=bearer(key)))
            assert r.status_code == 503 and took < 4 * DEADLINE_S + 10, (r.text, took)  # a few deadlines at most
            time.sleep(DEADLINE_S)
        finally:
            proxy.forward()

        _wait(lambda: _status(http, job_id, key) in ("succeeded", "failed", "cancelled"), 400, "the job to end")
        job = stack.job(job_id)
        assert job["status"] == "succeeded", (job, [e["message"] for e in stack.events(job_id)][-15:])
        with stack.app.state.sessions() as s:
            row = s.get(Job, job_id)
            metrics = s.execute(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")).scalars().all()
        assert row.attempt == 1  # never resubmitted
        assert set(stack.ray.submissions_of(job_id)) == {submission_id(job_id, 1)}  # one Ray submission
        keys = [(m["rank"], m["step"]) for m in metrics]
        assert sorted(keys) == [(r, s) for r in range(2) for s in range(1, STEPS + 1)], sorted(keys)  # each once, none lost
        adopted = _adopted(stack, job_id)
        # the other replica took it over; the black hole outlasting its lease, it may take it again from itself
        assert adopted and adopted[0] == f"Scheduler {adopter} adopted the job (lease of {owner} expired)", adopted
        assert all(m.startswith(f"Scheduler {adopter} adopted the job (lease of {adopter} ") for m in adopted[1:]), adopted
    finally:
        for thread, stop in threads:
            stop.set()
            thread.join(30)
        if server.process.poll() is not None:
            server.start_again()
        proxy.forward()
        stack.close()
