"""Request dependencies: database sessions, the settings, and the authenticated tenant.

``SessionDep`` is a transactional session for requests that write (the service function commits);
``ReadSessionDep`` an autocommit one for GETs and for authentication. Creating and closing a session
does no I/O once its work is committed, so these are async and cost no thread-pool hop.
"""

from __future__ import annotations

from typing import Annotated, AsyncIterator

from fastapi import Depends, Request, Security
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from service.settings import Settings
from service.store.auth import Principal, authenticate

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


def get_principal(request: Request, session: ReadSessionDep, _doc=Security(_bearer)) -> Principal:
    # The raw header, not HTTPBearer's parse, so a malformed one gets a precise message.
    return authenticate(session, request.headers.get("authorization"))


PrincipalDep = Annotated[Principal, Depends(get_principal)]
