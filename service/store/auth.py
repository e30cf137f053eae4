"""API keys and tenants.

A key is ``mf_live_`` + 43 url-safe characters from 32 random bytes (256 bits). The first 8 of
those characters, with the ``mf_live_`` prefix, are the key's visible ``prefix`` (shown in
listings, used to revoke and to find the row); only the sha256 of the whole key is stored, and it
is compared with :func:`hmac.compare_digest` so the comparison takes the same time whatever matches.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.domain.errors import NotFound, Unauthorized
from service.store.models import ApiKey, Tenant, new_id, utcnow

KEY_PREFIX = "mf_live_"
VISIBLE_CHARS = 8


@dataclass(frozen=True)
class Principal:
    """Who is calling: every service function that touches tenant data takes one."""

    tenant_id: str
    key_prefix: str | None = None


@dataclass(frozen=True)
class IssuedKey:
    key: str  # shown once, never stored
    prefix: str
    tenant_id: str
    tenant_name: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str | None:
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + VISIBLE_CHARS:
        return None
    return key[: len(KEY_PREFIX) + VISIBLE_CHARS]


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(id=new_id("org-"), name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(session: Session, tenant_name: str) -> IssuedKey:
    """Create the tenant if needed and a new key for it. The caller commits."""
    tenant = get_or_create_tenant(session, tenant_name)
    while True:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        prefix = key_prefix(key)
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == prefix)) is None:
            break
    session.add(ApiKey(id=new_id("key-"), tenant_id=tenant.id, prefix=prefix, hash=hash_key(key)))
    session.flush()
    return IssuedKey(key=key, prefix=prefix, tenant_id=tenant.id, tenant_name=tenant.name)


def revoke_key(session: Session, prefix: str) -> None:
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    if result.rowcount != 1:
        raise NotFound(f"No active API key with prefix {prefix!r}", param="prefix", code="api_key_not_found")


def list_keys(session: Session) -> list[tuple[ApiKey, Tenant]]:
    return list(session.execute(select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at)).tuples())


def authenticate(session: Session, authorization: str | None) -> Principal:
    """The ``Authorization`` header value → Principal, or Unauthorized (missing, malformed, unknown, revoked)."""
    if not authorization:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
    prefix = key_prefix(key)
    row = None
    if prefix is not None:
        row = session.execute(
            select(ApiKey.hash, ApiKey.tenant_id, ApiKey.revoked_at).where(ApiKey.prefix == prefix)
        ).first()
    # Hash and compare even when no row matched, so an unknown prefix costs the same time.
    stored = row.hash if row is not None else "0" * 64
    if not hmac.compare_digest(stored, hash_key(key)) or row is None:
        raise Unauthorized("Invalid API key")
    if row.revoked_at is not None:
        raise Unauthorized("This API key has been revoked", code="revoked_api_key")
    return Principal(tenant_id=row.tenant_id, key_prefix=prefix)
