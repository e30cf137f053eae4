"""memfit's app with one or more of the profile's fixes tried from the outside, to measure their gain.

    BENCH_WHATIF=cached_auth,pool40 uvicorn --factory bench.whatif_app:create_app   (MEMFIT_* settings)

The real ``api.app.create_app``, then, for each name in ``BENCH_WHATIF`` (comma-separated):

- ``cached_auth``: the Principal dependency answered from a per-process cache keyed by the key's
  sha256, each entry trusted for 1 s, as an async dependency. (The prototype of what api/deps.py
  KeyCheck now does: kept so earlier figures can be reproduced; on today's app it changes little.)
- ``pool40``: the sessions bound to an engine whose pool keeps 40 connections instead of 20 (as
  many as anyio's thread pool runs at once), so 32 concurrent requests do not open and close
  overflow connections.
- ``no_middleware``: memfit's own ASGI middleware removed (LatencyMiddleware, HeaderLimit, RateLimit, BodyLimit,
  PokeOnWrite): what they cost per request.

A prototype for measurement only (bench/api_wrk.py ``--whatif``); the fixes belong in api/ and service/.
"""

from __future__ import annotations

import os
import time

from anyio import to_thread
from fastapi import Request, Security

from api import deps
from api.limits import BodyLimit, HeaderLimit, RateLimit
from api.app import create_app as create_memfit_app
from api.metrics import LatencyMiddleware
from api.routes.stream import PokeOnWrite
from service.store import db
from service.store.auth import Principal, authenticate, hash_key

KNOWN = {"cached_auth", "pool40", "no_middleware"}
TRUST_S = 1.0


def _cached_principal():
    cache: dict[str, tuple[Principal, float]] = {}

    async def cached_principal(request: Request, _doc=Security(deps._bearer)) -> Principal:
        header = request.headers.get("authorization") or ""
        digest = hash_key(header)
        now = time.monotonic()
        hit = cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]

        def look_up() -> Principal:
            with request.app.state.read_sessions() as session:
                return authenticate(session, header)

        principal = await to_thread.run_sync(look_up)  # raises Unauthorized: nothing is cached
        if len(cache) > 10_000:
            cache.clear()
        cache[digest] = (principal, now + TRUST_S)
        return principal

    return cached_principal


def create_app():
    chosen = {w for w in os.environ.get("BENCH_WHATIF", "").split(",") if w}
    unknown = chosen - KNOWN
    if unknown:
        raise SystemExit(f"BENCH_WHATIF: unknown {sorted(unknown)}; known: {sorted(KNOWN)}")
    app = create_memfit_app()
    if "cached_auth" in chosen:
        app.dependency_overrides[deps.get_principal] = _cached_principal()
    if "pool40" in chosen:
        app.state.engine.dispose()
        engine = db.make_engine(app.state.settings.database_url, pool_size=40)
        app.state.engine = engine
        app.state.sessions = db.make_sessionmaker(engine)
        app.state.read_sessions = db.make_read_sessionmaker(engine)
        app.state.read_engine = db.read_only(engine)
        app.state.key_check = deps.KeyCheck(app.state.read_engine)
    if "no_middleware" in chosen:
        app.user_middleware = [m for m in app.user_middleware if m.cls not in (LatencyMiddleware, BodyLimit, HeaderLimit, RateLimit, PokeOnWrite)]
    return app
