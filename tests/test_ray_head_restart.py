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
2. **a surviving attempt** — memfit is pointed at another Ray cluster while attempt 1 still runs on
   the first (what a head restart that loses track of a run still running on a worker node looks
   like to the scheduler). Attempt 2 runs on the new cluster; attempt 1 runs on, and everything it
   posts after the requeue is refused (its ingest token was replaced), its files stay in
   ``attempts/1``, and the job's result, artefacts and checkpoints are attempt 2's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from service.scheduler.local_head import LocalRayHead
from service.scheduler.paths import attempt_dir, spool_path, submission_id
from service.scheduler.ray_jobs import RAY_ACTIVE, RayJobs
from service.store.models import Checkpoint, Job, JobEvent
from tests.test_e2e import Stack, training

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 24
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
        try:
            job_id = stack.create(hyperparameters={"max_steps": STEPS}, checkpoint_every_steps=4)
            resumed_at = wait_for_checkpoint(stack, job_id, 4)

            head.stop()  # the whole head: GCS, raylet, dashboard, the driver and its workers
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


def test_an_attempt_still_running_elsewhere_is_fenced_off(new_database, tmp_path, ray_head, own_head):
    with new_database() as url:
        stack = Stack(url, tmp_path / "storage", ray_head)  # attempt 1 runs on the session's head
        stack.start_scheduler()
        first = stack.ray
        try:
            job_id = stack.create(hyperparameters={"max_steps": 60}, checkpoint_every_steps=4,
                                  resources={"num_workers": 1})
            wait_for_checkpoint(stack, job_id, 4)

            # memfit is pointed at another cluster; the first keeps running attempt 1.
            stack.stop_scheduler()  # releases its leases: the next scheduler adopts at once
            other = own_head()
            stack.ray = RayJobs(other.dashboard_url)
            stack.start_scheduler()

            def on_attempt_2():
                with stack.app.state.sessions() as s:
                    return s.get(Job, job_id).attempt == 2
            stack.wait_until(on_attempt_2, 300, "attempt 2 to be claimed", job_id=job_id)
            with stack.app.state.sessions() as s:
                requeued_at = s.scalar(select(JobEvent.id).where(
                    JobEvent.job_id == job_id, JobEvent.message == "Job queued").order_by(JobEvent.id.desc()).limit(1))
            assert first.status(submission_id(job_id, 1)).status in RAY_ACTIVE  # it really survives

            job = stack.wait(job_id, ("succeeded",), timeout=900)
            spool_1 = spool_path(stack.settings, job_id, 1)
            with stack.app.state.sessions() as s:
                late = s.scalars(select(JobEvent.data).where(
                    JobEvent.job_id == job_id, JobEvent.attempt == 1, JobEvent.id > requeued_at)).all()
                checkpoints = s.execute(select(Checkpoint.attempt, Checkpoint.path).where(Checkpoint.job_id == job_id)).all()
                row = s.get(Job, job_id)
            # Attempt 1 went on posting (its spool grew past the requeue) and none of it was stored.
            posted_after = [json.loads(line) for line in spool_1.read_text().splitlines()]
            assert max(r.get("step") or 0 for r in posted_after if r.get("kind") == "metrics") > first_step_of(
                stack, job_id, 2), "attempt 1 did not outlive the requeue: nothing was fenced"
            assert late == [], late
            assert row.output_dir == str(attempt_dir(stack.settings, job_id, 2))
            for attempt, path in checkpoints:  # every checkpoint lies in the folder of the attempt that made it
                assert Path(path).is_relative_to(attempt_dir(stack.settings, job_id, attempt)), (attempt, path)
            assert all(Path(p).is_relative_to(attempt_dir(stack.settings, job_id, 2))
                       for p in stack.artifacts(job).values())
            assert set(RayJobs(other.dashboard_url).submissions_of(job_id)) == {submission_id(job_id, 2)}
            assert_status_never_went_backwards(stack, job_id, requeues=1)
        finally:
            try:
                first.stop(submission_id(job_id, 1))
                deadline = time.monotonic() + 60
                while first.status(submission_id(job_id, 1)).status in RAY_ACTIVE and time.monotonic() < deadline:
                    time.sleep(0.5)
            finally:
                stack.close()
