"""The FastAPI application factory: `uvicorn --factory api.app:create_app` (what `memfit serve` runs)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors, metrics
from api.routes import files, health, ingest, jobs, pages, stream
from service import db
from service.settings import Settings, ensure_dirs, get_settings

# Other features add their router here, one line each.
ROUTERS = [health.router, files.router, stream.router, jobs.router, ingest.router, pages.router]  # stream before jobs: it claims …/events?stream=true


def _known_gpus() -> set[str] | None:
    """GPU names the spec may name in training.resources.gpu_type (service.gpus' catalogue)."""
    try:
        from service.gpus import known_gpus
    except ImportError:
        return None
    return set(known_gpus())


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    ensure_dirs(settings)
    if settings.is_sqlite:
        # Embedded mode migrates itself; a Postgres deployment runs `memfit db upgrade` first.
        db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.dispose()

    app = FastAPI(
        title="memfit",
        version="0.1.0",
        description="Fine-tuning jobs over HTTP, shaped like OpenAI's fine-tuning API.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = db.make_sessionmaker(engine)
    app.state.read_sessions = db.make_read_sessionmaker(engine)
    app.state.known_gpus = _known_gpus()
    app.state.schema_head = db.head_revision()
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    pages.install(app)  # the dashboard's static files
    metrics.install(app)  # GET /metrics and the request-latency middleware
    return app
