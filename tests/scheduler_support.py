"""Helpers shared by the scheduler, ingest and end-to-end tests: a real HTTP server for an app in a
thread, and the app with a scheduler that never reaches Ray. The data factories are tests/factories.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.scheduler.local_head import free_port
from tests.factories import settings_for


@dataclass
class LiveServer:
    """The real app on a free port in a background thread (workers in Ray post to it over HTTP)."""

    app: Any
    port: int = 0
    server: Any = None
    thread: threading.Thread | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LiveServer":
        import uvicorn

        self.port = self.port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=self.host, port=self.port,
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
        return httpx.Client(base_url=self.url, timeout=30, transport=ReusedConnectionRetry())


class ReusedConnectionRetry(httpx.HTTPTransport):
    """A GET or HEAD sent on a kept-alive connection that the server closed as idle at that moment (uvicorn's
    5 s keep-alive; this test process, which also runs the server and the scheduler, can stall that long on a
    loaded machine) is sent once more on a new connection, as urllib3 and the openai client do; nothing else
    is retried."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return super().handle_request(request)
        except httpx.RemoteProtocolError:
            if request.method not in ("GET", "HEAD"):
                raise
            return super().handle_request(request)


def app_without_ray(new_database, storage: Path, **overrides: Any):
    """The app on its own migrated database (``new_database``: the conftest fixture) with a Scheduler whose Ray address never answers: its
    claims hand out attempts and ingest tokens, nothing is submitted. Yields (app, client, scheduler)."""
    from contextlib import contextmanager

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs

    @contextmanager
    def _cm():
        with new_database() as url:
            settings = settings_for(url, storage, **overrides)
            app = create_app(settings)
            sched = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
            with TestClient(app) as client:
                yield app, client, sched
            app.state.engine.dispose()

    return _cm()
