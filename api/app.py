"""The FastAPI application factory: `uvicorn --factory api.app:create_app` (what `memfit serve` runs)."""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import deps, errors, metrics
from api.asgi import answered_status
from api.limits import MAX_JSON_BODY_BYTES, BodyLimit, HeaderLimit, RateLimit, limiter_for
from api.routes import files, health, ingest, jobs, memory, pages, serving, stream, tinker
from service.scheduler.inference import Inference
from service.scheduler.tinker import Tinker
from service.settings import Settings, ensure_dirs, get_settings
from service.store import db, reads

# tests, bench/whatif_app.py and service/cli/embedded.py import these from here
__all__ = ["MAX_JSON_BODY_BYTES", "BodyLimit", "answered_status", "create_app"]

# Other features add their router here, one line each.
# stream before jobs: it claims …/events?stream=true
ROUTERS = [health.router, files.router, stream.router, jobs.router, ingest.router, pages.router, memory.router, serving.router,
           tinker.router]


def _known_gpus() -> set[str] | None:
    """GPU names the spec may name in training.resources.gpu_type (service.memory.gpus' catalogue)."""
    try:
        from service.memory.gpus import known_gpus
    except ImportError:
        return None
    return set(known_gpus())


_frozen = False


def _freeze_startup_objects() -> None:
    """Move what start-up built (modules, routes, schemas, validators: some 130,000 objects) out of the
    garbage collector's sight: it would otherwise walk them all again on every full collection, for
    objects that live as long as the process. Once per process (tests start many apps in one)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    ensure_dirs(settings)
    if settings.is_sqlite:
        # Embedded mode migrates itself; a Postgres deployment runs `memfit db upgrade` first.
        db.upgrade(settings.database_url)
    timeouts = db.DbTimeouts.from_settings(settings)  # a database that stops answering costs a 503, not a hang
    engine = db.make_engine(settings.database_url, timeouts=timeouts)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        _freeze_startup_objects()
        await app.state.reads.open()  # GET job and the job list on the event loop (Postgres)
        try:
            yield
        finally:
            await app.state.reads.close()
            await app.state.limiter.close()
            await app.state.tinker.close()
            await app.state.inference.close()  # memfit's Serve applications go with it (service/scheduler/serve_apps.py)
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
    app.state.read_engine = db.read_only(engine)
    app.state.key_check = deps.KeyCheck(app.state.read_engine)
    app.state.reads = reads.Reads(app.state.read_engine, timeouts=timeouts)
    app.state.known_gpus = _known_gpus()
    app.state.schema_head = db.head_revision()
    app.state.limiter = limiter_for(settings)  # every rate limit's counts (api/limits.py)
    app.state.inference = Inference(settings)  # the models served on Ray Serve (api/routes/serving.py)
    app.state.tinker = Tinker(settings, app.state.inference)  # Tinker's training clients, on the same Serve (api/routes/tinker.py)
    errors.install(app)
    # Outermost last: header limits, then the rate limit, then the body (api/limits.py).
    app.add_middleware(BodyLimit, max_bytes=settings.max_json_body_bytes, max_depth=settings.max_json_depth)
    if settings.rate_limit_enabled:
        app.add_middleware(RateLimit, settings=settings)
    app.add_middleware(HeaderLimit, max_bytes=settings.max_header_bytes, max_count=settings.max_header_count)
    for router in ROUTERS:
        app.include_router(router)
    pages.install(app)  # the dashboard's static files
    metrics.install(app)  # GET /metrics and the request-latency middleware
    stream.install(app)  # wake SSE feeds when this process stores a job's events
    _document_job_spec(app)
    ingest.document(app)  # its body's schema (the route reads the body itself, after the token)
    return app


def _document_job_spec(app: FastAPI) -> None:
    """The create route reads the body itself (to report every spec problem at once), so FastAPI
    cannot see its schema: put JobSpec's JSON schema into the OpenAPI document by hand."""
    from service.domain.spec import JobSpec

    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            doc = build()
            spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            components.update(spec.pop("$defs", {}))
            components["JobSpec"] = spec
            doc["paths"]["/v1/fine_tuning/jobs"]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
            }
        return app.openapi_schema

    app.openapi = openapi
