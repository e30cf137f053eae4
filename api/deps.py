"""Request dependencies: database sessions and connections, the settings, and the authenticated tenant.

``SessionDep`` is a transactional session for requests that write (the service function commits);
``ReadSessionDep`` an autocommit one for GETs. Creating and closing a session does no I/O once its
work is committed, so these are async and cost no thread-pool hop. The hottest GETs skip the
session: they read through ``app.state.reads`` (service/store/reads.py), on the event loop.

``PrincipalDep`` authenticates the ``Authorization: Bearer`` key through the app's :class:`KeyCheck`:
a key found valid within the last ``KEY_TRUST_S`` (service/store/auth.py) is answered from memory,
on the event loop; any other goes to the database in a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, AsyncIterator

from fastapi import Depends, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from service.domain.errors import Unauthorized
from service.settings import Settings
from service.store.auth import KeyCache, Principal, bearer_key, check_key, hash_key

_bearer = HTTPBearer(auto_error=False, description="An API key from `memfit keys create --tenant NAME`.")


async def get_session(request: Request) -> AsyncIterator[Session]:
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()  # anything a service function did not commit is rolled back


async def get_read_session(request: Request) -> AsyncIterator[Session]:
    session = request.app.state.read_sessions()
    try:
        yield session
    finally:
        session.close()


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


class KeyCheck:
    """The API process's authentication: a :class:`KeyCache` in front of service.store.auth.check_key.

    A hit costs a sha256 and a dict lookup on the event loop. A miss runs check_key in a worker thread;
    concurrent misses for one key wait for one check. A hit past half its trust starts a check in the
    background, so a busy key is re-checked about twice a second without any request waiting for it.
    Only a check's success is cached: an unknown or revoked key goes to the database every time (the
    rate limiter charges those to the client's address, api/limits.py)."""

    def __init__(self, engine, cache: KeyCache | None = None):
        self.engine = engine
        self.cache = cache if cache is not None else KeyCache()
        self._checks: dict[str, asyncio.Future[Principal]] = {}  # digest → the check in flight

    async def principal(self, authorization: str | None) -> Principal:
        key = bearer_key(authorization)  # 401 for a missing or malformed header, no I/O
        digest = hash_key(key)
        hit = self.cache.get(digest)
        if hit is None:
            # shield: a request that goes away does not cancel the check other requests wait for
            return await asyncio.shield(self._start(digest, key))
        principal, age = hit
        if age >= self.cache.trust_s / 2:
            self._start(digest, key)  # re-check ahead of expiry; this request is answered from the cache
        return principal

    def _start(self, digest: str, key: str) -> asyncio.Future[Principal]:
        check = self._checks.get(digest)
        if check is None:
            check = self._checks[digest] = asyncio.ensure_future(self._look_up(digest, key))
            check.add_done_callback(_retrieve)
        return check

    async def _look_up(self, digest: str, key: str) -> Principal:
        began = time.monotonic()  # before the query: an entry expires within trust_s of any revocation it missed
        try:
            principal = await run_in_threadpool(self._query, key)
        except Unauthorized:
            self.cache.discard(digest)
            raise
        finally:
            self._checks.pop(digest, None)
        self.cache.put(digest, principal, began)
        return principal

    def _query(self, key: str) -> Principal:
        with Session(self.engine) as session:
            return check_key(session, key)


def _retrieve(check: asyncio.Future) -> None:
    """A check nobody awaited (a background re-check) that failed is not an "exception never retrieved"."""
    if not check.cancelled():
        check.exception()


async def get_principal(request: Request, _doc=Security(_bearer)) -> Principal:
    # The raw header, not HTTPBearer's parse, so a malformed one gets a precise message.
    return await request.app.state.key_check.principal(request.headers.get("authorization"))


PrincipalDep = Annotated[Principal, Depends(get_principal)]
