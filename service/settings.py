"""Service settings: one pydantic-settings class, read from MEMFIT_* variables, refusing unsafe values."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMFIT_", extra="ignore")

    database_url: str = Field(
        "sqlite:///./.memfit/memfit.db",
        description="SQLAlchemy URL. postgresql+psycopg://… in production; SQLite is the embedded default.",
    )
    storage_dir: Path = Field(Path("./.memfit/storage"), description="Uploaded files, checkpoints and models.")
    model_dirs: list[Path] = Field(
        default_factory=list,
        description="The only local directories a job's `model` path may point into (comma-separated).",
    )
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1024, le=64 * 1024**3)
    api_url: str = Field("http://127.0.0.1:8000", description="Where workers post metrics (the API's own URL).")
    ray_address: str | None = Field(
        None, description="Ray cluster to submit to (e.g. http://head:8265); None starts a local head."
    )
    ray_auth_mode: str = Field("disabled", description="RAY_AUTH_MODE given to Ray and its clients.")
    scheduler_enabled: bool = Field(True, description="Run the scheduler loop inside `memfit serve`.")
    lease_seconds: float = Field(30.0, ge=2, le=3600, description="Scheduler lease; renewed by heartbeat.")
    poll_seconds: float = Field(0.5, gt=0, le=60)
    memory_safety_margin: float = Field(0.10, ge=0, le=0.9, description="Headroom kept free on each GPU.")

    @field_validator("model_dirs", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            return [p for p in v.split(",") if p.strip()]
        return v

    @field_validator("model_dirs")
    @classmethod
    def _resolve_dirs(cls, v: list[Path]) -> list[Path]:
        out = []
        for p in v:
            rp = Path(p).expanduser().resolve()
            if rp == Path("/"):
                raise ValueError("MEMFIT_MODEL_DIRS must not include the filesystem root")
            out.append(rp)
        return out

    @field_validator("database_url")
    @classmethod
    def _db(cls, v: str) -> str:
        if not v.startswith(("sqlite", "postgresql")):
            raise ValueError("MEMFIT_DATABASE_URL must be a sqlite:// or postgresql:// URL")
        if v.startswith("postgresql://"):
            v = "postgresql+psycopg://" + v[len("postgresql://"):]
        return v

    @field_validator("ray_auth_mode")
    @classmethod
    def _auth(cls, v: str) -> str:
        if v not in ("disabled", "token"):
            raise ValueError("MEMFIT_RAY_AUTH_MODE must be 'disabled' or 'token'")
        return v

    @model_validator(mode="after")
    def _storage(self):
        self.storage_dir = Path(self.storage_dir).expanduser().resolve()
        if self.storage_dir == Path("/"):
            raise ValueError("MEMFIT_STORAGE_DIR must not be the filesystem root")
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    return Settings()


def ensure_dirs(settings: Settings) -> None:
    settings.storage_dir.mkdir(parents=True, exist_ok=True)
    if settings.is_sqlite and ":///" in settings.database_url:
        path = settings.database_url.split(":///", 1)[1]
        if path and path != ":memory:":
            Path(os.path.dirname(path) or ".").mkdir(parents=True, exist_ok=True)
