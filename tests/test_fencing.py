"""Fencing all the way to Ray (issue 37, item 5): a scheduler acts on Ray only under a lease it holds
at that moment, and a late submission is stopped by the next scheduler that sees it.

Real Postgres, the session's real Ray head, real Ray submissions; the runs are `sleep` entrypoints (what
runs does not matter here, only who may start and stop it), so nothing trains. "Stale" is a scheduler
whose lease ran out without it noticing (a long GC pause, a stopped VM): its lease is moved into the past
in the database, exactly what time does to it.

- submit: a stale scheduler that built the run request under its lease does not submit once the lease
  is gone (before this, submit() read the owner without checking the lease and submitted);
- stop: a stale scheduler does not stop the run it no longer owns for a pause, nor for a stall (before
  this, both stopped the Ray job first and only then found their database write fenced);
- a late submission: an earlier attempt that appears in Ray while a newer one runs is stopped by the
  scheduler that owns the newer one, the next time it looks.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from service.domain.states import JobStatus
from service.scheduler.loop import Scheduler, _Watch
from service.scheduler.paths import submission_id
from service.scheduler.ray_jobs import RAY_ACTIVE, RayJobs
from service.store.models import Job, utcnow
from service.store.transitions import transition
from tests.factories import bearer, create_job, new_key, settings_for, upload

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory, ray_head):
    with new_database() as url:
        settings = settings_for(url, tmp_path_factory.mktemp("storage"), lease_seconds=6)
        app = create_app(settings)
        with TestClient(app) as client:
            key = new_key(app.state.sessions)
            yield app, client, settings, key, upload(client, key), ray_head
        app.state.engine.dispose()


def claimed(env, owner: str, **training) -> tuple[str, int, str, Scheduler]:
    app, client, settings, key, file_id, head = env
    job_id = create_job(client, key, file_id, training or None)["id"]
    sched = Scheduler(app.state.sessions, settings, RayJobs(head.dashboard_url), owner=owner, batch=100)
    Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"), owner="validator", batch=100).validate_pending()
    [(attempt, token)] = [(a, t) for j, a, t in sched.claim(limit=100) if j == job_id]
    return job_id, attempt, token, sched


def expire_lease(app, job_id: str) -> None:
    with app.state.sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def sleeper(head, sid: str, job_id: str) -> None:
    """A run under ``sid`` that only sleeps (what the scheduler would have started, minus the training)."""
    RayJobs(head.dashboard_url, ship_code=False, entrypoint_num_cpus=0).submit(sid, "sleep 120", {}, {"memfit_job_id": job_id})


def ray_status(head, sid: str) -> str | None:
    st = RayJobs(head.dashboard_url).status(sid)
    return None if st is None else st.status


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_quietly(head, *sids: str) -> None:
    for sid in sids:
        try:
            RayJobs(head.dashboard_url).stop(sid)
        except Exception:  # noqa: BLE001 - cleanup
            pass


def test_a_stale_scheduler_does_not_submit(env):
    app, *_, head = env
    job_id, attempt, token, stale = claimed(env, "stale-submitter")
    expire_lease(app, job_id)  # the lease ran out before the submission went out
    sid = submission_id(job_id, attempt)
    try:
        stale.submit(job_id, attempt, token)
        assert ray_status(head, sid) is None, "a scheduler without the lease submitted to Ray"
        # the one that adopts it next acts: it finds no submission (and in time requeues a new attempt)
        fresh = Scheduler(app.state.sessions, stale.settings, RayJobs(head.dashboard_url), owner="adopter")
        assert job_id in fresh.adopt_expired()
    finally:
        stop_quietly(head, sid)
        with app.state.sessions.begin() as s:
            transition(s, job_id, JobStatus.cancelled, expected_attempt=attempt, lease_owner=None)


def test_a_stale_scheduler_does_not_stop_the_run_for_a_pause_or_a_stall(env):
    app, client, settings, key, _, head = env
    job_id, attempt, _, stale = claimed(env, "stale-stopper")
    sid = submission_id(job_id, attempt)
    sleeper(head, sid, job_id)
    try:
        wait_for(lambda: ray_status(head, sid) == "RUNNING", 60, "the run to start")
        expire_lease(app, job_id)
        # a stall seen by the stale scheduler: steps stopped long ago
        now = time.monotonic()
        watch = _Watch(progress_of=attempt, first_step=(1, now - 100), last_step=(2, now - 50), stall_limits=(1.0, 1))
        with app.state.sessions.begin() as s:
            from service.jobs import series
            series.add(s, job_id, series.METRICS, [series.metrics_sample(attempt, {"step": 2, "rank": 0, "time": 1.0})])
        stale._stalled(job_id, attempt, sid, watch)
        time.sleep(3)  # a stop takes a moment to show
        assert ray_status(head, sid) in RAY_ACTIVE, "a stale scheduler stopped the run for a stall"
        # a pause seen by the stale scheduler (a cancel ends the job at once; its run is then stopped by
        # any scheduler, as every terminal job's is: no lease is involved)
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=bearer(key)).status_code == 200
        stale.pause_timeout_s = 0
        for _ in range(2):  # the first look notes the pause, the second stops the run at once
            stale.reconcile()
        time.sleep(2)
        assert ray_status(head, sid) in RAY_ACTIVE, "a stale scheduler stopped the run for a pause"
        # the scheduler that holds the lease does stop it
        owner = Scheduler(app.state.sessions, settings, RayJobs(head.dashboard_url), owner="owner", pause_timeout_s=0)
        assert job_id in owner.adopt_expired()
        for _ in range(2):
            owner.reconcile()
        wait_for(lambda: ray_status(head, sid) == "STOPPED", 60, "the owner's stop")
    finally:
        stop_quietly(head, sid)


def test_a_late_submission_of_an_earlier_attempt_is_stopped(env):
    app, _, settings, _, _, head = env
    job_id, attempt, _, first = claimed(env, "first-owner")
    with app.state.sessions.begin() as s:  # attempt 1 was given up; attempt 2 is claimed by another scheduler
        transition(s, job_id, JobStatus.queued, expected_attempt=attempt, lease_owner=None)
        transition(s, job_id, JobStatus.running, expected_attempt=attempt, attempt=attempt + 1, lease_owner="second-owner",
                   lease_expires_at=utcnow() + timedelta(seconds=60))
    current, late = submission_id(job_id, attempt + 1), submission_id(job_id, attempt)
    sleeper(head, current, job_id)
    sleeper(head, late, job_id)  # the first owner's submission of attempt 1, arriving late
    try:
        wait_for(lambda: ray_status(head, late) == "RUNNING" and ray_status(head, current) == "RUNNING", 60, "both runs")
        second = Scheduler(app.state.sessions, settings, RayJobs(head.dashboard_url), owner="second-owner", late_check_s=0)
        second.reconcile()
        wait_for(lambda: ray_status(head, late) == "STOPPED", 60, "the late submission to be stopped")
        assert ray_status(head, current) == "RUNNING"  # the current attempt runs on
    finally:
        stop_quietly(head, current, late)


def test_a_run_lost_twice_is_resubmitted_once_then_failed_by_the_cap(env):
    """The exit-75 path and the resubmission cap (issue 37, item 6): a driver that exits
    RUN_LOST_EXIT_CODE (workers/run.py: Ray lost the run under it) reports nothing; the scheduler
    requeues the job as a new attempt (reason ray_run_lost) — until max_lost_runs such losses, when it
    fails ray_run_lost instead of looping. The runs are `exit 75` entrypoints (what a lost run's driver
    does), so nothing trains."""
    app, _, settings, _, _, head = env
    job_id, attempt, _, sched = claimed(env, "cap-owner")
    sched.max_lost_runs, sched.result_grace_s = 1, 0.0
    lost = RayJobs(head.dashboard_url, ship_code=False, entrypoint_num_cpus=0)

    def lose(n: int) -> None:
        lost.submit(submission_id(job_id, n), "sh -c 'exit 75'", {}, {"memfit_job_id": job_id})
        wait_for(lambda: ray_status(head, submission_id(job_id, n)) == "FAILED", 60, f"attempt {n}'s driver to exit 75")

    lose(attempt)
    wait_for(lambda: sched.reconcile() or status_of(app, job_id) == "queued", 60, "the requeue")
    with app.state.sessions() as s:
        requeue = s.scalars(select_events(job_id)).all()
    assert any((d or {}).get("reason") == "ray_run_lost" and "75" in str(d) for d in requeue), requeue
    [(again, _)] = [(a, t) for j, a, t in sched.claim(limit=100) if j == job_id]  # attempt 2, as the next tick would
    assert again == attempt + 1
    lose(again)
    wait_for(lambda: sched.reconcile() or status_of(app, job_id) == "failed", 60, "the cap")
    with app.state.sessions() as s:
        error = s.get(Job, job_id).error
    assert error["code"] == "ray_run_lost" and "already resubmitted 1 times" in error["message"], error


def status_of(app, job_id: str) -> str:
    with app.state.sessions() as s:
        return s.get(Job, job_id).status


def select_events(job_id: str):
    from sqlalchemy import select

    from service.store.models import JobEvent

    return select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "message")
