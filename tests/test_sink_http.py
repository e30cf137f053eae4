"""The HTTP sink's durable delivery, against the real API on real Postgres: every record is spooled to
disk before it is posted, the spool outlives the process that wrote it, nothing is dropped for space
(the old in-memory queue dropped past 10,000), delivery resumes when the API comes back, and every
record is stored exactly once however often it is sent."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from service.scheduler.local_head import free_port
from service.store import spool as spool_file
from service.store.models import JobEvent
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import LiveServer, app_without_ray
from workers.sink_http import HttpSink

ROOT = Path(__file__).resolve().parent.parent
INGEST = "/v1/internal/jobs/{}/ingest"
FAST = {"backoff_base_s": 0.05, "backoff_max_s": 0.3, "flush_interval_s": 0.01, "poll_s": 0.1}


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


def running_job(env) -> tuple[str, str]:
    """(job id, ingest token) of a job the scheduler has claimed (attempt 1; nothing is submitted)."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]]


def metrics(step: int, rank: int = 0, total: int = 10_000) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": rank, "step": step,
            "total_steps": total, "loss": 3.0 / step, "trained_tokens": 64 * step, "step_time_s": 0.1}


def stored_metrics(app, job_id: str) -> list[tuple[int, int]]:
    with app.state.sessions() as s:
        rows = s.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))
        return sorted((d["rank"], d["step"]) for d in rows)


def stored_messages(app, job_id: str, message: str) -> int:
    with app.state.sessions() as s:
        return s.scalar(select(func.count()).where(JobEvent.job_id == job_id, JobEvent.message == message))


def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_no_record_is_dropped_past_the_old_queue_bound(env, tmp_path):
    app, _, _ = env
    job_id, token = running_job(env)
    port = free_port()
    spool = tmp_path / "metrics-attempt-1.jsonl"
    sink = HttpSink(f"http://127.0.0.1:{port}" + INGEST.format(job_id), token, spool=spool, **FAST)
    expected = [(rank, step) for step in range(1, 3001) for rank in range(4)]  # 12,000 > the old 10,000
    try:
        sink.write_many([metrics(step, rank) for rank, step in expected])
        # On disk before any of it is delivered: the API is not listening yet.
        assert len(spool.read_text().splitlines()) == 12_000
        assert sink.posted == 0
        server = LiveServer(app, port=port).start()
        try:
            assert sink.flush(timeout_s=600)
        finally:
            server.stop()
    finally:
        sink.abandon()
    assert (sink.posted, sink.dropped) == (12_000, 0)
    assert stored_metrics(app, job_id) == sorted(expected)
    assert spool_file.delivered_offset(spool) == spool.stat().st_size


CHILD = """
import sys, time
from workers.sink_http import HttpSink

url, token, spool = sys.argv[1:4]
sink = HttpSink(url, token, spool=spool, backoff_base_s=0.05, backoff_max_s=0.2)
now = time.time()
sink.write_many([{"kind": "metrics", "attempt": 1, "time": now, "rank": rank, "step": step, "loss": 1.0}
                 for step in range(1, 51) for rank in range(2)])
sink.write({"kind": "event", "attempt": 1, "time": now, "level": "warn", "message": "spooled by the child"})
print("spooled", flush=True)
time.sleep(600)
"""


def test_the_spool_survives_a_killed_writer_and_a_later_sink_delivers_it_once(env, tmp_path):
    app, _, _ = env
    job_id, token = running_job(env)
    port = free_port()
    url = f"http://127.0.0.1:{port}" + INGEST.format(job_id)
    spool = tmp_path / "metrics-attempt-1.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, token, str(spool)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spooled"
    finally:
        child.send_signal(signal.SIGKILL)  # the API never answered it: nothing was delivered
        child.wait(30)
    assert len(spool.read_text().splitlines()) == 101
    assert spool_file.delivered_offset(spool) == 0

    expected = sorted((rank, step) for step in range(1, 51) for rank in range(2))
    server = LiveServer(app, port=port).start()
    try:
        # Another process's sink on the same spool (the driver's, say) delivers the dead one's records.
        later = HttpSink(url, token, spool=spool, **FAST)
        assert later.close(timeout_s=120)
        assert later.posted == 101
        assert stored_metrics(app, job_id) == expected
        assert stored_messages(app, job_id, "spooled by the child") == 1

        # A third finds the spool delivered and sends nothing.
        idle = HttpSink(url, token, spool=spool, **FAST)
        assert idle.close(timeout_s=30) and idle.attempts == 0

        # Delivery is at least once; storage exactly once: resending the whole spool (its delivered
        # offset lost) stores nothing new — the event too, keyed by its place in the spool.
        spool_file.delivered_path(spool).unlink()
        again = HttpSink(url, token, spool=spool, **FAST)
        assert again.close(timeout_s=120) and again.posted == 101
    finally:
        server.stop()
    assert stored_metrics(app, job_id) == expected
    assert stored_messages(app, job_id, "spooled by the child") == 1


def test_delivery_resumes_when_the_api_comes_back(env, tmp_path):
    app, _, _ = env
    job_id, token = running_job(env)
    port = free_port()
    spool = tmp_path / "metrics-attempt-1.jsonl"
    sink = HttpSink(f"http://127.0.0.1:{port}" + INGEST.format(job_id), token, spool=spool, **FAST)
    try:
        server = LiveServer(app, port=port).start()
        sink.write_many([metrics(step) for step in range(1, 6)])
        assert sink.flush(timeout_s=60)
        server.stop()

        tried = sink.attempts
        sink.write_many([metrics(step) for step in range(6, 11)])
        wait_for(lambda: sink.attempts >= tried + 3, what="retries while the API is away")
        assert stored_metrics(app, job_id) == [(0, s) for s in range(1, 6)]
        assert not sink.flush(timeout_s=0.2)  # still pending, still retrying

        server = LiveServer(app, port=port).start()
        try:
            assert sink.flush(timeout_s=120)
        finally:
            server.stop()
    finally:
        sink.abandon()
    assert stored_metrics(app, job_id) == [(0, s) for s in range(1, 11)]
    assert (sink.posted, sink.dropped) == (10, 0)


def test_close_while_the_api_is_away_keeps_the_records_and_keeps_retrying(env, tmp_path):
    app, _, _ = env
    job_id, token = running_job(env)
    port = free_port()
    spool = tmp_path / "metrics-attempt-1.jsonl"
    sink = HttpSink(f"http://127.0.0.1:{port}" + INGEST.format(job_id), token, spool=spool,
                    close_timeout_s=0.5, **FAST)
    try:
        sink.write_many([metrics(step) for step in range(1, 4)])
        assert sink.close() is False  # gave up waiting, not on the records
        assert len(spool.read_text().splitlines()) == 3 and spool_file.delivered_offset(spool) == 0
        assert sink.dropped == 0
        server = LiveServer(app, port=port).start()
        try:  # the thread outlives close() for as long as the process lives
            wait_for(lambda: stored_metrics(app, job_id) == [(0, 1), (0, 2), (0, 3)], what="delivery after close")
        finally:
            server.stop()
    finally:
        sink.abandon()
    assert spool_file.delivered_offset(spool) == spool.stat().st_size


def test_a_malformed_record_is_skipped_alone(env, tmp_path):
    app, _, _ = env
    job_id, token = running_job(env)
    port = free_port()
    spool = tmp_path / "metrics-attempt-1.jsonl"
    server = LiveServer(app, port=port).start()
    sink = HttpSink(f"http://127.0.0.1:{port}" + INGEST.format(job_id), token, spool=spool, **FAST)
    try:
        bad = {**metrics(5), "step": -1}  # MetricsRecord.step is ≥ 0: the whole batch answers 422
        sink.write_many([metrics(step) for step in range(1, 5)] + [bad] + [metrics(step) for step in range(5, 10)])
        assert sink.close(timeout_s=60)
    finally:
        sink.abandon()
        server.stop()
    assert stored_metrics(app, job_id) == [(0, s) for s in range(1, 10)]
    assert (sink.posted, sink.rejected) == (9, 1)
    assert spool_file.delivered_offset(spool) == spool.stat().st_size


def test_the_spool_reader_leaves_a_torn_last_line_for_later(tmp_path):
    spool = tmp_path / "s.jsonl"
    spool_file.append(spool, [metrics(1), {"kind": "event", "attempt": 1, "time": 1.0, "message": "m"}])
    second_line_at = spool.read_bytes().index(b"\n") + 1
    with open(spool, "ab") as f:
        f.write(b'{"kind": "metrics", "att')  # a writer killed mid-line
    records, end = spool_file.read(spool, 0)
    assert [r["kind"] for r in records] == ["metrics", "event"]
    assert records[1]["dedupe"] == f"spool:{second_line_at}"  # an event's key is its place in the spool
    assert spool_file.read(spool, end) == ([], end)
