"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.scheduler import readiness
from service.store import db

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz():
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request):
    """Ready when the database answers, its schema is at the migrations' head and — under `memfit
    serve`, whose scheduler starts its Ray head after the API already answers — Ray is reachable."""
    engine = request.app.state.engine
    try:
        revision = db.current_revision(engine)
    except Exception as exc:  # noqa: BLE001 - any database failure means "not ready"
        # 503 until it answers again: the engine's pre-ping replaces the pool's dead connections then.
        return JSONResponse({"status": "unavailable", "database": f"error: {type(exc).__name__}"}, status_code=503,
                            headers={"Retry-After": "2"})
    head = request.app.state.schema_head
    if revision != head:
        return JSONResponse(
            {"status": "unavailable", "database": "ok", "schema": revision, "expected_schema": head,
             "hint": "run `memfit db upgrade`"},
            status_code=503,
        )
    ray = readiness.read(request.app.state.settings)
    if ray is not None and not ray[0]:
        # Jobs are accepted meanwhile: they wait in the queue until the scheduler reaches Ray.
        return JSONResponse({"status": "unavailable", "database": "ok", "schema": revision, "ray": ray[1]},
                            status_code=503, headers={"Retry-After": "2"})
    body = {"status": "ok", "database": "ok", "schema": revision}
    if ray is not None:
        body["ray"] = "ok"
    return body
