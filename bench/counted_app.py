"""memfit's app with its database work counted per request, for bench/api_wrk.py's query count.

    uvicorn --factory bench.counted_app:create_app      (memfit's MEMFIT_* settings)

The real ``api.app.create_app`` with SQLAlchemy event listeners on its engine (and an observer on
its event-loop reads, service/store/reads.py): every statement
sent (``before_cursor_execute``), every connection taken from the pool (``checkout``) and every
new database connection opened (``connect``) is recorded against the request that caused it, and
an outermost ASGI middleware answers them in headers: ``X-Bench-Statements``,
``X-Bench-Checkouts``, ``X-Bench-Connects`` (counts) and ``X-Bench-SQL`` (each statement's first 60
characters, ``|``-separated). ``GET /_bench/counts`` answers the totals since the last such call
(requests, statements, checkouts, connects), for a count under load. Listeners cost time, so this
app is for counting only; the timed rounds run the plain factory.

The request is found through a context variable holding a list: anyio copies the context into the
thread-pool threads that sync routes and dependencies run in, and the copy refers to the same list.
"""

from __future__ import annotations

import contextvars
import json

from sqlalchemy import event

from api.app import create_app as create_memfit_app

_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bench_request_db", default=None)
totals = {"requests": 0, "statements": 0, "checkouts": 0, "connects": 0}


class CountPerRequest:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/_bench/counts":
            return await self._answer_totals(send)
        record: dict = {"sql": [], "checkouts": 0, "connects": 0}
        token = _current.set(record)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                sql = [" ".join(s.split())[:60].replace("|", "/") for s in record["sql"]]
                message = {**message, "headers": [
                    *message.get("headers", []),
                    (b"x-bench-statements", str(len(record["sql"])).encode()),
                    (b"x-bench-checkouts", str(record["checkouts"]).encode()),
                    (b"x-bench-connects", str(record["connects"]).encode()),
                    (b"x-bench-sql", " | ".join(sql).encode("ascii", "replace")),
                ]}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            _current.reset(token)
            totals["requests"] += 1
            totals["statements"] += len(record["sql"])
            totals["checkouts"] += record["checkouts"]
            totals["connects"] += record["connects"]

    async def _answer_totals(self, send):
        body = json.dumps(totals).encode()
        totals.update(dict.fromkeys(totals, 0))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(settings=None):
    app = create_memfit_app(settings)
    engine = app.state.engine

    @event.listens_for(engine, "before_cursor_execute")
    def _statement(conn, cursor, statement, parameters, context, executemany):
        record = _current.get()
        if record is not None:
            record["sql"].append(statement)

    @event.listens_for(engine.pool, "checkout")
    def _checkout(dbapi_conn, connection_record, connection_proxy):
        record = _current.get()
        if record is not None:
            record["checkouts"] += 1

    ping = engine.dialect.do_ping  # a stale-looking pooled connection's ping (service.store.db) is a round trip too

    def counted_ping(dbapi_conn):
        record = _current.get()
        if record is not None:
            record["sql"].append("(ping)")
        return ping(dbapi_conn)

    engine.dialect.do_ping = counted_ping

    @event.listens_for(engine.pool, "connect")
    def _connect(dbapi_conn, connection_record):
        record = _current.get()
        if record is not None:
            record["connects"] += 1

    def _read_on_loop(kind, sql):  # service/store/reads.py: the reads that skip the engine
        record = _current.get()
        if record is not None:
            if kind == "statement":
                record["sql"].append(sql)
            else:
                record[kind + "s"] += 1

    app.state.reads.observers.append(_read_on_loop)

    app.add_middleware(CountPerRequest)  # added last: the outermost layer
    return app
