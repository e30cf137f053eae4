"""SQLAlchemy 2 models: the one schema for Postgres (production) and SQLite (embedded).

Migrations in migrations/versions create exactly this (tests/test_migrations.py compares them).
Timestamps are timezone-aware UTC; JSON columns are JSONB on Postgres.
"""

from __future__ import annotations

import secrets
import string
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.domain.states import JobStatus

JSONType = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments an INTEGER PRIMARY KEY; Postgres gets a BIGINT identity.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, n: int = 24) -> str:
    """'ftjob-' + 24 random alphanumerics (≈143 bits): unguessable, URL-safe."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(n))


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """DateTime(timezone=True) that always returns aware UTC datetimes (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        if value is not None and dialect.name == "sqlite":
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True, doc="The visible start of the key, e.g. mf_live_Ab3dE9xQ.")
    hash: Mapped[str] = mapped_column(String(64), doc="sha256 hex of the whole key; the key itself is never stored.")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class WebSession(Base):
    """A dashboard login (service/store/web_sessions.py): the browser's cookie holds a random session
    token, never the API key; only the token's sha256 is stored. Valid until ``expires_at``, a logout,
    or the key's revocation."""

    __tablename__ = "web_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True, doc="sha256 hex of the cookie's session token.")
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index(None, "tenant_id", "created_at", "id"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text, doc="Absolute path under settings.storage_dir.")
    format: Mapped[str | None] = mapped_column(String(32), doc="chat | prompt_completion | text")
    rows: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="processed")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer, doc="None while the first request is in flight.")
    response_body: Mapped[Any | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


_STATUSES = ", ".join(f"'{s.value}'" for s in JobStatus)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index(None, "status", "created_at"),
        Index(None, "tenant_id", "created_at", "id"),
        CheckConstraint(f"status IN ({_STATUSES})", name="status"),
    )
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(32), default=JobStatus.validating_files.value)
    spec: Mapped[dict] = mapped_column(JSONType, doc="JobSpec.model_dump(mode='json')")
    model: Mapped[str] = mapped_column(String(512))
    training_file: Mapped[str] = mapped_column(String(128))
    validation_file: Mapped[str | None] = mapped_column(String(128))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int | None] = mapped_column(BigInteger)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSONType)
    attempt: Mapped[int] = mapped_column(Integer, default=0, doc="Incremented by the scheduler on each claim.")
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    ray_submission_id: Mapped[str | None] = mapped_column(String(200))
    ray_status: Mapped[str | None] = mapped_column(String(32))
    desired_state: Mapped[str | None] = mapped_column(String(16), doc="'pause' or 'cancel' requested by the user.")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    estimated_finish: Mapped[datetime | None] = mapped_column(UTCDateTime())
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512))
    result_files: Mapped[list] = mapped_column(JSONType, default=list)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[dict | None] = mapped_column(JSONType, doc="{code, message, param, rank, step, phase, details}")
    plan: Mapped[dict | None] = mapped_column(JSONType, doc="The memory planner's prediction.")
    memory_summary: Mapped[dict | None] = mapped_column(JSONType)
    ingest_token_hash: Mapped[str | None] = mapped_column(String(64))
    output_dir: Mapped[str | None] = mapped_column(Text)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (
        UniqueConstraint("job_id", "dedupe_key"),
        Index(None, "job_id", "id"),
    )
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True, doc="SSE id and cursor.")
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSONType)
    attempt: Mapped[int | None] = mapped_column(Integer)
    dedupe_key: Mapped[str | None] = mapped_column(String(200))


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class MemorySample(Base):
    __tablename__ = "memory_samples"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank", "step", "phase"),)
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16), default="step")
    source: Mapped[str] = mapped_column(String(32), default="counters")
    parameters_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gradients_bytes: Mapped[int | None] = mapped_column(BigInteger)
    optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    activations_bytes: Mapped[int | None] = mapped_column(BigInteger)
    temporary_bytes: Mapped[int | None] = mapped_column(BigInteger)
    other_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    host_parameters_bytes: Mapped[int | None] = mapped_column(BigInteger)
    host_gradients_bytes: Mapped[int | None] = mapped_column(BigInteger)
    host_optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    process_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    device: Mapped[dict | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


# The category columns a MemoryRecord carries, in one place for the ingest code.
MEMORY_BYTE_COLUMNS = (
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "temporary_bytes",
    "other_bytes",
    "peak_bytes",
    "host_parameters_bytes",
    "host_gradients_bytes",
    "host_optimizer_bytes",
    "process_rss_bytes",
)


class SeriesRollup(Base):
    """One bucket of a job's per-rank time series (service/jobs/series.py): ``width`` steps from
    ``bucket`` (a multiple of ``width``), each field's min / max / last over the samples in it."""

    __tablename__ = "series_rollups"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    series: Mapped[str] = mapped_column(String(16), primary_key=True, doc="'memory' or 'metrics'.")
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True, doc="Steps per bucket: 10, 100, 1000, …")
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, doc="The bucket's first step (k × width).")
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(Integer, doc="Samples folded in (each stored sample once).")
    stats: Mapped[dict] = mapped_column(JSONType, doc='{"min": {field: v}, "max": {…}, "last": {…}}')


class SeriesHead(Base):
    """A job's series per attempt and rank, over the whole run: its step range, how many samples, and
    for memory the running peak per compared category (steady-state steps and all steps)."""

    __tablename__ = "series_heads"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    series: Mapped[str] = mapped_column(String(16), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(Integer)
    peaks: Mapped[dict | None] = mapped_column(JSONType, doc='memory: {"steady": {category: bytes}, "any": {…}, "steady_count": n}')
