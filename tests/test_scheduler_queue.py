"""The Postgres queue: concurrent claimers, lease expiry and adoption, fenced writes.

Real Postgres; the lease tests ask the shared real Ray head about submissions (none exist for these
jobs, which is exactly the "scheduler died before/after submitting, Ray lost it" case).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from api.app import create_app
from service.domain.errors import LeaseLost, StaleAttempt
from service.domain.states import JobStatus
from service.scheduler.loop import Scheduler
from service.scheduler.paths import submission_id
from service.scheduler.ray_jobs import RayJobs
from service.store import auth
from service.store.models import IdempotencyKey, Job, JobEvent, utcnow
from service.store.transitions import transition
from tests.factories import create_job, new_key, settings_for, upload

NOWHERE = RayJobs("http://127.0.0.1:9")  # claim() never talks to Ray


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with new_database() as url:
        settings = settings_for(url, tmp_path_factory.mktemp("storage"), lease_seconds=5)
        app = create_app(settings)
        with TestClient(app) as client:
            yield app, client, settings
        app.state.engine.dispose()


def queued_jobs(env, n: int) -> list[str]:
    app, client, settings = env
    key = new_key(app.state.sessions)
    file_id = upload(client, key)
    ids = [create_job(client, key, file_id)["id"] for _ in range(n)]
    Scheduler(app.state.sessions, settings, NOWHERE, batch=100).validate_pending()
    with app.state.sessions() as s:
        assert {s.get(Job, i).status for i in ids} == {"queued"}
    return ids


def test_concurrent_claimers_claim_each_job_exactly_once(env):
    app, _, settings = env
    ids = set(queued_jobs(env, 24))
    schedulers = [Scheduler(app.state.sessions, settings, NOWHERE, owner=f"claimer-{i}", batch=3) for i in range(6)]
    claims: dict[str, list[str]] = {s.owner: [] for s in schedulers}
    start = threading.Barrier(len(schedulers))

    def loop(s: Scheduler):
        start.wait()
        while True:
            won = s.claim()
            claims[s.owner].extend(job_id for job_id, _, _ in won if job_id in ids)
            if not won:
                with app.state.sessions() as q:
                    if not q.scalar(select(func.count()).where(Job.id.in_(ids), Job.status == "queued")):
                        return

    threads = [threading.Thread(target=loop, args=(s,)) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [j for c in claims.values() for j in c]
    assert sorted(everything) == sorted(ids)  # every job claimed, none twice
    assert sum(1 for c in claims.values() if c) >= 2  # the claimers really competed
    with app.state.sessions() as s:
        for job_id in ids:
            row = s.get(Job, job_id)
            assert row.status == "running" and row.attempt == 1
            owner = next(o for o, c in claims.items() if job_id in c)
            assert row.lease_owner == owner
            started = s.scalar(select(func.count()).where(JobEvent.job_id == job_id, JobEvent.message == "Job started"))
            assert started == 1
    # Done with these: a terminal job is never adopted, so the next test sees only its own job.
    with app.state.sessions.begin() as s:
        for job_id in ids:
            transition(s, job_id, JobStatus.cancelled, expected_attempt=1, lease_owner=None)


def _expire(app, job_id):
    with app.state.sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def test_lease_expiry_adoption_and_reclaim_with_next_attempt(env, ray_head):
    app, _, settings = env
    [job_id] = queued_jobs(env, 1)
    ray = RayJobs(ray_head.dashboard_url)
    a = Scheduler(app.state.sessions, settings, ray, owner="sched-a")
    b = Scheduler(app.state.sessions, settings, ray, owner="sched-b", vanish_confirm_s=0)
    [(claimed, attempt, token_1)] = [c for c in a.claim(limit=100) if c[0] == job_id]
    assert attempt == 1
    # a's heartbeat keeps the lease; b may not take a live lease.
    assert a.heartbeat(force=True) >= 1
    assert job_id not in b.adopt_expired()

    _expire(app, job_id)  # a died: its lease runs out
    assert job_id in b.adopt_expired()
    with app.state.sessions() as s:
        row = s.get(Job, job_id)
        assert (row.lease_owner, row.attempt, row.status) == ("sched-b", 1, "running")
    # a is back from the dead: its heartbeat no longer renews the job, and every write it would
    # make on what it last knew is refused — the attempt is the same, the lease is not.
    a.heartbeat(force=True)
    a._fail(job_id, 1, "ray_job_failed", "a's stale view of the job")
    a._finish(job_id, 1, JobStatus.cancelled, lease_owner=None)
    a._set_ray_status(job_id, 1, "FAILED")
    a._vanished(job_id, 1, submission_id(job_id, 1), "ray_submission_missing")
    with app.state.sessions() as s:
        row = s.get(Job, job_id)
        assert (row.lease_owner, row.status, row.attempt, row.ray_status, row.error) == ("sched-b", "running", 1, None, None)
        with pytest.raises(LeaseLost):
            transition(s, job_id, JobStatus.failed, expected_attempt=1, expected_owner="sched-a")
        s.rollback()

    # Ray has no memfit-<id>-1 (a died before submitting): b requeues — not on the first "does not
    # exist", only once Ray said so three times in a row — and the next claim is attempt 2.
    assert ray.status(submission_id(job_id, 1)) is None
    b.reconcile()
    b.reconcile()
    with app.state.sessions() as s:
        assert s.get(Job, job_id).status == "running"
    b.reconcile()
    with app.state.sessions() as s:
        assert s.get(Job, job_id).status == "queued"
    won = [c for c in b.claim(limit=100) if c[0] == job_id]
    assert won and won[0][1] == 2
    with app.state.sessions() as s:
        row = s.get(Job, job_id)
        assert (row.attempt, row.status, row.ray_submission_id) == (2, "running", submission_id(job_id, 2))

    # Fenced writes from attempt 1 are refused and change nothing.
    with app.state.sessions() as s:
        with pytest.raises(StaleAttempt):
            transition(s, job_id, JobStatus.succeeded, expected_attempt=1)
        s.rollback()
    client = env[1]
    r = client.post(f"/v1/internal/jobs/{job_id}/ingest", headers={"Authorization": f"Bearer {token_1}"},
                    json={"records": [{"kind": "metrics", "attempt": 1, "time": 0, "rank": 0, "step": 1}]})
    assert r.status_code == 404  # attempt 1's token was replaced at the new claim: it opens nothing
    with app.state.sessions() as s:
        assert s.get(Job, job_id).status == "running"


def test_a_tick_purges_expired_idempotency_keys_every_few_minutes(env):
    """Keys past their 24 h life are deleted by the scheduler's loop (not only when reused): on the
    first tick, then again once ``purge_every_s`` has passed; live keys stay."""
    app, _, settings = env
    with app.state.sessions.begin() as s:
        tenant_id = auth.create_key(s, "purge-test").tenant_id

    def add(name: str, age: timedelta) -> None:
        with app.state.sessions.begin() as s:
            s.add(IdempotencyKey(tenant_id=tenant_id, key=name, request_hash="0" * 64, status_code=200,
                                 response_body={}, created_at=utcnow() - age))

    def keys() -> set[str]:
        with app.state.sessions() as s:
            return set(s.scalars(select(IdempotencyKey.key).where(IdempotencyKey.tenant_id == tenant_id)))

    add("old", timedelta(hours=25))
    add("new", timedelta(hours=23))
    sched = Scheduler(app.state.sessions, settings, NOWHERE, purge_every_s=3600)
    sched.tick()
    assert keys() == {"new"}
    add("old-2", timedelta(hours=30))
    sched.tick()  # within purge_every_s: not yet
    assert keys() == {"new", "old-2"}
    sched._last_purge -= 3601
    sched.tick()
    assert keys() == {"new"}
