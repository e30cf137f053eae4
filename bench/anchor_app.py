"""The hand-written anchor of bench/api_wrk.py: the least a `GET job` must do, written plainly.

    ANCHOR_DATABASE_URL=postgresql+psycopg://… uvicorn --factory bench.anchor_app:create_app

One FastAPI app, one SQLAlchemy Core engine (the pool memfit uses: 20 + 20 overflow, autocommit, so
a read costs its SELECTs and no BEGIN/ROLLBACK), on memfit's own database and schema, and nothing
else — no middleware, no ORM, no pydantic response model:

- ``GET /v1/fine_tuning/jobs/{job_id}`` takes the Bearer key, finds its row by the visible prefix
  (the unique index memfit looks it up by), compares the sha256 of the whole key in constant time,
  refuses a revoked key (401), then selects the job by id within the key's tenant (404 otherwise)
  and answers the job's fields in the shape of memfit's JobPublic, built by hand from the row (the
  hyperparameters and `training` read from the stored spec, an 'auto' batch size worked out as
  memfit does): two queries, one thread-pool hop, one JSON encoding;
- ``GET /healthz`` answers ``{"status": "ok"}``: bare FastAPI's floor, without memfit's middleware.

This is the reference issue 15 sets memfit's GET against (target ≥ 1.5×: reachable by not asking the
database who the key is on every request). It imports nothing from memfit.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import create_engine, text

KEY_PREFIX = "mf_live_"
VISIBLE_CHARS = 8

KEY_QUERY = text("SELECT hash, tenant_id, revoked_at FROM api_keys WHERE prefix = :prefix")
JOB_QUERY = text(
    "SELECT id, tenant_id, status, spec, model, training_file, validation_file, suffix, seed, metadata, attempt, "
    "desired_state, created_at, finished_at, estimated_finish, fine_tuned_model, result_files, trained_tokens, "
    "error, plan, memory_summary FROM jobs WHERE id = :id AND tenant_id = :tenant_id"
)


def problem(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"status": status, "detail": detail}, status_code=status,
                        media_type="application/problem+json")


def ts(value) -> int | None:
    return int(value.timestamp()) if value is not None else None


def job_body(row) -> dict:
    spec = row.spec
    hp = spec.get("hyperparameters") or spec["method"]["supervised"]["hyperparameters"]
    batch = hp["batch_size"]
    if batch == "auto":  # what the training options make of it: micro-batch × accumulation × workers
        t = spec["training"]
        workers = t["resources"]["num_workers"] if t["strategy"] != "pipeline" else 1
        batch = t["hyperparameters"]["micro_batch_size"] * t["hyperparameters"]["gradient_accumulation_steps"] * workers
    lrm = hp["learning_rate_multiplier"]
    hyperparameters = {"n_epochs": hp["n_epochs"], "batch_size": batch,
                       "learning_rate_multiplier": 1.0 if lrm == "auto" else lrm}
    return {
        "id": row.id, "object": "fine_tuning.job", "created_at": ts(row.created_at), "finished_at": ts(row.finished_at),
        "estimated_finish": ts(row.estimated_finish), "model": row.model, "fine_tuned_model": row.fine_tuned_model,
        "organization_id": row.tenant_id, "training_file": row.training_file, "validation_file": row.validation_file,
        "result_files": row.result_files or [], "seed": row.seed, "suffix": row.suffix,
        "trained_tokens": row.trained_tokens, "hyperparameters": hyperparameters,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
        "metadata": row.metadata, "integrations": spec.get("integrations"), "status": row.status, "error": row.error,
        "training": spec["training"], "attempt": row.attempt, "desired_state": row.desired_state,
        "memory": row.memory_summary if row.memory_summary is not None else (
            {"plan": row.plan} if row.plan is not None else None),
    }


def create_app() -> FastAPI:
    url = os.environ["ANCHOR_DATABASE_URL"]
    engine = create_engine(url, pool_size=20, max_overflow=20, pool_recycle=1800).execution_options(
        isolation_level="AUTOCOMMIT")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.dispose()

    app = FastAPI(title="memfit bench anchor", openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    def get_job(job_id: str, request: Request):
        scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + VISIBLE_CHARS:
            return problem(401, "Missing or malformed API key")
        digest = hashlib.sha256(key.encode()).hexdigest()
        with engine.connect() as conn:
            found = conn.execute(KEY_QUERY, {"prefix": key[: len(KEY_PREFIX) + VISIBLE_CHARS]}).first()
            if found is None or not hmac.compare_digest(found.hash, digest):
                return problem(401, "Invalid API key")
            if found.revoked_at is not None:
                return problem(401, "This API key has been revoked")
            row = conn.execute(JOB_QUERY, {"id": job_id, "tenant_id": found.tenant_id}).first()
        if row is None:
            return problem(404, f"No job {job_id}")
        return JSONResponse(job_body(row))

    return app
