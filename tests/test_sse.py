"""The live event stream over real HTTP (uvicorn) on real Postgres: Last-Event-ID resumes with no gap
and no duplicate, the stream ends once the job is terminal, heartbeats, fan-out to several clients on
one shared poller, and tenant isolation."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from sqlalchemy import text

from api.app import create_app
from api.routes.stream import StreamHub
from service.jobs.crud import add_event
from service.scheduler.loop import Scheduler
from service.scheduler.ray_jobs import RayJobs
from tests.factories import create_job, new_key, settings_for, upload
from tests.scheduler_support import LiveServer

INGEST = "/v1/internal/jobs/{}/ingest"


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    # Its own database: a claim here must not pick up (or be crowded out by) other modules' queued jobs.
    with new_database() as url:
        settings = settings_for(url, tmp_path_factory.mktemp("storage"))
        app = create_app(settings)
        app.state.stream_hub = StreamHub(app.state.read_sessions, poll_s=0.05, heartbeat_s=0.5)
        # The scheduler's claim gives each job its attempt and ingest token; Ray is never reached here.
        sched = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
        server = LiveServer(app).start()
        try:
            yield server, sched, app
        finally:
            server.stop()


def running_job(env) -> tuple[str, str, str]:
    """(job id, ingest token, tenant key) for a job the scheduler has claimed (attempt 1)."""
    server, sched, app = env
    with server.client() as c:
        key = new_key(app.state.sessions)
        job = create_job(c, key, upload(c, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]], key


def metrics(step: int, total: int = 20) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": 0, "step": step, "total_steps": total,
            "loss": 3.0 / step, "tokens_per_s": 100.0, "trained_tokens": 64 * step}


def ingest(server, job_id, token, records) -> None:
    with server.client() as c:
        r = c.post(INGEST.format(job_id), json={"records": records}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text


def finish(server, job_id, token) -> None:
    ingest(server, job_id, token, [{"kind": "result", "attempt": 1, "time": time.time(),
                                    "fine_tuned_model": "ft:tiny:x", "artifacts": {}}])


def listed_ids(server, key, job_id) -> list[int]:
    with server.client() as c:
        r = c.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100},
                  headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        return sorted(int(e["id"].removeprefix("ftevent-")) for e in r.json()["data"])


def read_sse(server, path, key, *, headers=None, params=None, stop_after=None, timeout=60.0, into=None):
    """Read an SSE response into ([(id, data)], end_status or None, comments). Stops at `event: end`,
    at the end of the response, or once `stop_after(messages)` is true (then it disconnects).
    With ``into`` (a list), messages are appended to it as they arrive."""
    messages, comments, end = (into if into is not None else []), [], None
    hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
    with httpx.Client(base_url=server.url, timeout=timeout) as c, c.stream("GET", path, headers=hdrs, params=params) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in r.iter_lines():
            if line == "":
                if "data" in fields:
                    if fields.get("event") == "end":
                        end = json.loads(fields["data"])["status"]
                        break
                    messages.append((int(fields["id"]), json.loads(fields["data"])))
                    if stop_after is not None and stop_after(messages):
                        break
                fields = {}
            elif line.startswith(":"):
                comments.append(line)
            else:
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
    return messages, end, comments


def stream_path(job_id: str) -> str:
    return f"/v1/fine_tuning/jobs/{job_id}/events/stream"


def test_resume_with_last_event_id_has_no_gap_and_no_duplicate(env):
    server, _, _ = env
    job_id, token, key = running_job(env)
    ingest(server, job_id, token, [metrics(s) for s in range(1, 6)])

    def saw_step(n):
        return lambda msgs: any((d.get("data") or {}).get("step") == n for _, d in msgs)

    first, end, _ = read_sse(server, stream_path(job_id), key, stop_after=saw_step(5))
    assert end is None
    ids = [i for i, _ in first]
    assert ids == sorted(set(ids))
    assert all(d["id"] == f"ftevent-{i}" for i, d in first)
    # Disconnect mid-way: resume after the event of step 3 while more arrive.
    resume_from = next(i for i, d in first if (d.get("data") or {}).get("step") == 3)
    ingest(server, job_id, token, [metrics(s) for s in range(6, 11)])
    second, _, _ = read_sse(server, stream_path(job_id), key, headers={"Last-Event-ID": str(resume_from)},
                            stop_after=saw_step(10))
    assert second[0][0] > resume_from
    seen = [i for i, _ in first if i <= resume_from] + [i for i, _ in second]
    assert seen == listed_ids(server, key, job_id)  # every stored event exactly once, in order

    # The query-parameter form, on the OpenAI path with ?stream=true, resumes the same way and the
    # stream ends after the terminal event.
    finish(server, job_id, token)
    third, end, _ = read_sse(server, f"/v1/fine_tuning/jobs/{job_id}/events", key,
                             params={"stream": "true", "last_event_id": f"ftevent-{second[-1][0]}"})
    assert end == "succeeded"
    assert third[-1][1]["data"]["status"] == "succeeded"
    assert [i for i, _ in first if i <= resume_from] + [i for i, _ in second] + [i for i, _ in third] == \
        listed_ids(server, key, job_id)


def test_live_stream_delivers_while_running_then_ends_at_terminal(env):
    """Two clients on the same job (one shared poller) each get every event as it is ingested."""
    server, _, app = env
    job_id, token, key = running_job(env)
    results: dict[int, tuple] = {}

    def client(n):
        results[n] = read_sse(server, stream_path(job_id), key)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    for step in range(1, 8):
        ingest(server, job_id, token, [metrics(step)])
        time.sleep(0.05)
    finish(server, job_id, token)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    expected = listed_ids(server, key, job_id)
    for messages, end, _ in results.values():
        assert end == "succeeded"
        assert [i for i, _ in messages] == expected
        steps = [d["data"]["step"] for _, d in messages if d["type"] == "metrics"]
        assert steps == list(range(1, 8))
    assert job_id not in app.state.stream_hub.feeds  # the poller stopped with its last client


def test_terminal_job_replays_and_ends_and_idle_stream_sends_heartbeats(env):
    server, _, _ = env
    job_id, token, key = running_job(env)
    # Idle running job: only keepalive comments arrive (heartbeat is 0.5 s in this module).
    with httpx.Client(base_url=server.url, timeout=30) as c, \
            c.stream("GET", stream_path(job_id), headers={"Authorization": f"Bearer {key}"}) as r:
        seen_keepalive = False
        deadline = time.monotonic() + 20
        for line in r.iter_lines():
            if line.startswith(": keepalive"):
                seen_keepalive = True
                break
            assert time.monotonic() < deadline
        assert seen_keepalive
    finish(server, job_id, token)
    messages, end, _ = read_sse(server, stream_path(job_id), key)
    assert end == "succeeded"
    assert [i for i, _ in messages] == listed_ids(server, key, job_id)
    # Resuming after the last event of a finished job: nothing more, and the stream still ends.
    rest, end, _ = read_sse(server, stream_path(job_id), key, headers={"Last-Event-ID": str(messages[-1][0])})
    assert rest == [] and end == "succeeded"


def test_stream_is_tenant_scoped_and_validates_the_cursor(env):
    server, _, app = env
    job_id, _, key = running_job(env)
    other = new_key(app.state.sessions)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for path, params in ((stream_path(job_id), None), (f"/v1/fine_tuning/jobs/{job_id}/events", {"stream": "true"})):
            r = c.get(path, params=params, headers={"Authorization": f"Bearer {other}"})
            assert r.status_code == 404
            assert r.json()["code"] == "job_not_found"
            r = c.get(path, params=params)
            assert r.status_code == 401
        r = c.get(stream_path(job_id), headers={"Authorization": f"Bearer {key}", "Last-Event-ID": "banana"})
        assert r.status_code == 422
        assert r.json()["param"] == "Last-Event-ID"
        # Without stream=true, …/events is still the JSON listing.
        r = c.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["object"] == "list"
        # The dashboard's cookie authenticates the stream too (EventSource cannot send headers).
        login = c.post("/ui/login", data={"api_key": other, "next": "/ui/jobs"}, follow_redirects=False)
        r = c.get(stream_path(job_id), cookies={"memfit_session": login.cookies["memfit_session"]})
        assert r.status_code == 404


def test_an_event_held_open_by_one_writer_is_streamed_before_a_later_one(env):
    """The scheduler writes an event and keeps its transaction open; meanwhile the user cancels the
    job over HTTP (the cancel's status event is the job's last). The stream delivers both, the
    scheduler's first, then ends. Before event writers took the job's row lock, the cancel committed
    a larger id first, the stream's cursor passed the scheduler's id and the stream ended without it."""
    server, _, app = env
    job_id, _, key = running_job(env)
    streamed: list = []
    outcome: dict = {}
    reader = threading.Thread(target=lambda: outcome.update(end=read_sse(server, stream_path(job_id), key,
                                                                          into=streamed)[1]))
    reader.start()
    deadline = time.monotonic() + 60  # hang guards below, not timing assertions
    while not streamed:  # the stream has replayed the job's events so far: its feed is live
        assert time.monotonic() < deadline
        time.sleep(0.02)
    held = app.state.sessions()
    add_event(held, job_id, "Submitted to Ray as memfit-held-1", attempt=1)
    held.flush()
    held_id = held.scalar(text("SELECT max(id) FROM job_events WHERE job_id = :j"), {"j": job_id})
    cancelled: dict = {}

    def cancel():
        with server.client() as c:
            cancelled["status"] = c.post(f"/v1/fine_tuning/jobs/{job_id}/cancel",
                                         headers={"Authorization": f"Bearer {key}"}).status_code

    canceller = threading.Thread(target=cancel)
    canceller.start()
    # Until the cancel is either streamed (it did not wait for the open transaction) or blocked on its lock.
    while not any(d["data"].get("status") == "cancelled" for _, d in streamed if d.get("data")):
        with app.state.read_sessions() as s:
            if s.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND wait_event_type = 'Lock'")):
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held.commit()
    held.close()
    canceller.join(60)
    reader.join(60)
    assert not reader.is_alive() and cancelled["status"] == 200
    assert outcome["end"] == "cancelled"
    ids = [i for i, _ in streamed]
    assert held_id in ids, f"event {held_id} was never streamed: {ids}"
    assert ids == listed_ids(server, key, job_id)  # every event, once, in order
    assert streamed[-1][1]["data"]["status"] == "cancelled"
