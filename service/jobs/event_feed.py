"""What the live event stream reads: a job's status and its events after a cursor, in one session.

The SSE route (api/routes/stream.py) calls :func:`poll` from a thread, once per poll interval per
*job* (not per client): one shared poller per job fans the rows out to every open stream.

Why ``id > cursor`` has no gap: every write of a job's events holds the job's row lock from before
its first insert until it commits — :func:`service.jobs.crud.add_event` and ``add_events`` take it
themselves (:func:`service.jobs.crud.lock_job_events`), :func:`service.store.transitions.transition` holds it by its
UPDATE of the job row, ingest by its ``SELECT … FOR UPDATE`` — so the writers of one job take turns
and its event ids become visible in increasing order: the ids a poll sees are always every id up to
the largest it sees. (Without the lock, an id handed out earlier could commit later, after a reader
had moved its cursor past it; tests/test_event_order.py races such writers.)
"""

from __future__ import annotations

from typing import Callable, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.crud import events_since
from service.store.models import Job, JobEvent

T = TypeVar("T")


def poll(session: Session, job_id: str, after_id: int, limit: int,
         render: Callable[[JobEvent], T]) -> tuple[str | None, list[tuple[int, T]]]:
    """(the job's status, [(event id, render(event))] after ``after_id``, oldest first).

    The status is read *before* the events: when it is terminal, the terminal event (written in the
    same transaction) is among the rows returned, so a stream may end after sending them.
    """
    status = session.scalar(select(Job.status).where(Job.id == job_id))
    rows = events_since(session, job_id, after_id, limit=limit)
    return status, [(r.id, render(r)) for r in rows]
