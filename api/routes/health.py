"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.store import db

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz():
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request):
    """Ready when the database answers and its schema is at the migrations' head."""
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
    return {"status": "ok", "database": "ok", "schema": revision}
