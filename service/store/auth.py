"""API keys and tenants.

A key is ``mf_live_`` + 43 url-safe characters from 32 random bytes (256 bits). The first 8 of
those characters, with the ``mf_live_`` prefix, are the key's visible ``prefix`` (shown in
listings, used to revoke and to find the row); only the sha256 of the whole key is stored, and it
is compared with :func:`hmac.compare_digest` so the comparison takes the same time whatever matches.

An API process remembers the keys it has found valid in a :class:`KeyCache` (api/deps.py), each
trusted for at most :data:`KEY_TRUST_S` from the moment its database check began: a key revoked by
any process (``memfit keys revoke``) is refused everywhere within that second, and at once by the
process that revoked it (:func:`revoke_key` tells the caches of its own process).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.domain.errors import NotFound, Unauthorized
from service.store.models import ApiKey, Tenant, new_id, utcnow

KEY_PREFIX = "mf_live_"
VISIBLE_CHARS = 8
KEY_TRUST_S = 1.0  # how long a key found valid is believed without asking the database again


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
    """Revoke the active key with this prefix (the caller commits). This process's caches forget it
    now; other processes' within KEY_TRUST_S of the commit."""
    for cache in list(_caches):
        cache.forget(prefix)
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    if result.rowcount != 1:
        raise NotFound(f"No active API key with prefix {prefix!r}", param="prefix", code="api_key_not_found")


def list_keys(session: Session) -> list[tuple[ApiKey, Tenant]]:
    return list(session.execute(select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at)).tuples())


def bearer_key(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header value, or Unauthorized (missing, malformed)."""
    if not authorization:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
    return key


def authenticate(session: Session, authorization: str | None) -> Principal:
    """The ``Authorization`` header value → Principal, or Unauthorized (missing, malformed, unknown, revoked)."""
    return check_key(session, bearer_key(authorization))


def check_key(session: Session, key: str) -> Principal:
    """The key's Principal from the database, or Unauthorized (unknown, revoked). One statement."""
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


# --- the per-process cache of keys found valid ------------------------------------------------------

_caches: weakref.WeakSet[KeyCache] = weakref.WeakSet()  # every cache of this process, for revoke_key


class KeyCache:
    """Keys found valid, by the sha256 of the whole key (never the prefix alone: another key with the
    same prefix is another entry, and misses). An entry is believed for ``trust_s`` from the moment its
    database check *began* — a check that started before a revocation committed may still have seen
    the key valid, and it expires within ``trust_s`` of that commit. Refusals are not cached. At most
    ``max_entries`` keys, the least recently used dropped first. Thread-safe."""

    def __init__(self, trust_s: float = KEY_TRUST_S, max_entries: int = 10_000):
        self.trust_s, self.max_entries = trust_s, max_entries
        self._entries: OrderedDict[str, tuple[Principal, float]] = OrderedDict()  # digest → (principal, checked at)
        self._lock = threading.Lock()
        _caches.add(self)

    def get(self, digest: str, now: float | None = None) -> tuple[Principal, float] | None:
        """(principal, age in seconds) while the entry is trusted, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            age = now - entry[1]
            if age >= self.trust_s:
                del self._entries[digest]
                return None
            self._entries.move_to_end(digest)
            return entry[0], age

    def put(self, digest: str, principal: Principal, checked_at: float) -> None:
        """Remember a key found valid by a check that began at ``checked_at`` (time.monotonic())."""
        with self._lock:
            current = self._entries.get(digest)
            if current is not None and current[1] >= checked_at:
                return  # a later check already answered
            self._entries[digest] = (principal, checked_at)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def discard(self, digest: str) -> None:
        with self._lock:
            self._entries.pop(digest, None)

    def forget(self, prefix: str) -> None:
        """Drop the key with this visible prefix (it is being revoked)."""
        with self._lock:
            for digest in [d for d, (p, _) in self._entries.items() if p.key_prefix == prefix]:
                del self._entries[digest]

    def __len__(self) -> int:
        return len(self._entries)
