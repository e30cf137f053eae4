"""Request dependencies: a database session, the settings, and the authenticated tenant."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Request, Security
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from service.auth import Principal, authenticate
from service.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API key from `memfit keys create --tenant NAME`.")


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()  # anything a service function did not commit is rolled back


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_principal(request: Request, session: SessionDep, _doc=Security(_bearer)) -> Principal:
    # The raw header, not HTTPBearer's parse, so a malformed one gets a precise message.
    return authenticate(session, request.headers.get("authorization"))


PrincipalDep = Annotated[Principal, Depends(get_principal)]
