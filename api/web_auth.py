"""Authentication for what a browser fetches: the dashboard pages, their data, the SSE stream, downloads.

A browser's EventSource cannot send an ``Authorization`` header, so these routes take the API key
from the header when there is one and otherwise the session of the ``memfit_session`` cookie the login
form sets (service/store/web_sessions.py). The cookie holds a random session token, never the key; it is
HttpOnly (page scripts cannot read it), SameSite=Strict (other sites cannot send it) and, whenever the
request came over https — directly, or through a proxy uvicorn trusts (MEMFIT_FORWARDED_ALLOW_IPS) —
Secure. A key is checked exactly as the JSON API checks it (service.store.auth.authenticate), a session
through its key (expired, logged out or revoked: 401), so a page shows only the tenant's own objects
and another tenant's id is a 404 like everywhere else.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.responses import Response

from api.deps import ReadSessionDep
from service.store.auth import Principal, authenticate
from service.store.web_sessions import SESSION_TTL, session_principal

COOKIE = "memfit_session"


def web_principal(request: Request, session) -> Principal:
    """The caller: the Authorization header's key when there is one, else the cookie's session."""
    header = request.headers.get("authorization")
    if header:
        return authenticate(session, header)
    return session_principal(session, request.cookies.get(COOKIE))


def get_web_principal(request: Request, session: ReadSessionDep) -> Principal:
    return web_principal(request, session)


WebPrincipalDep = Annotated[Principal, Depends(get_web_principal)]


def set_session_cookie(request: Request, response: Response, token: str) -> None:
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https",
                        path="/", max_age=int(SESSION_TTL.total_seconds()))


def clear_session_cookie(request: Request, response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https")
