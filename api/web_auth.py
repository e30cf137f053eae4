"""Authentication for what a browser fetches: the dashboard pages, their data, the SSE stream, downloads.

A browser's EventSource cannot send an ``Authorization`` header, so these routes take the API key
from the header when there is one and otherwise from the ``memfit_key`` cookie the login form sets
(HttpOnly, SameSite=Strict, so page scripts cannot read it and other sites cannot send it). The key
is checked exactly as the JSON API checks it (service.store.auth.authenticate), so a page shows only the
tenant's own objects and another tenant's id is a 404 like everywhere else.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.deps import ReadSessionDep
from service.store.auth import Principal, authenticate

COOKIE = "memfit_key"


def credentials(request: Request) -> str | None:
    """The Authorization header value to authenticate with: the header itself, or the cookie's key."""
    header = request.headers.get("authorization")
    if header:
        return header
    key = request.cookies.get(COOKIE)
    return f"Bearer {key}" if key else None


def get_web_principal(request: Request, session: ReadSessionDep) -> Principal:
    return authenticate(session, credentials(request))


WebPrincipalDep = Annotated[Principal, Depends(get_web_principal)]
