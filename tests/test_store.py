"""The store on real Postgres: the state machine, attempt fencing, dedupe, and API keys."""

from __future__ import annotations

import secrets
import threading

import pytest
from sqlalchemy import select

from service.domain.errors import (
    InvalidTransition,
    JobNotFound,
    StaleAttempt,
    Unauthorized,
)
from service.domain.records import MemoryRecord
from service.domain.states import ALLOWED, TERMINAL, JobStatus
from service.jobs import crud as jobs
from service.store import auth
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import ApiKey, Job, JobEvent, MemorySample, Tenant, new_id
from service.store.transitions import transition


@pytest.fixture(scope="module")
def sessions(pg_migrated):
    engine = make_engine(pg_migrated)
    yield make_sessionmaker(engine)
    engine.dispose()


def make_job(sessions, status: JobStatus = JobStatus.validating_files, attempt: int = 0) -> str:
    """A job row in ``status`` for a fresh tenant (written directly: the factory, not the API)."""
    with session_scope(sessions) as s:
        tenant = Tenant(id=new_id("org-"), name=f"t-{secrets.token_hex(4)}")
        s.add(tenant)
        s.flush()
        job = Job(id=new_id("ftjob-"), tenant_id=tenant.id, status=status.value, attempt=attempt,
                  spec={"model": "preset:tiny-llama", "training_file": "file-x"}, model="preset:tiny-llama",
                  training_file="file-x", result_files=[])
        s.add(job)
    return job.id


def status_of(sessions, job_id) -> str:
    with session_scope(sessions) as s:
        return s.get(Job, job_id).status


def test_terminal_flags():
    assert {s for s in JobStatus if s.terminal} == {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled}
    assert all(s not in ALLOWED for s in TERMINAL)


# The allowed moves, written out independently of service.domain.states.ALLOWED.
EXPECTED_MOVES = {
    ("validating_files", "queued"), ("validating_files", "failed"), ("validating_files", "cancelled"),
    ("queued", "running"), ("queued", "failed"), ("queued", "cancelled"), ("queued", "paused"),
    ("running", "succeeded"), ("running", "failed"), ("running", "cancelled"), ("running", "paused"),
    ("running", "queued"),
    ("paused", "queued"), ("paused", "cancelled"),
}


def test_allowed_table_is_the_documented_one():
    assert {(s.value, t.value) for s, targets in ALLOWED.items() for t in targets} == EXPECTED_MOVES


@pytest.mark.parametrize("source", list(JobStatus))
@pytest.mark.parametrize("target", list(JobStatus))
def test_transition_table_is_enforced(sessions, source, target):
    job_id = make_job(sessions, source)
    allowed = (source.value, target.value) in EXPECTED_MOVES
    with session_scope(sessions) as s:
        if allowed:
            job = transition(s, job_id, target)
            assert job.status == target.value
            assert (job.finished_at is not None) == target.terminal
        else:
            with pytest.raises(InvalidTransition) as exc:
                transition(s, job_id, target)
            assert exc.value.current == source.value and exc.value.to == target.value
    assert status_of(sessions, job_id) == (target if allowed else source).value


def test_transition_is_fenced_on_attempt(sessions):
    job_id = make_job(sessions, JobStatus.running, attempt=2)
    with session_scope(sessions) as s:
        with pytest.raises(StaleAttempt) as exc:
            transition(s, job_id, JobStatus.succeeded, expected_attempt=1)
        assert (exc.value.expected, exc.value.actual) == (1, 2)
    assert status_of(sessions, job_id) == "running"
    with session_scope(sessions) as s:
        job = transition(s, job_id, JobStatus.succeeded, expected_attempt=2, fine_tuned_model="ft:x", trained_tokens=9)
        assert (job.fine_tuned_model, job.trained_tokens) == ("ft:x", 9)
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)).all()
        assert [(e.message, e.data, e.attempt) for e in events] == [
            ("The job has successfully completed", {"status": "succeeded"}, 2)]


def test_transition_unknown_job_and_bad_fields(sessions):
    with session_scope(sessions) as s:
        with pytest.raises(JobNotFound):
            transition(s, "ftjob-missing", JobStatus.queued)
        with pytest.raises(TypeError):
            transition(s, "ftjob-missing", JobStatus.queued, tenant_id="org-x")


def test_update_job_is_fenced(sessions):
    job_id = make_job(sessions, JobStatus.running, attempt=3)
    with session_scope(sessions) as s:
        with pytest.raises(StaleAttempt):
            jobs.update_job(s, job_id, expected_attempt=2, ray_status="RUNNING")
        job = jobs.update_job(s, job_id, expected_attempt=3, ray_status="RUNNING", plan={"peak_bytes": 1})
        assert job.ray_status == "RUNNING" and job.plan == {"peak_bytes": 1}
        with pytest.raises(TypeError):
            jobs.update_job(s, job_id, status="failed")


def test_racing_writers_only_one_wins(sessions):
    """Eight threads try queued → running at once; the conditional UPDATE lets exactly one through."""
    job_id = make_job(sessions, JobStatus.queued)
    results: list[str] = []
    barrier = threading.Barrier(8)

    def claim():
        barrier.wait()
        try:
            with session_scope(sessions) as s:
                transition(s, job_id, JobStatus.running)
            results.append("won")
        except InvalidTransition:
            results.append("lost")

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 7 + ["won"]


def test_events_checkpoints_and_memory_samples_dedupe(sessions):
    job_id = make_job(sessions, JobStatus.running, attempt=1)
    with session_scope(sessions) as s:
        batch = [{"message": f"step {i}", "type": "metrics", "dedupe_key": f"metrics:1:0:{i}", "attempt": 1} for i in range(3)]
        assert jobs.add_events(s, job_id, batch) == 3
        assert jobs.add_events(s, job_id, batch) == 0  # a retried ingest post
        assert jobs.add_event(s, job_id, "no key") and jobs.add_event(s, job_id, "no key")  # no key: never deduped
        ids = [e.id for e in jobs.events_since(s, job_id, 0)]
        assert ids == sorted(ids) and len(ids) == 5
        assert [e.message for e in jobs.events_since(s, job_id, ids[2])] == ["no key", "no key"]
        recs = [MemoryRecord(attempt=1, time=0.0, rank=r, step=1, parameters_bytes=100, peak_bytes=500) for r in (0, 1)]
        assert jobs.add_memory_samples(s, job_id, recs) == 2
        assert jobs.add_memory_samples(s, job_id, recs) == 0
        assert jobs.add_memory_samples(s, job_id, [MemoryRecord(attempt=2, time=0.0, rank=0, step=1)]) == 1
        rows = jobs.list_memory_samples(s, job_id, attempt=1)
        assert [(m.rank, m.parameters_bytes, m.peak_bytes) for m in rows] == [(0, 100, 500), (1, 100, 500)]
        assert jobs.add_checkpoint(s, job_id, attempt=1, step=5, path="/c5")
        assert not jobs.add_checkpoint(s, job_id, attempt=1, step=5, path="/c5b")
        assert jobs.latest_checkpoint(s, job_id).path == "/c5"
    with session_scope(sessions) as s:
        assert s.scalar(select(MemorySample.id).where(MemorySample.job_id == job_id, MemorySample.attempt == 2))


def test_api_keys_hashed_prefixed_revocable(sessions):
    with session_scope(sessions) as s:
        issued = auth.create_key(s, f"acme-{secrets.token_hex(3)}")
    assert issued.key.startswith("mf_live_") and len(issued.key) >= len("mf_live_") + 43  # 32 random bytes
    assert issued.prefix == issued.key[:16]
    with session_scope(sessions) as s:
        row = s.scalar(select(ApiKey).where(ApiKey.prefix == issued.prefix))
        assert row.hash == auth.hash_key(issued.key) and issued.key not in (row.hash, row.prefix)
        assert auth.authenticate(s, f"Bearer {issued.key}").tenant_id == issued.tenant_id
        with pytest.raises(Unauthorized):
            auth.authenticate(s, f"Bearer {issued.key}x")
        with pytest.raises(Unauthorized):
            auth.authenticate(s, None)
        # A second key for the same tenant name reuses the tenant.
        assert auth.create_key(s, issued.tenant_name).tenant_id == issued.tenant_id
    with session_scope(sessions) as s:
        auth.revoke_key(s, issued.prefix)
    with session_scope(sessions) as s:
        with pytest.raises(Unauthorized) as exc:
            auth.authenticate(s, f"Bearer {issued.key}")
        assert exc.value.code == "revoked_api_key"
