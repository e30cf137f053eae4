"""A job's event ids commit in id order, on real Postgres, so a reader that follows ``id > cursor``
(the SSE stream, service.jobs.event_feed) never skips one.

Postgres hands out ``job_events.id`` at INSERT, not at COMMIT: two writers of one job's events, the
first holding its transaction open, could otherwise commit ids out of order — the reader sees the
later id, moves its cursor past it, and the earlier one commits behind the cursor, never delivered.
Every event writer now holds the job's row lock from before its insert until its commit
(service.jobs.crud.lock_job_events); these tests race real writers (the scheduler's add_event, bulk
add_events, status transitions, ingest) against a reader calling events_since.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from sqlalchemy import text

from service.domain.records import IngestBatch
from service.domain.states import JobStatus
from service.jobs.crud import add_event, add_events, events_since
from service.jobs.ingest import ingest
from service.store.transitions import transition
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import app_without_ray

WAIT_S = 60.0  # a hang guard for the orchestration below, not a timing assertion


@pytest.fixture(scope="module")
def store(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as (app, client, sched):
        yield app, client, sched


def running_job(store) -> tuple[str, str]:
    """(job id, ingest token) of a job the scheduler claimed (attempt 1, status running)."""
    app, client, sched = store
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]]


class Follower:
    """What a stream does: poll events_since(cursor) on an autocommit read session, move the cursor."""

    def __init__(self, app, job_id: str):
        self.read_sessions, self.job_id = app.state.read_sessions, job_id
        self.received: list[int] = []
        self.start = self.cursor = max(self.visible(), default=0)

    def visible(self) -> list[int]:
        with self.read_sessions() as s:
            return [e.id for e in events_since(s, self.job_id, 0, limit=100_000)]

    def poll(self) -> None:
        with self.read_sessions() as s:
            rows = events_since(s, self.job_id, self.cursor)
        self.received += [r.id for r in rows]
        if rows:
            self.cursor = rows[-1].id


# --- writers: each writes one unit of events into an open session; the caller commits ----------


def scheduler_event(app, session, job_id, _token):  # what Scheduler.submit / _watch_restarts do
    add_event(session, job_id, "Submitted to Ray as memfit-x-1", data={"attempt": 1}, attempt=1)


def bulk_events(app, session, job_id, _token):
    add_events(session, job_id, [{"message": "first of two", "attempt": 1}, {"message": "second of two", "attempt": 1}])


def status_change(app, session, job_id, _token):  # what a cancel does
    transition(session, job_id, JobStatus.cancelled, desired_state="cancel")


def ingest_batch(app, session, job_id, token):  # the ingest endpoint's store function (commits itself)
    ingest(session, app.state.settings, job_id, token, IngestBatch.model_validate(
        {"records": [{"kind": "event", "attempt": 1, "time": time.time(), "message": "from the worker"}]}))


def backend_waits_on_lock(app, pid: int) -> bool:
    with app.state.read_sessions() as s:
        return s.scalar(text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                        {"pid": pid}) is True


@pytest.mark.parametrize(
    "first,second",
    [
        (scheduler_event, scheduler_event),  # two scheduler writes (submit vs restart event)
        (scheduler_event, status_change),  # scheduler event held open while a user cancels
        (status_change, scheduler_event),  # a status change held open while the scheduler writes
        (bulk_events, scheduler_event),
        (scheduler_event, ingest_batch),  # held on main already (FK KEY SHARE vs ingest's FOR UPDATE)
    ],
    ids=lambda f: f.__name__,
)
def test_a_later_writer_cannot_commit_an_id_ahead_of_an_open_one(store, first, second):
    """Writer A inserts and holds its transaction open; writer B writes meanwhile; a reader polls
    while A is still open, then again after both committed. The reader gets every event exactly
    once: B either waits for A's commit (today) or, before the fix, committed a larger id first and
    the reader's cursor jumped past A's."""
    app, _, _ = store
    job_id, token = running_job(store)
    reader = Follower(app, job_id)
    a_written, release_a, b_done = threading.Event(), threading.Event(), threading.Event()
    b_pid: list[int] = []
    errors: list[BaseException] = []

    def writer_a():
        try:
            with app.state.sessions() as s:
                first(app, s, job_id, token)
                s.flush()
                a_written.set()
                release_a.wait(WAIT_S)
                s.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
            a_written.set()

    def writer_b():
        try:
            with app.state.sessions() as s:
                b_pid.append(s.scalar(text("SELECT pg_backend_pid()")))
                second(app, s, job_id, token)
                s.commit()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            b_done.set()

    ta = threading.Thread(target=writer_a)
    ta.start()
    assert a_written.wait(WAIT_S) and not errors, errors
    tb = threading.Thread(target=writer_b)
    tb.start()
    # Until B has either committed (it did not wait for A) or is blocked on A's lock.
    deadline = time.monotonic() + WAIT_S
    while not b_done.is_set() and not (b_pid and backend_waits_on_lock(app, b_pid[0])):
        assert time.monotonic() < deadline, "writer B neither finished nor waited on a lock"
        time.sleep(0.01)
    visible_while_a_open = reader.visible()
    reader.poll()
    release_a.set()
    ta.join(WAIT_S)
    tb.join(WAIT_S)
    assert not errors, errors
    reader.poll()

    stored = [i for i in reader.visible() if i > reader.start]
    assert len(stored) >= 2  # both writers' events
    # Every event written reached the reader, once and in id order: none committed behind its cursor.
    missed = sorted(set(stored) - set(reader.received))
    assert not missed, f"the reader never received event ids {missed} (stored {stored}, received {reader.received})"
    assert reader.received == stored
    # What was visible while A was open is every id up to the largest visible (a page is never holey).
    seen = [i for i in visible_while_a_open if i > reader.start]
    assert seen == [i for i in stored if i <= max(seen, default=0)]


def test_a_follower_receives_every_event_once_under_concurrent_writers(store):
    """Four writers (scheduler events, bulk events, ingest batches) hold their transactions open a
    random few milliseconds before committing while a reader follows with events_since: the reader
    ends with every stored event, each once, in id order."""
    app, _, _ = store
    job_id, token = running_job(store)
    reader = Follower(app, job_id)
    rng = random.Random(7)
    kinds = [scheduler_event, bulk_events, ingest_batch]
    plans = [[(rng.choice(kinds), rng.uniform(0, 0.02)) for _ in range(12)] for _ in range(4)]
    writing = threading.Event()
    errors: list[BaseException] = []

    def writer(plan):
        try:
            for write, hold_s in plan:
                with app.state.sessions() as s:
                    write(app, s, job_id, token)
                    s.flush()
                    time.sleep(hold_s)  # ids handed out, not yet committed
                    s.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def follow():
        while writing.is_set():
            reader.poll()
            time.sleep(0.001)

    writing.set()
    follower = threading.Thread(target=follow)
    follower.start()
    threads = [threading.Thread(target=writer, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    writing.clear()
    follower.join(WAIT_S)
    assert not errors, errors
    reader.poll()

    stored = [i for i in reader.visible() if i > reader.start]
    assert len(stored) == sum(2 if w is bulk_events else 1 for p in plans for w, _ in p)
    missed = sorted(set(stored) - set(reader.received))
    assert not missed, f"{len(missed)} of {len(stored)} events never reached the reader: {missed}"
    assert reader.received == stored
