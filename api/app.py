"""The FastAPI application factory: `uvicorn --factory api.app:create_app` (what `memfit serve` runs)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors, metrics
from api.routes import files, health, ingest, jobs, memory, pages, stream
from service.domain.errors import PayloadTooLarge
from service.settings import Settings, ensure_dirs, get_settings
from service.store import db

# Other features add their router here, one line each.
ROUTERS = [health.router, files.router, stream.router, jobs.router, ingest.router, pages.router, memory.router]  # stream before jobs: it claims …/events?stream=true


def _known_gpus() -> set[str] | None:
    """GPU names the spec may name in training.resources.gpu_type (service.memory.gpus' catalogue)."""
    try:
        from service.memory.gpus import known_gpus
    except ImportError:
        return None
    return set(known_gpus())


# JSON bodies (job specs, ingest batches) are small; uploads have their own limit (max_upload_bytes).
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024
_UNLIMITED_PATHS = ("/v1/files",)


class BodyLimit:
    """Refuse an over-long JSON body before anything reads it (OWASP API4: resource consumption)."""

    def __init__(self, app, max_bytes: int = MAX_JSON_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            from starlette.requests import Request

            response = errors.problem_response(
                Request(scope), status=413, code="body_too_large", title="Payload too large",
                detail=f"request body is larger than {self.max_bytes} bytes",
            )
            return await response(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body with no Content-Length
                raise PayloadTooLarge(f"request body is larger than {self.max_bytes} bytes", code="body_too_large")
            return message

        return await self.app(scope, limited_receive, send)


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
    app.add_middleware(BodyLimit)
    for router in ROUTERS:
        app.include_router(router)
    pages.install(app)  # the dashboard's static files
    metrics.install(app)  # GET /metrics and the request-latency middleware
    stream.install(app)  # wake SSE feeds when this process stores a job's events
    _document_job_spec(app)
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
