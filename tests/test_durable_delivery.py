"""Nothing a finished run produced is lost when the API is away.

The run's sink spools every record to ``metrics-attempt-N.jsonl`` before posting it; when Ray says the
run ended with part of its spool undelivered, the scheduler stores that part through service.jobs.ingest
— the same fencing and dedupe keys as the API — instead of failing the job ``missing_result``.

- replay on its own (real Postgres, no Ray): what the API already holds is not stored twice, the
  result ends the job, the records of an old attempt are refused;
- end to end (real Ray, real training): `memfit serve` — API and scheduler in one process — stopped
  for longer than the run has left and started again; and the API alone stopped while a scheduler
  keeps running. Both jobs end ``succeeded`` with every metric and memory sample stored exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from service.scheduler.local_head import free_port, ray_env
from service.scheduler.paths import spool_path, submission_id
from service.scheduler.ray_jobs import RAY_TERMINAL, RayJobs
from service.store import db
from service.store import spool as spool_file
from service.store.models import Checkpoint, Job, JobEvent, MemorySample
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import LiveServer, app_without_ray

ROOT = Path(__file__).resolve().parent.parent
INGEST = "/v1/internal/jobs/{}/ingest"


# --- replay, without Ray ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


def running_job(env) -> tuple[str, str]:
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]]


def run_records(attempt: int, steps: int = 4, ranks: int = 2) -> list[dict]:
    """What a run's sink spools: per step and rank a metrics and a memory record, a checkpoint every
    second step, one event without a dedupe key, then the result."""
    now = time.time()
    out: list[dict] = []
    for step in range(1, steps + 1):
        for rank in range(ranks):
            out.append({"kind": "metrics", "attempt": attempt, "time": now + step, "rank": rank, "step": step,
                        "total_steps": steps, "loss": 4.0 / step, "trained_tokens": 64 * step})
            out.append({"kind": "memory", "attempt": attempt, "time": now + step, "rank": rank, "step": step,
                        "phase": "step", "source": "counters", "parameters_bytes": 1000, "peak_bytes": 5000 + step})
        if step % 2 == 0:
            out.append({"kind": "checkpoint", "attempt": attempt, "time": now + step, "step": step,
                        "path": f"ray/ckpt/{step}", "metrics": {"loss": 4.0 / step}})
    out.append({"kind": "event", "attempt": attempt, "time": now + steps, "level": "warn",
                "message": f"a warning of attempt {attempt}"})
    out.append({"kind": "result", "attempt": attempt, "time": now + steps + 1, "fine_tuned_model": "ft:tiny:replayed",
                "artifacts": {}, "trained_tokens": 64 * steps * ranks})
    return out


def line_offset(path: Path, n: int) -> int:
    """The byte offset where line ``n`` (0-based) of the spool starts."""
    data = path.read_bytes()
    at = 0
    for _ in range(n):
        at = data.index(b"\n", at) + 1
    return at


def stored(app, job_id: str) -> dict:
    with app.state.sessions() as s:
        job = s.get(Job, job_id)
        return {
            "status": job.status,
            "attempt": job.attempt,
            "fine_tuned_model": job.fine_tuned_model,
            "metrics": sorted((d["rank"], d["step"]) for d in s.scalars(
                select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))),
            "memory": sorted(s.execute(select(MemorySample.rank, MemorySample.step, MemorySample.phase)
                                       .where(MemorySample.job_id == job_id)).all()),
            "checkpoints": sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))),
            "messages": Counter(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id,
                                                                         JobEvent.type == "message"))),
        }


def test_replay_stores_what_the_api_missed_exactly_once_and_the_result_ends_the_job(env):
    app, client, sched = env
    job_id, token = running_job(env)
    path = spool_path(sched.settings, job_id, 1)
    records = run_records(1)
    spool_file.append(path, records)
    # The sink had delivered the first 7 records, but recorded its offset only after 3 of them.
    r = client.post(INGEST.format(job_id), json={"records": records[:7]}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    spool_file.mark_delivered(path, line_offset(path, 3))

    assert sched._replay_spool(job_id, 1) == "succeeded"
    got = stored(app, job_id)
    assert got["fine_tuned_model"] == "ft:tiny:replayed"
    assert got["metrics"] == [(rank, step) for rank in range(2) for step in range(1, 5)]
    assert got["memory"] == [(rank, step, "step") for rank in range(2) for step in range(1, 5)]
    assert got["checkpoints"] == [2, 4]
    assert got["messages"]["a warning of attempt 1"] == 1
    assert got["messages"]["The job has successfully completed"] == 1
    assert spool_file.delivered_offset(path) == path.stat().st_size

    # Its delivered offset lost, the spool is read again from the start: the job is terminal and
    # takes nothing, and nothing changes.
    spool_file.delivered_path(path).unlink()
    assert sched._replay_spool(job_id, 1) == "succeeded"
    assert stored(app, job_id) == got


def test_replay_keeps_the_fencing_records_of_an_old_attempt_are_refused(env):
    app, _, sched = env
    job_id, _ = running_job(env)
    spool_file.append(spool_path(sched.settings, job_id, 1), run_records(1)[:4])  # attempt 1's run, cut short
    sched._vanished(job_id, 1, submission_id(job_id, 1), "ray_submission_missing")  # Ray lost it: back to the queue …
    assert stored(app, job_id)["metrics"] == [(0, 1), (1, 1)]  # … after storing what it had spooled
    [(claimed, attempt, _)] = [c for c in sched.claim(limit=100) if c[0] == job_id]
    assert attempt == 2

    # Attempt 1's spool now holds its result (a zombie kept writing): refused, the job keeps running.
    spool_file.append(spool_path(sched.settings, job_id, 1), run_records(1))
    assert sched._replay_spool(job_id, 1) == "running"
    # So are attempt-1 records found in attempt 2's spool.
    spool_file.append(spool_path(sched.settings, job_id, 2), run_records(1))
    assert sched._replay_spool(job_id, 2) == "running"
    got = stored(app, job_id)
    assert (got["status"], got["attempt"], got["metrics"]) == ("running", 2, [(0, 1), (1, 1)])


def test_replay_with_no_spool_changes_nothing(env):
    app, _, sched = env
    job_id, _ = running_job(env)
    before = stored(app, job_id)
    assert sched._replay_spool(job_id, 1) == "running"
    assert stored(app, job_id) == before


# --- end to end: real Ray, real training ---------------------------------------------------------

STEPS = 40
TRAINING = {"hyperparameters": {"max_steps": STEPS, "micro_batch_size": 2, "max_seq_length": 64,
                                "learning_rate": 0.003},
            "resources": {"num_workers": 2}, "checkpoint_every_steps": 10}
RANKS = TRAINING["resources"]["num_workers"]


def chat_rows() -> list[dict]:
    import json

    return [json.loads(line) for line in (ROOT / "examples" / "data" / "chat.jsonl").read_text().splitlines()
            if line.strip()]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def spooled(path: Path) -> dict:
    """What the run's spool holds, as the store counts it."""
    import json

    records = [json.loads(line) for line in path.read_text().splitlines()]
    memory = [(r["rank"], r["step"], r.get("phase", "step")) for r in records if r["kind"] == "memory"]
    assert len(memory) == len(set(memory))  # one sample per key: a row per record, exactly
    return {"metrics": sorted({(r["rank"], r["step"]) for r in records if r["kind"] == "metrics"}),
            "memory": sorted(memory),
            "checkpoints": sorted({r["step"] for r in records if r["kind"] == "checkpoint"}),
            "results": sum(r["kind"] == "result" for r in records)}


def assert_stored_exactly_once(sessions, job_id: str, spool: Path) -> None:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job.status == "succeeded", job.error
        assert job.fine_tuned_model and job.error is None
        metrics = [(d["rank"], d["step"]) for d in s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))]
        memory = s.execute(select(MemorySample.rank, MemorySample.step, MemorySample.phase)
                           .where(MemorySample.job_id == job_id)).all()
        checkpoints = list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
        completed = s.scalar(select(func.count()).where(JobEvent.job_id == job_id,
                                                        JobEvent.message == "The job has successfully completed"))
        replayed = list(s.scalars(select(JobEvent.message).where(
            JobEvent.job_id == job_id, JobEvent.message.like("Storing % bytes of records from the run's spool%"))))
    held = spooled(spool)
    assert held["results"] == 1
    assert sorted(metrics) == held["metrics"] == [(r, s) for r in range(RANKS) for s in range(1, STEPS + 1)]
    assert len(metrics) == STEPS * RANKS
    assert sorted(memory) == held["memory"] and len(memory) == len(held["memory"])
    assert sorted(checkpoints) == held["checkpoints"] == [10, 20, 30, 40]
    assert completed == 1
    assert replayed, "the scheduler never had to replay: the API did not miss the end of the run"
    assert spool_file.pending_bytes(spool) == 0


class Serve:
    """A real `memfit serve` (API + scheduler in one process) on a fixed port, against the test's
    Postgres database and the session's Ray head."""

    def __init__(self, db_url: str, storage: Path, ray_head, log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self.env = {**ray_env(), "PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": db_url,
                    "MEMFIT_STORAGE_DIR": str(storage), "MEMFIT_RAY_ADDRESS": ray_head.dashboard_url,
                    "MEMFIT_LEASE_SECONDS": "3", "MEMFIT_POLL_SECONDS": "0.3",
                    # How long the run's sink waits for an absent API when the run ends (default 60 s).
                    "MEMFIT_WORKER_INGEST_WAIT_S": "2"}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Serve":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli.main", "serve", "--port", str(self.port),
                                      "--log-level", "warning"], cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def up():
            assert self.proc.poll() is None, f"memfit serve exited:\n{self.log_path.read_text()[-3000:]}"
            try:
                return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 120, "memfit serve to answer")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def run_to_the_end_while_away(ray: RayJobs, job_id: str, spool: Path) -> None:
    sid = submission_id(job_id, 1)
    wait_until(lambda: (st := ray.status(sid)) is not None and st.status in RAY_TERMINAL, 600,
               "the run to end while the API is away")
    assert ray.status(sid).status == "SUCCEEDED"
    assert spool_file.pending_bytes(spool) > 0  # the API missed part of the run: there is something to lose


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_memfit_serve_stopped_past_the_end_of_a_run_finishes_the_job_on_restart(new_database, ray_head, tmp_path,
                                                                              artifacts_dir):
    with new_database() as url:
        engine = db.make_engine(url)
        sessions = db.make_sessionmaker(engine)
        storage = tmp_path / "storage"
        serve = Serve(url, storage, ray_head, artifacts_dir / "durable-serve.log").start()
        try:
            key = new_key(sessions)
            with httpx.Client(base_url=serve.url, timeout=30) as http:
                job_id = create_job(http, key, upload(http, key, chat_rows()), TRAINING)["id"]
            spool = storage / "jobs" / job_id / "metrics-attempt-1.jsonl"

            def first_step_stored():
                with sessions() as s:
                    return s.scalar(select(func.count()).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))

            wait_until(first_step_stored, 600, "the first training step to be stored")
            serve.stop(signal.SIGTERM)  # stops the API and the scheduler together
            run_to_the_end_while_away(RayJobs(ray_head.dashboard_url), job_id, spool)

            serve.start()  # adopts the job (its lease was released), sees SUCCEEDED, replays the spool

            def ended():
                with sessions() as s:
                    return s.scalar(select(Job.status).where(Job.id == job_id)) in ("succeeded", "failed", "cancelled")

            wait_until(ended, 300, "the restarted service to finish the job")
            assert_stored_exactly_once(sessions, job_id, spool)
        finally:
            serve.stop()
            engine.dispose()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_that_ends_while_the_api_is_down_is_finished_by_the_scheduler(new_database, ray_head, tmp_path,
                                                                         monkeypatch):
    from tests.stack import Stack

    monkeypatch.setenv("MEMFIT_WORKER_INGEST_WAIT_S", "2")  # forwarded into the Ray job
    with new_database() as url:
        stack = Stack(url, tmp_path / "storage", ray_head)
        stack.start_scheduler()
        try:
            job_id = create_job(stack.http, stack.key, stack.train_file, TRAINING)["id"]
            stack.wait_until(lambda: stack.metrics_steps(job_id), 600, "the first training step", job_id=job_id)
            stack.server.stop()  # the API goes away; the scheduler keeps running
            spool = stack.settings.storage_dir / "jobs" / job_id / "metrics-attempt-1.jsonl"
            run_to_the_end_while_away(stack.ray, job_id, spool)

            def ended():
                with stack.app.state.sessions() as s:
                    return s.scalar(select(Job.status).where(Job.id == job_id)) in ("succeeded", "failed", "cancelled")

            wait_until(ended, 300, "the scheduler to finish the job from the spool")
            assert_stored_exactly_once(stack.app.state.sessions, job_id, spool)  # with the API still down

            stack.server = LiveServer(stack.app, port=stack.port).start()  # back: users see it all
            job = stack.job(job_id)
            assert job["status"] == "succeeded" and job["fine_tuned_model"]
            assert stack.metrics_steps(job_id, 0) == stack.metrics_steps(job_id, 1) == list(range(1, STEPS + 1))
        finally:
            stack.close()


def session_members(sid: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) == sid:
                out.append(p.info["pid"])
        except (ProcessLookupError, PermissionError):
            continue
    return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_memfit_serve_restarted_mid_job_the_run_goes_on_and_its_buffered_records_arrive(new_database, ray_head,
                                                                                      tmp_path, artifacts_dir):
    """SIGTERM to `memfit serve` (API and scheduler) while the job trains, then start it again: the
    run was never stopped (same attempt, one Ray submission), what its sink buffered while the API
    was away arrives, every metric and memory sample is stored once, the first process left nothing
    behind, and the status only ever moved forward."""
    with new_database() as url:
        engine = db.make_engine(url)
        sessions = db.make_sessionmaker(engine)
        storage = tmp_path / "storage"
        serve = Serve(url, storage, ray_head, artifacts_dir / "api-restart-serve.log").start()
        try:
            key = new_key(sessions)
            with httpx.Client(base_url=serve.url, timeout=30) as http:
                job_id = create_job(http, key, upload(http, key, chat_rows()), TRAINING)["id"]
            spool = storage / "jobs" / job_id / "metrics-attempt-1.jsonl"

            def steps_stored() -> int:
                with sessions() as s:
                    return s.scalar(select(func.count()).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))

            wait_until(steps_stored, 600, "the first training step to be stored")
            first = serve.proc.pid
            serve.stop(signal.SIGTERM)
            # It stopped by itself, as a SIGTERM ends a process (its cleanup done, the signal re-raised).
            assert serve.proc.returncode in (0, -signal.SIGTERM), serve.log_path.read_text()[-2000:]
            assert session_members(first) == [], "the stopped memfit serve left processes behind"
            stored_at_stop = steps_stored()
            # The run goes on while the API is away: its spool grows past what the store holds.
            wait_until(lambda: spooled(spool)["metrics"] and len(spooled(spool)["metrics"]) > stored_at_stop + RANKS,
                       300, "the run to train on while the API is down")
            assert ray_status(ray_head, job_id) == "RUNNING"

            serve.start()  # adopts the job (its lease was released at the stop), keeps its Ray job

            def ended():
                with sessions() as s:
                    return s.scalar(select(Job.status).where(Job.id == job_id)) in ("succeeded", "failed", "cancelled")

            wait_until(ended, 600, "the job to end after the restart")
            with sessions() as s:
                job = s.get(Job, job_id)
                assert (job.status, job.attempt) == ("succeeded", 1), job.error
                metrics = [(d["rank"], d["step"]) for d in s.scalars(
                    select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))]
                memory = s.execute(select(MemorySample.rank, MemorySample.step, MemorySample.phase)
                                   .where(MemorySample.job_id == job_id)).all()
                statuses = [d["status"] for d in s.scalars(select(JobEvent.data).where(
                    JobEvent.job_id == job_id, JobEvent.type == "message").order_by(JobEvent.id)) if d and "status" in d]
            held = spooled(spool)
            assert sorted(metrics) == held["metrics"] == [(r, st) for r in range(RANKS) for st in range(1, STEPS + 1)]
            assert sorted(memory) == held["memory"]
            assert statuses == ["queued", "running", "succeeded"], statuses  # forward only, one attempt
            assert set(RayJobs(ray_head.dashboard_url).submissions_of(job_id)) == {submission_id(job_id, 1)}
        finally:
            serve.stop()
            engine.dispose()


def ray_status(ray_head, job_id: str) -> str | None:
    st = RayJobs(ray_head.dashboard_url).status(submission_id(job_id, 1))
    return None if st is None else st.status
