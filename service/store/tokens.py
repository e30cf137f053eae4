"""The per-attempt ingest token: a worker's only credential to report to the API (stored hashed)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

# --- ingest tokens ------------------------------------------------------------------------------


def new_ingest_token() -> tuple[str, str]:
    """A per-attempt token the Ray job uses to post records: (plaintext, sha256 hex stored on the job)."""
    token = "mfi_" + secrets.token_urlsafe(32)
    return token, hash_ingest_token(token)


def hash_ingest_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def ingest_token_matches(token: str, stored_hash: str | None) -> bool:
    return stored_hash is not None and hmac.compare_digest(hash_ingest_token(token), stored_hash)


