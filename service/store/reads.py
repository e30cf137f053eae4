"""Reads on the event loop: the API's hottest GETs without a thread-pool hop.

On Postgres, :class:`Reads` keeps a small pool of psycopg ``AsyncConnection``\\ s (autocommit) and runs
a SQLAlchemy Core SELECT, compiled once to its SQL text, straight on the driver: no worker thread,
no SQLAlchemy execution layer, and psycopg prepares the statement on the server after its fifth
execution on a connection (psycopg's ``prepare_threshold``), so Postgres stops parsing and planning
it. Rows come back as named tuples in the statement's column order, as the sync path's rows do.

Everywhere else — SQLite (no async driver that beats a thread there), and an app whose lifespan has
not run (Starlette's TestClient outside ``with``: a new event loop per request) — the same statement
runs through the sync engine in a worker thread (:meth:`Reads.in_thread`).

A pooled connection is checked as the sync pool checks it (service/store/db.py
watch_stale_connections): its socket is asked, without a round trip, whether the server has said
goodbye (a restart or failover closes every session), and only then, or after db.PING_IDLE_S idle, is
it pinged. A connection that fails while in use empties the pool (the others are as stale) and the
read is tried once more on a new one; a database that cannot be reached raises
:class:`~service.domain.errors.DatabaseUnavailable` (503, retryable) at once, as the sync path does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.sql import Executable

from service.domain.errors import DatabaseUnavailable
from service.store.db import DbTimeouts, must_ping

T = TypeVar("T")


class Reads:
    """SELECTs for the API on one engine's database: on the event loop over Postgres once
    :meth:`open` has run in the loop that serves requests, in a worker thread otherwise."""

    def __init__(self, engine: Engine, *, size: int = 8, timeouts: DbTimeouts | None = None):
        self.engine = engine
        self.size = size
        self.timeouts = timeouts or DbTimeouts()
        self._compiled: dict[int, tuple[Executable, str, dict[str, Any]]] = {}  # id(statement) → SQL
        self._pool: _Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called as fn(kind, sql) for each "checkout", "connect" and "statement" of the event-loop path
        # (the thread path is the engine's, seen by its own events): what counts a request's database work.
        self.observers: list[Callable[[str, str | None], None]] = []

    @property
    def on_loop(self) -> bool:
        """Whether reads from the running event loop go straight to the driver."""
        if self._pool is None:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def open(self) -> None:
        """Start serving reads on the running loop (Postgres only; connections open as needed)."""
        if self.engine.dialect.name != "postgresql" or self._pool is not None:
            return
        url = self.engine.url.set(drivername="postgresql")
        if "application_name" not in url.query:  # one given in the database URL names these too
            url = url.update_query_dict({"application_name": "memfit-api-reads"})
        self._pool = _Pool(url.render_as_string(hide_password=False), self.size, self.observers, self.timeouts)
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        pool, self._pool, self._loop = self._pool, None, None
        if pool is not None:
            await pool.close()

    async def all(self, statement: Executable, params: dict[str, Any]) -> list:
        """The rows of ``statement`` with ``params`` (its bound parameters by name)."""
        if not self.on_loop:
            return await self.in_thread(lambda conn: conn.execute(statement, params).all())
        sql, defaults = self._sql(statement)
        return await self._pool.fetch(sql, {**defaults, **params})

    async def first(self, statement: Executable, params: dict[str, Any]):
        rows = await self.all(statement, params)
        return rows[0] if rows else None

    async def in_thread(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` on an autocommit connection of the sync engine in a worker thread:
        reads the event-loop path does not serve (dynamic filters, expanding IN lists, SQLite)."""
        from anyio import to_thread

        engine = self.engine

        def run() -> T:
            with engine.connect() as conn:
                return fn(conn)

        return await to_thread.run_sync(run)

    def _sql(self, statement: Executable) -> tuple[str, dict[str, Any]]:
        """``statement``'s SQL text in psycopg's paramstyle and its literal parameters' values,
        compiled once per statement object (the statements are module constants)."""
        hit = self._compiled.get(id(statement))
        if hit is None or hit[0] is not statement:
            compiled = statement.compile(dialect=self.engine.dialect)
            hit = self._compiled[id(statement)] = (statement, str(compiled), dict(compiled.params))
        return hit[1], hit[2]


class _Pool:
    """Up to ``size`` autocommit AsyncConnections, the most recently used handed out first."""

    def __init__(self, url: str, size: int, observers: list, timeouts: DbTimeouts):
        self.url = url
        self.observers = observers
        self.timeouts = timeouts
        self.idle: list[tuple[Any, float]] = []  # (connection, idle since)
        self.slots = asyncio.Semaphore(size)
        self.closed = False

    async def fetch(self, sql: str, params: dict[str, Any]) -> list:
        import psycopg

        async with self.slots:
            conn, pooled = await self._take()
            for observe in self.observers:
                observe("statement", sql)
            try:
                return await _fetch(conn, sql, params, self.timeouts.deadline_s)
            except psycopg.OperationalError as exc:
                await _discard(conn)
                conn = None
                if not pooled:
                    raise DatabaseUnavailable("The database is unavailable; retry shortly") from exc
                await self._drop_idle()  # the others were opened to the same server: as stale
                conn, _ = await self._take()
                try:
                    return await _fetch(conn, sql, params, self.timeouts.deadline_s)
                except psycopg.OperationalError as again:
                    await _discard(conn)
                    conn = None
                    raise DatabaseUnavailable("The database is unavailable; retry shortly") from again
            finally:
                if conn is not None:
                    self._give_back(conn)

    async def _take(self):
        """A live connection: a pooled one that passes the check, or a new one."""
        for observe in self.observers:
            observe("checkout", None)
        while self.idle:
            conn, since = self.idle.pop()
            if await _alive(conn, since, self.timeouts.deadline_s):
                return conn, True
            await _discard(conn)
        import psycopg
        from psycopg.rows import namedtuple_row

        try:
            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True, row_factory=namedtuple_row,
                                                         **self.timeouts.libpq())
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable("The database is unavailable; retry shortly") from exc
        for observe in self.observers:
            observe("connect", None)
        return conn, False

    def _give_back(self, conn) -> None:
        from psycopg import pq

        if self.closed or conn.closed or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            asyncio.ensure_future(_discard(conn))
        else:
            self.idle.append((conn, time.monotonic()))

    async def _drop_idle(self) -> None:
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            await _discard(conn)

    async def close(self) -> None:
        self.closed = True
        await self._drop_idle()


async def _fetch(conn, sql: str, params: dict[str, Any], deadline_s: float) -> list:
    """The rows, or OperationalError once ``deadline_s`` passed without an answer (the connection is
    then closed: its protocol state is unknown) — as the sync engine's deadline (service/store/db.py)."""
    import psycopg

    async def run():
        cursor = await conn.execute(sql, params)
        return await cursor.fetchall()

    try:
        return await asyncio.wait_for(run(), deadline_s)
    except asyncio.TimeoutError:
        conn.pgconn.finish()
        raise psycopg.OperationalError(f"the database did not answer within {deadline_s:g} s") from None


async def _alive(conn, idle_since: float, deadline_s: float) -> bool:
    """The stale-connection check of service/store/db.py (must_ping): the socket first, a ping only
    if it has something to say (the server's goodbye) or the connection sat idle."""
    import psycopg

    if conn.closed or conn.broken:
        return False
    try:
        if not must_ping(conn.fileno(), idle_since):
            return True
    except (OSError, ValueError):
        return False
    try:
        await asyncio.wait_for(conn.execute("SELECT 1"), deadline_s)
    except (psycopg.Error, asyncio.TimeoutError):
        return False
    return True


async def _discard(conn) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - a connection that cannot even close cleanly is gone all the same
        pass
