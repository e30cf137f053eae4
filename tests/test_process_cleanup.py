"""Stopping memfit stops what it started: `memfit serve` and `memfit run` as real processes, stopped
the ways services are stopped (SIGTERM from systemd/Docker/`timeout`, Ctrl-C, an exception, SIGKILL),
and then no process of that run may remain — not the local Ray head, its raylet, GCS, dashboard and
agents, not the Ray job's driver (Ray puts it in a session of its own) nor its Ray Train workers, not
uvicorn's worker processes.

The test finds a run's processes on its own terms, not through memfit's records: every process gets
a unique MEMFIT_TEST_RUN in its environment (inherited by all descendants), the Ray head leads a
session whose members count too (some Ray processes overwrite their environment with their title),
and descendants of any of them. Whatever a failing test leaves is killed by that proof, never by name.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from service.scheduler.local_head import free_port

ROOT = Path(__file__).resolve().parent.parent
MEMFIT = Path(sys.executable).with_name("memfit")
TINY_JOB = ROOT / "examples" / "tiny-lora.yaml"
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


# --- finding a run's processes ---------------------------------------------------------------------


class Run:
    """One memfit process and everything it started, found by the marker in their environment."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.mark = f"{name}-{secrets.token_hex(6)}"
        self.since = time.time() - 1
        self.home = tmp_path
        self.sessions: set[int] = set()
        self.temp_dirs: set[str] = set()
        self.ports: set[int] = set()
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMFIT_", "RAY_ADDRESS"))}
        env.update({
            "MEMFIT_TEST_RUN": self.mark,
            "MEMFIT_PRESET_CACHE": str(self.home / "presets"),
            "MEMFIT_DATABASE_URL": f"sqlite:///{self.home / 'memfit.db'}",
            "MEMFIT_STORAGE_DIR": str(self.home / "storage"),
            "RAY_AUTH_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "COLUMNS": "120",
        })
        return env

    def _marked(self, proc: psutil.Process) -> bool:
        try:
            return proc.environ().get("MEMFIT_TEST_RUN") == self.mark
        except psutil.Error:
            return False

    def processes(self) -> list[psutil.Process]:
        """Live, non-zombie processes of this run (the test process itself excepted)."""
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter():
            try:
                if proc.create_time() < self.since:
                    continue
                if self._marked(proc):
                    found[proc.pid] = proc
                    if os.getsid(proc.pid) == proc.pid:
                        self.sessions.add(proc.pid)  # `ray start` leads a session: its members are ours
                elif os.getsid(proc.pid) in self.sessions:
                    found[proc.pid] = proc
            except (psutil.Error, OSError):
                continue
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.Error:
                continue
        alive = []
        for proc in found.values():
            try:
                if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = proc.cmdline()
                alive.append(proc)
            except psutil.Error:
                continue
            if len(cmd) > 2 and cmd[1].endswith("ray") and cmd[2] == "start":
                for arg in cmd:
                    if arg.startswith("--temp-dir="):
                        self.temp_dirs.add(arg.split("=", 1)[1])
                    if arg.startswith(("--port=", "--dashboard-port=")):
                        self.ports.add(int(arg.split("=", 1)[1]))
        return alive

    def names(self) -> list[str]:
        out = []
        for proc in self.processes():
            try:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
            except psutil.Error:
                continue
        return out

    def has(self, title: str) -> bool:
        for proc in self.processes():
            try:
                if any(title in part for part in proc.cmdline()):
                    return True
            except psutil.Error:
                continue
        return False

    def listeners(self, ports: set[int] | None = None) -> list[str]:
        """Whoever listens on this run's ports (the API's, the Ray GCS's and dashboard's)."""
        ports = self.ports if ports is None else ports
        return [f"{c.laddr.port} (pid {c.pid})" for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]

    def uvicorn_workers(self) -> list[psutil.Process]:
        out = []
        for proc in self.processes():
            try:
                if proc.ppid() == self.proc.pid and "spawn_main" in " ".join(proc.cmdline()):
                    out.append(proc)
            except psutil.Error:
                continue
        return out

    def kill_leftovers(self) -> None:
        """After a failed test: SIGKILL what this run left (proven by the marker) until none is left,
        and remove its Ray temp dirs."""
        for _ in range(20):
            procs = self.processes()
            if not procs:
                break
            for proc in procs:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=2)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)

    def assert_nothing_left(self) -> None:
        assert self.proc is not None and self.proc.poll() is not None, "memfit has not exited"
        left = self.names()
        assert left == [], "processes of the stopped run are still alive:\n" + "\n".join(left)
        assert self.listeners() == []
        assert [d for d in self.temp_dirs if Path(d).exists()] == []
        records = self.home / "storage" / "run"
        assert not records.exists() or list(records.glob("*.json")) == []


@pytest.fixture
def runs(tmp_path):
    made: list[Run] = []

    def make(name: str) -> Run:  # runs of one test share its tmp_path: one storage dir, one database
        run = Run(tmp_path, name)
        made.append(run)
        return run

    yield make
    for run in made:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(30)
        run.kill_leftovers()


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"memfit exited ({proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def start_serve(run: Run, port: int, *args: str) -> Path:
    log = run.home / f"serve-{run.mark}.log"
    run.ports.add(port)
    run.proc = subprocess.Popen([str(MEMFIT), "serve", "--port", str(port), *args], cwd=run.home, env=run.env(),
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return log


def serve_until_ray_is_up(run: Run, port: int, *args: str) -> Path:
    """`memfit serve` on SQLite with its local Ray head; returns once /readyz answers 200 (the head
    starts in the background after the API answers) and the head's processes are seen."""
    log = start_serve(run, port, *args)
    wait_for(lambda: ready(port), 240, "/readyz", run.proc, log)
    wait_for(lambda: run.has("raylet") and run.has("gcs_server"), 30, "the Ray head's raylet and GCS")
    return log


def training(run: Run) -> bool:
    """The Ray job is mid-flight: its driver (`workers.run`, in a session of its own) and Ray Train workers."""
    return run.has("workers.run") and run.has("ray::RayTrainWorker")


def job_status(run: Run) -> str:
    with sqlite3.connect(run.home / "memfit.db") as db:
        return db.execute("SELECT status FROM jobs").fetchone()[0]


# --- memfit serve ----------------------------------------------------------------------------------


def test_serve_sigterm_ends_the_ray_head_it_started(runs):
    run = runs("serve-term")
    port = free_port()
    serve_until_ray_is_up(run, port)
    assert run.temp_dirs and len(run.ports) == 3  # the API's, the GCS's and the dashboard's

    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(120) == -signal.SIGTERM  # it ends the way SIGTERM ends a process
    run.assert_nothing_left()


def test_serve_ctrl_c_while_its_ray_head_starts_ends_the_head(runs):
    """Ctrl-C (SIGINT) while the local Ray head is still starting, the 10–60 s of every start here."""
    run = runs("serve-int")
    port = free_port()
    log = start_serve(run, port)
    wait_for(lambda: run.has("--head") and run.has("gcs_server"), 120, "the Ray head's GCS", run.proc, log)
    assert not ready(port)  # the API may answer already; it is not ready while its head starts

    run.proc.send_signal(signal.SIGINT)
    run.proc.wait(120)
    run.assert_nothing_left()
    assert run.proc.returncode == -signal.SIGINT  # it ends the way SIGINT ends a process


def test_serve_after_sigkill_ends_what_the_killed_one_left(runs):
    first = runs("serve-killed")
    port = free_port()
    serve_until_ray_is_up(first, port, "--workers", "2")
    wait_for(lambda: len(first.uvicorn_workers()) == 2, 60, "uvicorn's two worker processes", first.proc)
    workers = first.uvicorn_workers()
    first.proc.kill()
    first.proc.wait(30)
    # What SIGKILL leaves: the whole Ray head, and uvicorn's workers, still serving on the port.
    assert first.has("raylet") and first.has("gcs_server")
    assert all(w.is_running() for w in workers) and healthy(port)

    second = runs("serve-next")  # the same storage dir, the same port
    log = start_serve(second, port, "--workers", "2")

    def second_listens() -> bool:
        pids = {p.pid for p in second.processes()}
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid in pids
                   for c in psutil.net_connections("tcp"))

    wait_for(second_listens, 240, "the second `memfit serve` to listen on the port", second.proc, log)
    left = first.names()
    assert left == [], "the killed run's processes are still alive:\n" + "\n".join(left)
    assert [d for d in first.temp_dirs if Path(d).exists()] == []
    assert first.listeners(first.ports - {port}) == []  # its GCS and dashboard ports

    second.proc.send_signal(signal.SIGTERM)
    second.proc.wait(120)
    second.assert_nothing_left()


# --- memfit run ------------------------------------------------------------------------------------


def test_run_stopped_by_timeout_ends_the_job_and_the_ray_head(runs):
    """`timeout -s TERM N memfit run …`: timeout sends SIGTERM to memfit; sent here once the job trains."""
    run = runs("run-timeout")
    log = run.home / "run.log"
    run.proc = subprocess.Popen(["timeout", "-s", "TERM", "900", str(MEMFIT), "run", str(TINY_JOB)], cwd=run.home,
                                env=run.env(), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: training(run), 360, "the job's driver and Ray Train workers", run.proc, log)

    run.proc.send_signal(signal.SIGTERM)  # to `timeout`, which passes it on to memfit
    run.proc.wait(120)
    run.assert_nothing_left()
    assert job_status(run) != "succeeded"  # it was stopped mid-job


def test_run_failing_to_start_ends_the_ray_head_it_had_started(runs):
    """An exception half-way through starting: the database file is not a database (a crash, a
    foreign file), so the API fails while the Ray head, started alongside it, comes up."""
    run = runs("run-bad-db")
    (run.home / "memfit.db").write_bytes(b"this is not an SQLite database\n" * 200)
    log = run.home / "run.log"
    run.proc = subprocess.Popen([str(MEMFIT), "run", str(TINY_JOB)], cwd=run.home, env=run.env(),
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)
    saw_head = False
    deadline = time.monotonic() + 300
    while run.proc.poll() is None and time.monotonic() < deadline:
        saw_head = saw_head or (run.has("raylet") and run.has("gcs_server"))
        time.sleep(0.5)

    assert run.proc.wait(60) == 1
    assert "file is not a database" in log.read_text()
    assert saw_head and run.temp_dirs  # the head was up: there was something to stop
    run.assert_nothing_left()


# --- the record: what the next start may end, and what it must not ---------------------------------

OWNER_SCRIPT = """
import os, subprocess, sys, time
from pathlib import Path
from service.scheduler.lifetime import OWNER_ENV, Ownership
own = Ownership(label="owner").in_record(Path(sys.argv[1]))
os.environ[OWNER_ENV] = own.env_chain()
a = subprocess.Popen(["sleep", "300"])
b = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as Ray's job drivers do
print(a.pid, b.pid, flush=True)
time.sleep(300)
"""


def test_next_start_ends_only_what_a_dead_owners_record_proves(tmp_path):
    import json

    from service.scheduler.lifetime import reap_stale

    run_dir = tmp_path / "run"
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(run_dir)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    children: list[psutil.Process] = []
    bystander = None
    try:
        children = [psutil.Process(int(pid)) for pid in owner.stdout.readline().split()]
        bystander = subprocess.Popen(["sleep", "300"])  # younger than the record, but without its token
        record = next(run_dir.glob("*.json"))
        gone = subprocess.Popen(["true"])
        gone.wait()
        # The same token in a record written on another machine that shares the storage dir, its owner
        # (a pid number there) gone here: only the host in the record keeps us off these processes.
        foreign = json.loads(record.read_text()) | {"host": "another-machine", "owner_pid": gone.pid}
        (run_dir / "foreign.json").write_text(json.dumps(foreign))

        assert reap_stale(run_dir) == []  # the owner is alive: its processes are its own business
        assert all(c.is_running() for c in children)

        owner.kill()
        owner.wait(10)
        ended = reap_stale(run_dir)
        assert sorted(int(e.split()[0]) for e in ended) == sorted(c.pid for c in children)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert bystander.poll() is None
        assert sorted(p.name for p in run_dir.iterdir()) == ["foreign.json"]  # left for its own host
    finally:
        for proc in [owner] + ([bystander] if bystander else []):
            proc.kill()
            proc.wait(10)
        for child in children:  # the owner printed their pids: ours to end if the test failed early
            try:
                child.kill()
            except psutil.Error:
                pass
