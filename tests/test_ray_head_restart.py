"""The Ray head goes away mid-job, and an earlier attempt that survives elsewhere cannot touch the job.

Real Postgres, the real API on a port, real Ray heads of this test's own (one is killed), real
training on CPU. The invariant of every fault test: no job lost, none run twice (one Ray submission
per attempt), no metric lost or duplicated (per attempt, every (rank, step) once, the new attempt
starting right after the checkpoint it resumed from), status never going backwards (the only way
back is the scheduler's own requeue, running → queued, each time with its reason).

1. **head restart** — the head (GCS, raylet, dashboard, the job's driver and workers: a pod
   restart) is killed while the job trains and a new one is started at the same address. The
   scheduler keeps asking; the new head does not know ``memfit-<id>-1``; after three such answers
   over ten seconds the job is requeued and attempt 2, in a folder of its own, resumes from the
   latest checkpoint the database recorded (hard-linked into ``attempts/2/resume``).
2. **a surviving attempt** — attempt 1 trains on the cluster while the Jobs API does not know it
   (what a head restart that loses track of a run still training on a worker node looks like to the
   scheduler). Attempt 2 is submitted; attempt 1 trains on, and everything it posts after the
   requeue is refused (its ingest token was replaced), its files stay in ``attempts/1``, and the
   job's result, artefacts and checkpoints are attempt 2's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from service.scheduler.local_head import LocalRayHead, ray_env
from service.scheduler.paths import attempt_dir, request_path, spool_path, submission_id
from service.scheduler.ray_jobs import RayJobs
from service.store.models import Checkpoint, Job, JobEvent
from tests.stack import Stack

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 40  # the kill comes at a checkpoint of step >= 4: >= 36 steps left for it to land in
FORWARD = {"validating_files": 0, "queued": 1, "running": 2, "succeeded": 3, "failed": 3, "cancelled": 3}


def status_events(stack: Stack, job_id: str) -> list[tuple[str, dict]]:
    with stack.app.state.sessions() as s:
        rows = s.execute(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "message")
                         .order_by(JobEvent.id)).scalars().all()
    return [(d["status"], d) for d in rows if d and "status" in d]


def assert_status_never_went_backwards(stack: Stack, job_id: str, requeues: int) -> None:
    """Forward only, except the scheduler's requeue (running → queued), each with a reason."""
    seen = status_events(stack, job_id)
    back = []
    for (prev, _), (now, data) in zip(seen, seen[1:]):
        if FORWARD[now] < FORWARD[prev]:
            assert (prev, now) == ("running", "queued") and data.get("reason"), (prev, now, data)
            back.append(data["reason"])
    assert len(back) == requeues, seen
    assert seen[-1][0] == "succeeded", seen


def metrics_by_attempt(stack: Stack, job_id: str) -> dict[int, list[tuple[int, int]]]:
    with stack.app.state.sessions() as s:
        rows = s.execute(select(JobEvent.attempt, JobEvent.data).where(
            JobEvent.job_id == job_id, JobEvent.type == "metrics")).all()
    out: dict[int, list[tuple[int, int]]] = {}
    for attempt, data in rows:
        out.setdefault(attempt, []).append((data["rank"], data["step"]))
    return out


def wait_for_checkpoint(stack: Stack, job_id: str, at_least_step: int) -> int:
    def checkpointed():
        with stack.app.state.sessions() as s:
            step = s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id)
                            .order_by(Checkpoint.step.desc()).limit(1))
        return step if step is not None and step >= at_least_step else None

    return stack.wait_until(checkpointed, 600, f"a checkpoint at step >= {at_least_step}", job_id=job_id)


def first_step_of(stack: Stack, job_id: str, attempt: int) -> int:
    lines = spool_path(stack.settings, job_id, attempt).read_text().splitlines()
    return min(r["step"] for r in map(json.loads, lines) if r.get("kind") == "metrics")


@pytest.fixture
def own_head(tmp_path):
    """A Ray head of this test's own: it is killed, and started again at the same ports."""
    heads: list[LocalRayHead] = []

    def start(like: LocalRayHead | None = None) -> LocalRayHead:
        ports = {"gcs_port": like.gcs_port, "dashboard_port": like.dashboard_port} if like else {}
        head = LocalRayHead(num_cpus=8, log_path=tmp_path / f"head-{len(heads)}.log", **ports).start()
        heads.append(head)
        return head

    yield start
    for head in heads:
        head.stop()


def test_the_head_restarts_mid_job_and_attempt_2_resumes_from_the_latest_checkpoint(new_database, tmp_path,
                                                                                    own_head, artifacts_dir):
    head = own_head()
    with new_database() as url:
        stack = Stack(url, tmp_path / "storage", head)
        stack.start_scheduler()
        # Half a second after each step (workers/steps.py: MEMFIT_WORKER_STEP_PAUSE_S, no CPU used): on a loaded
        # machine the 36 tiny steps after the first checkpoint once ended before the head was killed.
        stack.scheduler.extra_env["MEMFIT_WORKER_STEP_PAUSE_S"] = "0.5"
        try:
            job_id = stack.create(hyperparameters={"max_steps": STEPS}, checkpoint_every_steps=4)
            resumed_at = wait_for_checkpoint(stack, job_id, 4)

            # The whole head at once, as a pod restart does: GCS, raylet, dashboard, the driver and its
            # workers, SIGKILLed together. A graceful stop (SIGTERM to `ray start`, up to 10 s) could let
            # the tiny run's last steps finish first on a loaded machine, and attempt 1 then succeed.
            head.ownership.end(timeout_s=10.0)
            head.stop()
            head = own_head(like=head)  # a new head at the same address, knowing no jobs

            job = stack.wait(job_id, ("succeeded",), timeout=900)
            with stack.app.state.sessions() as s:
                row = s.get(Job, job_id)
                assert row.attempt == 2
                assert Path(row.output_dir) == attempt_dir(stack.settings, job_id, 2)
                latest_recorded_before = s.scalar(select(Checkpoint.step).where(
                    Checkpoint.job_id == job_id, Checkpoint.attempt == 1).order_by(Checkpoint.step.desc()).limit(1))
            messages = [e["message"] for e in stack.events(job_id)]
            reasons = [d.get("reason") for status, d in status_events(stack, job_id) if status == "queued"]
            assert "ray_submission_missing" in reasons, messages
            resume_note = next(m for m in messages if m.startswith("Attempt 2 resumes from the checkpoint of step"))
            resumed_at = int(resume_note.split("step ")[1].split(" ")[0])
            assert resumed_at == latest_recorded_before >= 4, (resume_note, latest_recorded_before)
            assert f"Resumed from the checkpoint of step {resumed_at}" in messages

            # None run twice: the new head has attempt 2 only, once.
            assert set(RayJobs(head.dashboard_url).submissions_of(job_id)) == {submission_id(job_id, 2)}
            # No metric lost or duplicated: per attempt every (rank, step) once; attempt 2 from the
            # step after its checkpoint to the end, on both ranks.
            by_attempt = metrics_by_attempt(stack, job_id)
            for attempt, keys in by_attempt.items():
                assert len(keys) == len(set(keys)), (attempt, sorted(keys))
            assert sorted(by_attempt[2]) == [(r, s) for r in range(2) for s in range(resumed_at + 1, STEPS + 1)]
            assert first_step_of(stack, job_id, 2) == resumed_at + 1
            assert_status_never_went_backwards(stack, job_id, requeues=1)

            # The result is attempt 2's: its folder is what the artefacts route serves.
            artifacts = stack.artifacts(job)
            assert artifacts and all(Path(p).is_relative_to(attempt_dir(stack.settings, job_id, 2))
                                     for p in artifacts.values()), artifacts
            assert (attempt_dir(stack.settings, job_id, 2) / "resume" / "meta.json").is_file()
        finally:
            stack.close()


def test_an_attempt_ray_lost_track_of_that_still_runs_is_fenced_off(new_database, tmp_path, ray_head,
                                                                   artifacts_dir):
    """Attempt 1's driver runs on the cluster without the Jobs API knowing it (a scheduler claimed the
    job, wrote the run request and was SIGKILLed before submitting; the run was then started by hand
    from that request — what a head restart that lost a run still training elsewhere looks like)."""
    from tests.test_scheduler_faults import killed_at, scheduler_process

    with new_database() as url:
        stack = Stack(url, tmp_path / "storage", ray_head)
        driver = None
        try:
            job_id = stack.create(hyperparameters={"max_steps": 150}, checkpoint_every_steps=4,
                                  resources={"num_workers": 1})
            marker, log = tmp_path / "at-point", artifacts_dir / "scheduler-lost-run.log"
            killed_at(scheduler_process(url, stack.settings.storage_dir, ray_head, stack.server.url,
                                        "before_submit", marker, log), marker, log)
            with open(artifacts_dir / "lost-run-driver.log", "ab") as out:
                driver = subprocess.Popen(
                    [sys.executable, "-m", "workers.run", str(request_path(stack.settings, job_id, 1))],
                    cwd=ROOT, env={**ray_env(), "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_head.address},
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            wait_for_checkpoint(stack, job_id, 4)
            assert stack.ray.status(submission_id(job_id, 1)) is None  # the Jobs API never had it

            stack.start_scheduler()  # adopts it, finds no submission (three times, ten seconds): attempt 2

            def on_attempt_2():
                with stack.app.state.sessions() as s:
                    return s.get(Job, job_id).attempt == 2
            stack.wait_until(on_attempt_2, 300, "attempt 2 to be claimed", job_id=job_id)
            with stack.app.state.sessions() as s:
                requeued_at = s.scalar(select(JobEvent.id).where(
                    JobEvent.job_id == job_id, JobEvent.message == "Job queued").order_by(JobEvent.id.desc()).limit(1))
            assert driver.poll() is None  # attempt 1 really survives the requeue

            job = stack.wait(job_id, ("succeeded",), timeout=900)
            with stack.app.state.sessions() as s:
                late = s.scalars(select(JobEvent.data).where(
                    JobEvent.job_id == job_id, JobEvent.attempt == 1, JobEvent.id > requeued_at)).all()
                checkpoints = s.execute(select(Checkpoint.attempt, Checkpoint.path).where(Checkpoint.job_id == job_id)).all()
                row = s.get(Job, job_id)
            # Attempt 1 went on training past where attempt 2 started, and none of what it posted since
            # the requeue was stored.
            spooled_1 = [json.loads(line) for line in spool_path(stack.settings, job_id, 1).read_text().splitlines()]
            assert max(r.get("step") or 0 for r in spooled_1 if r.get("kind") == "metrics") > first_step_of(
                stack, job_id, 2), "attempt 1 did not outlive the requeue: nothing was fenced"
            assert late == [], late
            assert row.output_dir == str(attempt_dir(stack.settings, job_id, 2))
            for attempt, path in checkpoints:  # each stored relative to the folder of the attempt that made it
                assert not Path(path).is_absolute() and ".." not in Path(path).parts, (attempt, path)
                assert (attempt_dir(stack.settings, job_id, attempt) / path).is_relative_to(
                    attempt_dir(stack.settings, job_id, attempt)), (attempt, path)
            assert {a for a, _ in checkpoints} == {1, 2}
            assert all(Path(p).is_relative_to(attempt_dir(stack.settings, job_id, 2))
                       for p in stack.artifacts(job).values())
            assert set(stack.ray.submissions_of(job_id)) == {submission_id(job_id, 2)}
            assert_status_never_went_backwards(stack, job_id, requeues=1)
        finally:
            if driver is not None and driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(30)
            stack.close()
