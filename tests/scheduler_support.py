"""Helpers shared by the scheduler, ingest and end-to-end tests: an app on a given database, a real
HTTP server for it in a thread, a tenant key, uploads and job creation over HTTP."""

from __future__ import annotations

import io
import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.scheduler.local_head import free_port
from service.settings import Settings
from service.store import auth, db
from service.store.db import session_scope
from tests import pgserver

ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
    for i in range(32)
]


def settings_for(db_url: str, storage: Path, **overrides: Any) -> Settings:
    return Settings(database_url=db_url, storage_dir=storage, **overrides)


def migrated(db_url: str) -> None:
    db.upgrade(db_url)


def new_key(sessions, tenant: str | None = None) -> str:
    with session_scope(sessions) as s:
        return auth.create_key(s, tenant or f"t-{secrets.token_hex(4)}").key


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client, key: str, rows: list[dict] | None = None, name: str = "train.jsonl") -> str:
    r = client.post("/v1/files", headers={"Authorization": f"Bearer {key}"},
                    files={"file": (name, io.BytesIO(jsonl(rows or ROWS)), "application/jsonl")},
                    data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def create_job(client, key: str, file_id: str, training: dict | None = None, **body: Any) -> dict:
    payload = {"model": "preset:tiny-llama", "training_file": file_id, **body}
    if training is not None:
        payload["training"] = training
    r = client.post("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"}, json=payload)
    assert r.status_code == 200, r.text
    return r.json()


@dataclass
class LiveServer:
    """The real app on a free port in a background thread (workers in Ray post to it over HTTP)."""

    app: Any
    port: int = 0
    server: Any = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LiveServer":
        import uvicorn

        self.port = self.port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test API server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(10)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


def own_database(pg_url: str):
    """A module's own Postgres database (next to the session's), so that schedulers under test never
    see — and adopt — jobs other test modules left running. Yields its URL, drops it afterwards."""
    return pgserver.database(pg_url)


def app_without_ray(pg_url: str, storage: Path):
    """The app on its own migrated database with a Scheduler whose Ray address never answers: its
    claims hand out attempts and ingest tokens, nothing is submitted. Yields (app, client, scheduler)."""
    from contextlib import contextmanager

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs

    @contextmanager
    def _cm():
        with own_database(pg_url) as url:
            migrated(url)
            settings = settings_for(url, storage)
            app = create_app(settings)
            sched = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
            with TestClient(app) as client:
                yield app, client, sched
            app.state.engine.dispose()

    return _cm()
