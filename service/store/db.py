"""Engine, sessions and migrations.

SQLite (the embedded default) gets WAL, foreign keys and a busy timeout on every connection;
Postgres goes through psycopg 3. Schema changes only ever come from Alembic (:func:`upgrade`);
``create_all`` is for nothing but throwaway test databases.
"""

from __future__ import annotations

import math
import select
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine, Select, create_engine, event, exc, tuple_
from sqlalchemy.orm import Session, sessionmaker

from service.domain.errors import UnprocessableEntity

ROOT = Path(__file__).resolve().parents[2]  # the checkout: alembic.ini, migrations/


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


@dataclass(frozen=True)
class DbTimeouts:
    """How long memfit waits on Postgres (settings ``db_*``): a database that stops answering — a
    crashed host, a partition, a proxy that black-holes the traffic, a hung server — costs a request
    its timeout and a 503, never a hung API or scheduler.

    - ``connect_s``: establishing a connection (libpq ``connect_timeout``, the handshake included);
    - ``statement_s``: one round trip — the server's ``statement_timeout``, and on the client a
      deadline of ``statement_s`` + 1 s on every wait for an answer (:class:`_DeadlineConnection`):
      past it the connection is closed (the pool replaces it) and the call fails as a lost connection;
    - ``keepalive_idle_s``: TCP keepalives on an idle connection (probes every third of it, 3 of them)
      and a TCP user timeout of the same total, so the kernel notices a peer that vanished."""

    connect_s: float = 5.0
    statement_s: float = 30.0
    keepalive_idle_s: float = 10.0

    @classmethod
    def from_settings(cls, settings) -> "DbTimeouts":
        return cls(settings.db_connect_timeout_s, settings.db_statement_timeout_s, settings.db_keepalive_idle_s)

    @property
    def deadline_s(self) -> float:
        return self.statement_s + 1.0

    def libpq(self) -> dict:
        """The libpq connection parameters (psycopg's connect keywords) that carry these."""
        interval = max(1, round(self.keepalive_idle_s / 3))
        idle = max(1, round(self.keepalive_idle_s))
        return {"connect_timeout": max(2, math.ceil(self.connect_s)), "keepalives": 1, "keepalives_idle": idle,
                "keepalives_interval": interval, "keepalives_count": 3,
                "tcp_user_timeout": int((idle + 3 * interval) * 1000),
                "options": f"-c statement_timeout={int(self.statement_s * 1000)}"}


def make_engine(url: str, *, pool_size: int = 20, echo: bool = False, timeouts: DbTimeouts | None = None) -> Engine:
    url = normalize_url(url)
    timeouts = timeouts or DbTimeouts()
    if url.startswith("sqlite"):
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    # A pooled connection may have been closed by the server while it sat in the pool (a Postgres
    # restart or failover, an idle timeout). SQLAlchemy's pool_pre_ping would find out with a
    # round trip on every checkout: a second round trip for a GET that needs one. Instead a checkout
    # asks the socket, which costs no round trip: a server that ends a session sends its goodbye and
    # closes the socket, so a stale connection is one with something to read (only then, and after
    # PING_IDLE_S in the pool, is it pinged; a failed ping swaps it for a new one). A connection that
    # dies while in use invalidates the whole pool (SQLAlchemy's own handling of a disconnect), so
    # the other stale ones are not handed out either. LIFO keeps the busy few warm.
    engine = create_engine(url, echo=echo, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800,
                           pool_use_lifo=True, pool_timeout=timeouts.statement_s, connect_args=timeouts.libpq())
    watch_stale_connections(engine)
    deadline_on_every_wait(engine, timeouts.deadline_s)
    return engine


def deadline_on_every_wait(engine: Engine, deadline_s: float) -> None:
    """Connect ``engine``'s pool through :class:`_DeadlineConnection`: no wait for the server outlives
    ``deadline_s``. The server's statement_timeout ends a slow query first, with its own error; this
    deadline is for a server that cannot answer at all (its kernel still acknowledging, or a proxy in
    between that does), where no TCP timeout ever fires."""
    import psycopg

    cls = type("DeadlineConnection", (_DeadlineConnection, psycopg.Connection), {"deadline_s": deadline_s})

    @event.listens_for(engine, "do_connect")
    def _connect(dialect, conn_rec, cargs, cparams):
        return cls.connect(*cargs, **cparams)


class _DeadlineConnection:
    """A psycopg Connection whose every wait for the server (a query, a commit, a ping) is given up
    after ``deadline_s``: the connection is then closed — its protocol state is unknown — so SQLAlchemy
    sees a lost connection (the pool drops it; the API answers 503 database_unavailable)."""

    deadline_s: float | None = None

    def wait(self, gen, interval=0.1, timeout=None):
        import psycopg
        from psycopg import errors

        if timeout is not None or not self.deadline_s:
            return super().wait(gen, interval=interval, timeout=timeout)
        try:
            return super().wait(gen, interval=interval, timeout=self.deadline_s)
        except errors._WaitTimeout:
            self.pgconn.finish()  # closed: SQLAlchemy's is_disconnect sees it, the pool discards it
            raise psycopg.OperationalError(f"the database did not answer within {self.deadline_s:g} s "
                                           "(MEMFIT_DB_STATEMENT_TIMEOUT_S + 1 s); connection closed") from None


PING_IDLE_S = 30.0  # a connection idle this long in the pool is pinged on checkout all the same


def watch_stale_connections(engine: Engine) -> None:
    """Listeners on ``engine``'s pool (see make_engine): stamp a connection when it is checked in,
    and on checkout refuse one the server has closed (``DisconnectionError``: the pool drops it and
    connects anew) or that fails a ping when it looks stale or sat idle PING_IDLE_S."""
    pool = engine.pool

    @event.listens_for(pool, "checkin")
    def _idle_since(dbapi_conn, record):
        if record is not None:
            record.info["idle_since"] = time.monotonic()

    @event.listens_for(pool, "checkout")
    def _alive(dbapi_conn, record, proxy):
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None:  # fresh from connect: nothing to check
            return
        driver = record.driver_connection
        if getattr(driver, "closed", False):
            raise exc.DisconnectionError("connection closed")
        try:
            suspect = must_ping(driver.fileno(), idle_since)
        except (OSError, ValueError):
            raise exc.DisconnectionError("connection socket unusable") from None
        if suspect:
            try:
                ok = engine.dialect.do_ping(dbapi_conn)
            except engine.dialect.loaded_dbapi.Error:
                ok = False
            if not ok:
                raise exc.DisconnectionError("connection failed its ping")


def must_ping(fileno: int, idle_since: float) -> bool:
    """Whether a pooled connection must be pinged before use: its socket has something to read (a
    server that ends a session sends its goodbye first) or it sat idle PING_IDLE_S. No round trip.
    Raises OSError or ValueError for a socket that is unusable. The sync pool (watch_stale_connections)
    and the API's event-loop reads (service/store/reads.py) both check by this."""
    readable = bool(select.select([fileno], [], [], 0)[0])
    return readable or time.monotonic() - idle_since > PING_IDLE_S


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def read_only(engine: Engine) -> Engine:
    """``engine`` in autocommit: a read costs its SELECTs and no BEGIN/ROLLBACK round trips (the same
    pool). Never use it for writes that must be atomic."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def make_read_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions for read-only requests, on :func:`read_only`."""
    return sessionmaker(read_only(engine), expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any exception."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# Alembic is imported inside the functions that migrate: only `memfit db upgrade`, embedded start-up
# and the tests need it, not every process that opens a session.


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.attributes["url"] = normalize_url(url)
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """`alembic upgrade head` on ``url``, programmatically (the app calls it for embedded SQLite)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


class Page(list):
    """One page of a cursor-paginated listing: the rows, plus whether more follow."""

    def __init__(self, items, has_more: bool):
        super().__init__(items)
        self.has_more = has_more


def fetch_page(session: Session, query: Select, limit: int) -> Page:
    """Run an ordered query for one page: one row more than ``limit`` tells whether more follow."""
    rows = list(session.scalars(query.limit(limit + 1)))
    return Page(rows[:limit], has_more=len(rows) > limit)


def newest_first_page(session: Session, query: Select, model, *, tenant_id: str, after: str | None,
                      limit: int) -> Page:
    """Keyset pagination on (created_at, id), newest first, over one tenant's rows of ``model``;
    ``after`` is the last id of the previous page (another tenant's id is an unknown cursor)."""
    if after:
        cursor = session.get(model, after)
        if cursor is None or cursor.tenant_id != tenant_id:
            raise UnprocessableEntity(f"unknown cursor {after!r}", param="after", code="invalid_cursor")
        query = query.where(tuple_(model.created_at, model.id) < tuple_(cursor.created_at, cursor.id))
    return fetch_page(session, query.order_by(model.created_at.desc(), model.id.desc()), limit)


def insert_ignoring_conflicts(session: Session, model, rows: list[dict], conflict_columns: list[str]) -> int:
    """INSERT … ON CONFLICT (conflict_columns) DO NOTHING on Postgres and SQLite; returns rows inserted."""
    if not rows:
        return 0
    # The dialect's own INSERT (ON CONFLICT is not portable), chosen per call by the session's engine.
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    pk = model.__table__.primary_key.columns.values()[0]
    stmt = insert(model).on_conflict_do_nothing(index_elements=conflict_columns).returning(pk)
    # Batched "insertmanyvalues" with RETURNING: the returned rows are exactly those inserted.
    return len(session.execute(stmt, rows).all()) if len(rows) > 1 else len(session.execute(stmt, rows[0]).all())
