"""The service in one process: API + scheduler (+ a local Ray head when no cluster is named).

- ``memfit scheduler``: the loop alone, against MEMFIT_DATABASE_URL and MEMFIT_RAY_ADDRESS (the
  Ray Jobs API URL, e.g. http://raycluster-head-svc:8265 on KubeRay). Several may run at once.
- ``memfit serve``: the API, with the scheduler in a background thread (``settings.scheduler_enabled``);
  without MEMFIT_RAY_ADDRESS it starts a local Ray head on free ports and stops exactly that head.
- ``memfit run examples/x.yaml``: the embedded service in the background of one command, one job
  over HTTP with a live progress bar, a summary, and everything it started shut down again.

Each command runs inside ``service.scheduler.lifetime.command_lifetime(run_dir(settings), …)``: whatever way it
ends, every process it started ends with it, and the next start ends what a SIGKILLed one left.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from service.memory.nodes import publish_dashboard
from service.scheduler import readiness
from service.scheduler.lifetime import command_lifetime
from service.scheduler.local_head import LocalRayHead, free_port
from service.settings import Settings

log = logging.getLogger("memfit.embedded")


def run_dir(settings: Settings) -> Path:
    """Where a command records what it started (service/scheduler/lifetime.py), next to the data it serves."""
    return readiness.run_dir(settings)


def ray_for(settings: Settings, *, log_path: Path | None = None) -> tuple[Any, LocalRayHead | None]:
    """(RayJobs, the head we started or None). Starts a local head only without MEMFIT_RAY_ADDRESS."""
    head = local_head_for(settings, log_path=log_path)
    if head is not None:
        head.start()
    return ray_jobs_for(settings, head), head


def local_head_for(settings: Settings, *, log_path: Path | None = None) -> LocalRayHead | None:
    """The local head to start (not started yet), or None where MEMFIT_RAY_ADDRESS names a cluster."""
    if settings.ray_address:
        return None
    os.environ.setdefault("RAY_AUTH_MODE", settings.ray_auth_mode)
    num_cpus = max(4, os.cpu_count() or 1)
    return LocalRayHead(num_cpus=num_cpus, auth_mode=settings.ray_auth_mode, log_path=log_path,
                        record_dir=run_dir(settings))


def ray_jobs_for(settings: Settings, head: LocalRayHead | None):
    from service.scheduler.ray_jobs import RayJobs

    if head is None:
        return RayJobs(settings.ray_address, auth_mode=settings.ray_auth_mode)
    return RayJobs(head.dashboard_url, auth_mode=settings.ray_auth_mode, driver_log_dir=head.logs_dir)


def make_scheduler(settings: Settings, ray, sessions=None):
    from service.scheduler.loop import Scheduler
    from service.store import db

    if sessions is None:
        sessions = db.make_sessionmaker(db.make_engine(
            settings.database_url, pool_size=4, timeouts=db.DbTimeouts.from_settings(settings)))
    return Scheduler(sessions, settings, ray)


@contextmanager
def background_scheduler(settings: Settings, *, ray_log: Path | None = None,
                         after_api: str | None = None) -> Iterator[threading.Thread]:
    """The scheduler loop in a thread for as long as the block runs, and the Ray head it needs —
    started in that thread, so the caller serves HTTP at once. Until the scheduler reaches Ray,
    ``/readyz`` answers 503 with the reason (service/scheduler/readiness.py); jobs posted meanwhile
    are stored and wait in the queue. With ``after_api`` (the API's base URL) the head starts once
    that API answers ``/healthz``: on a small machine `ray start` would otherwise take the CPU the
    API needs to boot (at most ``API_FIRST_WAIT_S`` is waited)."""
    head = local_head_for(settings, log_path=ray_log)
    stop = threading.Event()
    up = threading.Event()  # the head (if ours) is up: from then on the loop, not start(), is to stop
    readiness.mark(settings, False, "starting the local Ray head" if head is not None
                   else f"connecting to the Ray Jobs API at {settings.ray_address}")

    def bring_up_and_run() -> None:
        try:
            if head is not None:
                if after_api:
                    _wait_for_health(after_api, stop)
                if stop.is_set():
                    return
                # One more try than a foreground start: nobody waits at a terminal for this one, and on a
                # loaded machine `ray start` misses its 30 s raylet registration now and then.
                head.start(attempts=3)
            up.set()
            if head is not None:  # the API's host-memory check reads the nodes from its dashboard
                publish_dashboard(settings, head.dashboard_url)
            ray = ray_jobs_for(settings, head)
            while not stop.is_set():
                try:
                    _ = ray.client  # connects: the Jobs API answered
                    break
                except Exception as exc:  # noqa: BLE001 - RayUnavailable: try again shortly
                    readiness.mark(settings, False, f"cannot reach the Ray Jobs API at {ray.address}: {exc}")
                    stop.wait(2)
            if stop.is_set():
                return
            scheduler = make_scheduler(settings, ray)
            readiness.mark(settings, True, f"Ray at {ray.address}")
            log.info("Ray is up (%s); scheduler starting", ray.address)
            scheduler.run(stop)
        except Exception as exc:  # noqa: BLE001 - reported; then the command ends, as it did before serving
            if stop.is_set():
                return
            log.exception("the scheduler could not start")
            readiness.mark(settings, False, f"the scheduler could not start: {exc}")
            if head is not None:
                # Our own head failed to start (twice): end `memfit serve` — what it started goes
                # with it — rather than serve an API that can never run a job.
                os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=bring_up_and_run, name="memfit-scheduler", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        if head is not None and not up.is_set():
            head.stop()  # still starting: it gives up, and what it started ends
        thread.join(30)
        if head is not None:
            head.stop()
            publish_dashboard(settings, None)
        readiness.clear(settings)


API_FIRST_WAIT_S = 20.0


def _wait_for_health(api_url: str, stop: threading.Event) -> None:
    import urllib.request

    deadline = time.monotonic() + API_FIRST_WAIT_S
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api_url.rstrip('/')}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        stop.wait(0.1)


def with_api_url(settings: Settings, host: str, port: int) -> Settings:
    """Workers post to the API where it really listens, unless MEMFIT_API_URL says otherwise."""
    if "api_url" in settings.model_fields_set:
        return settings
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return settings.model_copy(update={"api_url": f"http://{reach}:{port}"})


# --- memfit scheduler ------------------------------------------------------------------------------


def scheduler_main(settings: Settings) -> None:
    """Run the loop until SIGTERM/SIGINT; release our leases on the way out."""
    from service.scheduler.loop import Scheduler
    from service.store import db

    if settings.is_sqlite:
        db.upgrade(settings.database_url)
    with command_lifetime(run_dir(settings), "memfit scheduler"):
        ray, head = ray_for(settings)
        try:
            sessions = db.make_sessionmaker(db.make_engine(
                settings.database_url, pool_size=4, timeouts=db.DbTimeouts.from_settings(settings)))
            scheduler = Scheduler(sessions, settings, ray)
            stop = threading.Event()
            # Once running, a signal ends the loop at its next turn (leases released), not mid-step.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            scheduler.run(stop)
        finally:
            if head is not None:
                head.stop()


# --- the embedded service ---------------------------------------------------------------------------


@dataclass
class EmbeddedService:
    """API on a free port + scheduler thread + local Ray head (unless settings.ray_address)."""

    settings: Settings
    host: str = "127.0.0.1"
    port: int = 0
    log_dir: Path | None = None
    app: Any = None
    _server: Any = None
    _server_thread: threading.Thread | None = None
    _sched_thread: threading.Thread | None = None
    _sched_stop: threading.Event | None = None
    head: LocalRayHead | None = None
    scheduler: Any = None
    _started: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "EmbeddedService":
        import uvicorn

        from api.app import create_app
        from service.scheduler.loop import start_in_thread

        self.port = self.port or free_port()
        self.settings = self.settings.model_copy(update={"api_url": self.url})
        # The Ray head takes seconds to start: do it while the API migrates and boots.
        ray_box: dict[str, Any] = {}

        def start_ray():
            try:
                ray_box["ray"], ray_box["head"] = ray_for(
                    self.settings, log_path=self.log_dir / "ray-head.log" if self.log_dir else None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                ray_box["error"] = exc

        ray_thread = threading.Thread(target=start_ray, name="memfit-ray-start", daemon=True)
        ray_thread.start()
        try:
            try:
                self.app = create_app(self.settings)
                config = uvicorn.Config(WakeSchedulerOnPost(self.app), host=self.host, port=self.port,
                                        log_level="warning", lifespan="on", proxy_headers=True,
                                        forwarded_allow_ips=self.settings.forwarded_allow_ips)
                self._server = uvicorn.Server(config)
                self._server_thread = threading.Thread(target=self._server.run, name="memfit-api", daemon=True)
                self._server_thread.start()
                deadline = time.monotonic() + 60
                while not self._server.started:
                    if time.monotonic() > deadline or not self._server_thread.is_alive():
                        raise RuntimeError(f"the API did not start on {self.url}")
                    time.sleep(0.05)
                self._started.append("api")
            finally:
                _join_through_interrupts(ray_thread)  # the head it is starting must not slip past stop()
                self.head = ray_box.get("head")
            if "error" in ray_box:
                raise ray_box["error"]
            if self.head is not None and self.app.state.inference.apps is None:  # serving on the head we started
                self.app.state.inference.attach(self.head.dashboard_url)
            self.scheduler = make_scheduler(self.settings, ray_box["ray"], sessions=self.app.state.sessions)
            self._sched_thread, self._sched_stop = start_in_thread(self.scheduler)
        except BaseException:  # an error or a signal half-way: stop what did start (the Ray head above all)
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._sched_stop is not None:
            self._sched_stop.set()
            self._sched_thread.join(30)
            self._sched_stop = None
        if self._server is not None:
            self._server.should_exit = True
            self._server_thread.join(15)
            self._server = None
        if self.head is not None:
            self.head.stop()
            self.head = None

    def __enter__(self) -> "EmbeddedService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _join_through_interrupts(thread: threading.Thread) -> None:
    """Join even when Ctrl-C or SIGTERM (service.scheduler.lifetime.Stopped) arrives meanwhile; re-raise it after."""
    interrupted: BaseException | None = None
    while thread.is_alive():
        try:
            thread.join()
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def quiet_logging(log_file: Path) -> None:
    """`memfit run` shows a progress bar: service logs go to a file, not the terminal."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "ray.dashboard"):
        logging.getLogger(name).setLevel(logging.WARNING)


# --- memfit serve's API, answering while it boots ----------------------------------------------------


class BootingApp:
    """The ASGI app `memfit serve` gives uvicorn: it answers ``/healthz`` from the moment uvicorn
    listens and builds the real one (``api.app.create_app``: FastAPI, SQLAlchemy, the routes — seconds
    of imports on a small machine) in a thread meanwhile. Until that is done ``/readyz`` answers 503
    and every other request waits for it (none is refused); then each request goes straight to the
    real app, whose lifespan runs as uvicorn would run it. If it cannot be built, the error is
    logged and the process is ended by SIGTERM, as a failing uvicorn factory ends it."""

    def __init__(self, factory: Callable[[], Any] | None = None) -> None:
        self._factory = factory
        self._app: Any = None
        self._built = threading.Event()
        self._error: BaseException | None = None
        self._lifespan: Any = None  # (queue to the real app's lifespan, its task)
        threading.Thread(target=self._build, name="memfit-api-build", daemon=True).start()

    def _build(self) -> None:
        try:
            if self._factory is None:
                from api.app import create_app

                self._factory = create_app
            self._app = WakeSchedulerOnPost(self._factory())
        except BaseException as exc:  # noqa: BLE001 - reported, and the process ends
            self._error = exc
            log.exception("the API could not be built")
        finally:
            self._built.set()
        if self._error is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    async def _real_app(self):
        import asyncio

        if not self._built.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self._built.wait)
        if self._app is None:
            raise RuntimeError(f"the API could not be built: {self._error}")
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        app = self._app
        if app is not None and scope["type"] != "lifespan":
            return await app(scope, receive, send)
        if scope["type"] == "lifespan":
            return await self._run_lifespan(scope, receive, send)
        if scope["type"] == "http" and scope["path"] in ("/healthz", "/readyz"):
            starting = scope["path"] == "/readyz"
            body = b'{"status":"unavailable","api":"starting"}' if starting else b'{"status":"ok"}'
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if starting:
                headers.append((b"retry-after", b"1"))
            await send({"type": "http.response.start", "status": 503 if starting else 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        app = await self._real_app()
        await app(scope, receive, send)

    async def _run_lifespan(self, scope, receive, send) -> None:
        """Answer uvicorn's startup at once; start the real app's lifespan once it is built and end
        it at shutdown."""
        import asyncio

        message = await receive()
        assert message["type"] == "lifespan.startup"
        inbox: asyncio.Queue = asyncio.Queue()
        outbox: asyncio.Queue = asyncio.Queue()

        async def real_lifespan() -> None:
            app = await self._real_app()
            await inbox.put({"type": "lifespan.startup"})
            await app(scope, inbox.get, outbox.put)

        task = asyncio.ensure_future(real_lifespan())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        if self._app is not None and not task.done():
            await inbox.put({"type": "lifespan.shutdown"})
            try:  # the real lifespan returns once its shutdown is done
                await asyncio.wait_for(task, timeout=30)
            except Exception:  # noqa: BLE001 - a failing shutdown step must not stop the others
                log.exception("the API's shutdown failed")
        task.cancel()
        await send({"type": "lifespan.shutdown.complete"})


def booting_app() -> BootingApp:
    """The uvicorn factory `memfit serve` runs (``service.cli.embedded:booting_app``)."""
    return BootingApp()


class WakeSchedulerOnPost:
    """ASGI wrapper: once a job is created or resumed here, the scheduler in this process (if any)
    runs its next tick now instead of at the end of its poll interval (service/scheduler/loop.py: wake)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state  # where callers find the real app's settings and sessions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not _WAKING.match(scope.get("path", "")):
            return await self.app(scope, receive, send)
        from api.app import answered_status

        if await answered_status(self.app, scope, receive, send) < 300:
            from service.scheduler.loop import wake

            wake()


_WAKING = re.compile(r"^/v1/fine_tuning/jobs(/[^/]+/resume)?$")
