"""Dashboard sessions: what the login cookie holds instead of the API key.

``POST /ui/login`` checks the key once and opens a session: a random token (``mfs_`` + 43 url-safe
characters, 256 bits) goes into the cookie, its sha256 into ``web_sessions`` with the key's id and an
expiry. A page request finds its tenant through the session and the key together (one statement), so
a session ends at its expiry, at ``POST /ui/logout`` (its row is deleted), or when its key is revoked —
and a stolen cookie never reveals the key.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.domain.errors import Unauthorized
from service.store.auth import Principal, check_key, key_prefix
from service.store.models import ApiKey, WebSession, utcnow

SESSION_PREFIX = "mfs_"
SESSION_TTL = timedelta(days=7)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_session(session: Session, key: str, ttl: timedelta = SESSION_TTL) -> str:
    """Check ``key`` (Unauthorized if unknown or revoked) and open a session for it: the cookie's token."""
    check_key(session, key)
    key_id = session.scalar(select(ApiKey.id).where(ApiKey.prefix == key_prefix(key)))
    token = SESSION_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    session.add(WebSession(id=_digest(token), api_key_id=key_id, created_at=now, expires_at=now + ttl))
    session.commit()
    return token


def session_principal(session: Session, token: str | None) -> Principal:
    """The tenant of a live session (not expired, its key not revoked), or Unauthorized."""
    if not token or not token.startswith(SESSION_PREFIX):
        raise Unauthorized("Not logged in")
    row = session.execute(
        select(ApiKey.tenant_id, ApiKey.prefix, ApiKey.revoked_at, WebSession.expires_at)
        .join(ApiKey, ApiKey.id == WebSession.api_key_id)
        .where(WebSession.id == _digest(token))
    ).first()
    if row is None or row.expires_at <= utcnow():
        raise Unauthorized("The session has ended; log in again")
    if row.revoked_at is not None:
        raise Unauthorized("This API key has been revoked", code="revoked_api_key")
    return Principal(tenant_id=row.tenant_id, key_prefix=row.prefix)


def close_session(session: Session, token: str | None) -> None:
    """Log out: the session's row goes (expired ones of the same key go with it)."""
    if not token:
        return
    key_id = session.scalar(select(WebSession.api_key_id).where(WebSession.id == _digest(token)))
    session.execute(delete(WebSession).where(WebSession.id == _digest(token)))
    if key_id is not None:
        session.execute(delete(WebSession).where(WebSession.api_key_id == key_id, WebSession.expires_at <= utcnow()))
    session.commit()
