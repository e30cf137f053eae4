"""Engine, sessions and migrations.

SQLite (the embedded default) gets WAL, foreign keys and a busy timeout on every connection;
Postgres goes through psycopg 3. Schema changes only ever come from Alembic (:func:`upgrade`);
``create_all`` is for nothing but throwaway test databases.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine, Select, create_engine, event, tuple_
from sqlalchemy.orm import Session, sessionmaker

from service.domain.errors import UnprocessableEntity

ROOT = Path(__file__).resolve().parents[2]  # the checkout: alembic.ini, migrations/


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str, *, pool_size: int = 20, echo: bool = False) -> Engine:
    url = normalize_url(url)
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
    # pool_pre_ping: a pooled connection is tested (a cheap round trip) each time it is checked out,
    # and replaced when the server closed it. Without it, after a Postgres restart every idle
    # connection in the pool is dead and the first request to draw each one fails; SQLAlchemy only
    # learns the pool is stale from that failure. pool_recycle only bounds a connection's age.
    return create_engine(url, echo=echo, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800,
                         pool_pre_ping=True)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def make_read_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions for read-only requests: autocommit, so a GET costs its SELECTs and no BEGIN/ROLLBACK
    round trips. Never use them for writes that must be atomic."""
    return sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False)


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
