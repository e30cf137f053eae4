"""Server-Sent Events: ``GET /v1/fine_tuning/jobs/{id}/events?stream=true`` (alias ``/events/stream``).

Wire format (https://html.spec.whatwg.org/multipage/server-sent-events.html):

- every job event is one SSE message: ``id:`` is its ``job_events`` row id, ``data:`` the same JSON
  object ``GET …/events`` lists (``{"id": "ftevent-<n>", "type": "metrics"|"message", …}``);
- a client that reconnects sends ``Last-Event-ID`` (or ``?last_event_id=``, as ``<n>`` or
  ``ftevent-<n>``) and receives exactly the events with a larger id: no gap, no duplicate;
- once the job is terminal the remaining events are sent, then ``event: end`` with
  ``{"status": …}``, and the response ends;
- a ``: keepalive`` comment every ``HEARTBEAT_S`` seconds keeps proxies from closing an idle stream.

Authorised like the rest of the API (Bearer key, or the dashboard's cookie since EventSource cannot
set headers); another tenant's job id is a 404.

Cost with many clients: one poller per *job* (:class:`JobFeed`) queries the database every
``POLL_S`` seconds in a worker thread (two indexed queries) and keeps the recent events as encoded
frames; every stream on that job is fed from this buffer, so 50 clients cost what one does. A
client that starts from an older cursor, or falls behind the buffer, reads its gap from the
database first (pages of ``PAGE`` rows), then joins the buffer.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import re
from typing import AsyncIterator
from urllib.parse import parse_qs

from anyio import to_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.routing import Match

from api.asgi import answered_status
from api.deps import ReadSessionDep
from api.errors import BY_ID, problems
from api.schemas import event_public
from api.web_auth import WebPrincipalDep
from service.domain.errors import UnprocessableEntity
from service.domain.states import JobStatus
from service.jobs import crud as jobs
from service.jobs import event_feed

log = logging.getLogger("memfit.api.stream")

POLL_S = 0.2
HEARTBEAT_S = 10.0
PAGE = 500
BUFFER = 4000  # encoded events kept per job feed

TERMINAL = {s.value for s in JobStatus if s.terminal}


def encode(event) -> bytes:
    body = event_public(event).model_dump_json()
    return f"id: {event.id}\ndata: {body}\n\n".encode()


def end_frame(status: str | None) -> bytes:
    return f"event: end\ndata: {json.dumps({'status': status})}\n\n".encode()


class JobFeed:
    """The one poller of a job's events, shared by every stream open on it."""

    def __init__(self, hub: "StreamHub", job_id: str, cursor: int):
        self.hub = hub
        self.job_id = job_id
        self.floor = cursor  # the buffer holds every event with floor < id <= cursor
        self.cursor = cursor
        self.ids: list[int] = []
        self.frames: list[bytes] = []
        self.status: str | None = None
        self.done = False
        self.subscribers = 0
        self.wakeup = asyncio.Event()
        self.poked = asyncio.Event()
        self.task: asyncio.Task | None = None

    def _notify(self) -> None:
        old, self.wakeup = self.wakeup, asyncio.Event()
        old.set()

    async def run(self) -> None:
        while not self.done:
            try:
                status, rows = await to_thread.run_sync(self.hub.poll, self.job_id, self.cursor)
            except Exception:  # noqa: BLE001 - a database hiccup must not end every client's stream
                log.exception("event feed for %s: poll failed", self.job_id)
                await asyncio.sleep(1.0)
                continue
            if rows:
                self.ids.extend(i for i, _ in rows)
                self.frames.extend(f for _, f in rows)
                self.cursor = rows[-1][0]
                if len(self.ids) > BUFFER:
                    drop = len(self.ids) - BUFFER
                    self.floor = self.ids[drop - 1]
                    del self.ids[:drop], self.frames[:drop]
            self.status = status
            if (status is None or status in TERMINAL) and len(rows) < PAGE:
                self.done = True
            if rows or self.done:
                self._notify()
            if not self.done and len(rows) < PAGE:
                # Sleep one poll interval, or less when this process just stored records for the job.
                try:
                    await asyncio.wait_for(self.poked.wait(), self.hub.poll_s)
                except asyncio.TimeoutError:
                    pass
                self.poked.clear()


class StreamHub:
    """The app's job feeds, created on a job's first stream and stopped after its last one closes."""

    def __init__(self, read_sessions, *, poll_s: float = POLL_S, heartbeat_s: float = HEARTBEAT_S):
        self.read_sessions = read_sessions
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.feeds: dict[str, JobFeed] = {}

    def poll(self, job_id: str, after_id: int, limit: int = PAGE) -> tuple[str | None, list[tuple[int, bytes]]]:
        with self.read_sessions() as session:
            return event_feed.poll(session, job_id, after_id, limit, encode)

    def acquire(self, job_id: str, cursor: int) -> JobFeed:
        feed = self.feeds.get(job_id)
        if feed is None or (feed.done and feed.task is not None and feed.task.done() and feed.subscribers == 0):
            feed = JobFeed(self, job_id, cursor)
            self.feeds[job_id] = feed
            feed.task = asyncio.get_running_loop().create_task(feed.run(), name=f"memfit-feed-{job_id}")
        feed.subscribers += 1
        return feed

    def poke(self, job_id: str) -> None:
        """New events for ``job_id`` were just committed by this process: poll now, not at the next tick."""
        feed = self.feeds.get(job_id)
        if feed is not None:
            feed.poked.set()

    def release(self, feed: JobFeed) -> None:
        feed.subscribers -= 1
        if feed.subscribers <= 0:
            if feed.task is not None and not feed.task.done():
                feed.task.cancel()
            if self.feeds.get(feed.job_id) is feed:
                del self.feeds[feed.job_id]

    async def stream(self, job_id: str, cursor: int) -> AsyncIterator[bytes]:
        yield b"retry: 2000\n\n"
        # Catch up from the database first; a job already terminal then ends without a poller.
        status = None
        while True:
            status, rows = await to_thread.run_sync(self.poll, job_id, cursor)
            if rows:
                yield b"".join(f for _, f in rows)
                cursor = rows[-1][0]
            if len(rows) < PAGE:
                break
        if status is None or status in TERMINAL:
            yield end_frame(status)
            return
        feed = self.acquire(job_id, cursor)
        try:
            while True:
                wakeup = feed.wakeup  # taken before looking, so nothing appended after the look is missed
                if cursor < feed.floor:
                    # Behind the shared buffer (an old Last-Event-ID, or a slow reader): read the gap.
                    _, rows = await to_thread.run_sync(self.poll, job_id, cursor)
                    if rows:
                        yield b"".join(f for _, f in rows)
                        cursor = rows[-1][0]
                    continue
                i = bisect.bisect_right(feed.ids, cursor)
                if i < len(feed.ids):
                    last = len(feed.ids)
                    chunk = b"".join(feed.frames[i:last])
                    cursor = feed.ids[last - 1]
                    yield chunk
                    continue
                if feed.done:
                    yield end_frame(feed.status)
                    return
                try:
                    await asyncio.wait_for(wakeup.wait(), self.heartbeat_s)
                except asyncio.TimeoutError:
                    yield b": keepalive\n\n"
        finally:
            self.release(feed)


def hub_of(request: Request) -> StreamHub:
    return _hub(request.app)


def _hub(app) -> StreamHub:
    state = app.state
    hub = getattr(state, "stream_hub", None)
    if hub is None:
        hub = state.stream_hub = StreamHub(state.read_sessions)
    return hub


def parse_last_event_id(value: str | None, param: str) -> int:
    if value is None or value.strip() == "":
        return 0
    raw = value.strip().removeprefix("ftevent-")
    if not raw.isdigit():
        raise UnprocessableEntity(f"{param} must be an event id such as 'ftevent-42' or '42'", param=param,
                                  code="invalid_cursor")
    return int(raw)


class StreamQueryRoute(APIRoute):
    """Matches ``…/events`` only with ``stream=true``, so the plain listing stays jobs.py's route."""

    def matches(self, scope):
        match, child = super().matches(scope)
        if match is not Match.NONE:
            qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if (qs.get("stream") or [""])[-1].lower() not in ("true", "1"):
                return Match.NONE, {}
        return match, child


router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


async def stream_events(
    job_id: str,
    request: Request,
    session: ReadSessionDep,
    principal: WebPrincipalDep,
    last_event_id_header: str | None = Header(None, alias="Last-Event-ID"),
    last_event_id: str | None = Query(None, description="Resume after this event id (like the Last-Event-ID header)."),
    stream: bool = Query(True, description="Must be true on …/events; the plain listing is the other route."),
) -> StreamingResponse:
    """The job's events as Server-Sent Events, from the start or after Last-Event-ID, until the job is terminal."""
    jobs.get_job(session, principal, job_id)  # 404 for an unknown or another tenant's job
    if last_event_id_header is not None:
        cursor = parse_last_event_id(last_event_id_header, "Last-Event-ID")
    else:
        cursor = parse_last_event_id(last_event_id, "last_event_id")
    session.close()  # the stream may last hours: give the connection back now
    return StreamingResponse(
        hub_of(request).stream(job_id, cursor),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"},
    )


router.add_api_route("/{job_id}/events/stream", stream_events, methods=["GET"], responses=problems(*BY_ID),
                     summary="Stream a job's events (Server-Sent Events)", response_class=StreamingResponse)
router.add_api_route("/{job_id}/events", stream_events, methods=["GET"], route_class_override=StreamQueryRoute,
                     summary="Stream a job's events when stream=true (Server-Sent Events)",
                     response_class=StreamingResponse, include_in_schema=False)


_INGEST = re.compile(r"^/v1/internal/jobs/([^/]+)/ingest$")
_ACTIONS = re.compile(r"^/v1/fine_tuning/jobs/([^/]+)/(cancel|pause|resume)$")


class PokeOnWrite:
    """ASGI middleware: after a successful ingest post or user action on a job, wake that job's
    feed so streams in this process see the new events at once. Writes made by other processes
    (another API replica, the scheduler) are picked up by the feed's regular poll."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        m = _INGEST.match(path) or _ACTIONS.match(path)
        if m is None:
            return await self.app(scope, receive, send)
        if await answered_status(self.app, scope, receive, send) < 300:
            hub = getattr(scope["app"].state, "stream_hub", None) if "app" in scope else None
            if hub is not None:
                hub.poke(m.group(1))


def install(app) -> None:
    app.add_middleware(PokeOnWrite)
