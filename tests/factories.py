"""The test data factories: tenants and keys, uploads, jobs over HTTP, settings on a database. Every
test builds its data with these (the fixtures in conftest.py bind them to the session's app)."""

from __future__ import annotations

import io
import json
import secrets
from pathlib import Path
from typing import Any

from service.settings import Settings
from service.store import auth
from service.store.db import session_scope

ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
    for i in range(32)
]
CHAT_JSONL = (
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}, '
    '{"role": "assistant", "content": "4"}]}\n'
)
MODEL = "preset:tiny-llama"


def settings_for(db_url: str, storage: Path, **overrides: Any) -> Settings:
    return Settings(database_url=db_url, storage_dir=storage, **overrides)


class TenantCtx:
    """A tenant with one API key, and the headers that send it."""

    def __init__(self, issued):
        self.name = issued.tenant_name
        self.id = issued.tenant_id
        self.key = issued.key
        self.prefix = issued.prefix
        self.headers = bearer(issued.key)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_tenant(sessions, name: str | None = None) -> TenantCtx:
    with session_scope(sessions) as s:
        return TenantCtx(auth.create_key(s, name or f"t-{secrets.token_hex(4)}"))


def new_key(sessions, tenant: str | None = None) -> str:
    """A new tenant's API key (or a new key of the tenant named ``tenant``)."""
    return new_tenant(sessions, tenant).key


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def post_file(client, key: str, content: str | bytes = CHAT_JSONL, *, filename: str = "train.jsonl",
              purpose: str = "fine-tune"):
    """POST /v1/files; the response, for tests of the upload itself."""
    return client.post("/v1/files", headers=bearer(key), files={"file": (filename, content)}, data={"purpose": purpose})


def upload(client, key: str, rows: list[dict] | None = None, name: str = "train.jsonl") -> str:
    """An uploaded training file (32 chat rows unless given); its id."""
    r = client.post("/v1/files", headers=bearer(key),
                    files={"file": (name, io.BytesIO(jsonl(rows or ROWS)), "application/jsonl")},
                    data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def post_job(client, key: str, headers: dict | None = None, **body: Any):
    """POST /v1/fine_tuning/jobs (model defaults to the tiny preset); the response."""
    body.setdefault("model", MODEL)
    return client.post("/v1/fine_tuning/jobs", json=body, headers={**bearer(key), **(headers or {})})


def create_job(client, key: str, file_id: str, training: dict | None = None, **body: Any) -> dict:
    """A created job on ``file_id``; its JSON."""
    if training is not None:
        body["training"] = training
    r = post_job(client, key, training_file=file_id, **body)
    assert r.status_code == 200, r.text
    return r.json()
