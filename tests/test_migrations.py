"""Alembic: up, down, up again on an empty Postgres database, and the models match the result."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from service.store import db
from service.store.models import Base

TABLES = {"tenants", "api_keys", "files", "idempotency_keys", "jobs", "job_events", "checkpoints", "memory_samples",
          "series_rollups", "series_heads", "web_sessions"}


def _diff(url: str) -> list:
    engine = create_engine(db.normalize_url(url))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(db.normalize_url(url))
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_postgres(fresh_pg_url):
    db.upgrade(fresh_pg_url)
    assert _tables(fresh_pg_url) == TABLES
    db.downgrade(fresh_pg_url, "base")
    assert _tables(fresh_pg_url) == set()
    db.upgrade(fresh_pg_url)
    assert _tables(fresh_pg_url) == TABLES
    assert _diff(fresh_pg_url) == []
    engine = create_engine(db.normalize_url(fresh_pg_url))
    assert db.current_revision(engine) == db.head_revision()
    cols = {c["name"]: c for c in inspect(engine).get_columns("jobs")}
    assert type(cols["spec"]["type"]).__name__ == "JSONB"
    indexes = {tuple(i["column_names"]) for i in inspect(engine).get_indexes("jobs")}
    assert ("status", "created_at") in indexes
    engine.dispose()


def test_upgrade_downgrade_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    db.upgrade(url)
    assert _tables(url) == TABLES
    assert _diff(url) == []
    db.downgrade(url, "base")
    assert _tables(url) == set()
