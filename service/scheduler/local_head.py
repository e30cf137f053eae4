"""A local Ray head that memfit starts, owns and stops — and nothing else.

The embedded service (`memfit run`, `memfit serve` without MEMFIT_RAY_ADDRESS) and the test suite
share this: `ray start --head --block` as a child process on free, non-default ports, so that
stopping it stops exactly the Ray processes we started (never `ray stop`, which kills every Ray
process of the user on the host; how a process is known to be ours: service/scheduler/lifetime.py). No ray
import here: this module runs in the service process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service.memory.nodes import auth_headers
from service.ports import free_port, free_ports
from service.scheduler.lifetime import OWNER_ENV, Ownership, process_started

__all__ = ["LocalRayHead", "free_port", "ray_env"]  # free_port: imported from here by tests and the CLI


def ray_env(auth_mode: str = "disabled") -> dict[str, str]:
    """Environment for every Ray process and client we start: auth mode set explicitly (Ray 2.60
    turns token auth on for local clusters otherwise) and no usage reporting."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = auth_mode
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    return env


@dataclass
class LocalRayHead:
    """``ray start --head --block`` as a session leader we own. Its Ownership (a token in every Ray
    process's environment, its session, its temp dir; recorded under ``record_dir`` when given, so the
    next memfit start ends it after a SIGKILL) lets ``stop()`` end the processes Ray moves out of
    the head's process group (each worker gets its own) and out of its session (job drivers, and the
    shell loop watching each driver, call setsid)."""

    num_cpus: int = 8
    auth_mode: str = "disabled"
    # The address the head binds and other nodes reach it at (another interface than loopback where
    # nodes run elsewhere: tests/test_topology.py's nodes live in network namespaces of their own).
    node_ip: str = "127.0.0.1"
    # More environment for the head's processes (e.g. RAY_REDIS_ADDRESS for GCS fault tolerance).
    extra_env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    record_dir: Path | None = None
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    temp_dir: str | None = None
    ownership: Ownership | None = None
    # stop() may come from another thread while start() waits for the node (`memfit serve` starts
    # its head in the background): after it, start() starts nothing more and gives up.
    _stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.node_ip}:{self.dashboard_port}"

    @property
    def logs_dir(self) -> Path | None:
        """Where this head writes its logs, job drivers' (``job-driver-<submission id>.log``) included."""
        return Path(self.temp_dir) / "session_latest" / "logs" if self.temp_dir else None

    def start(self, timeout_s: float = 180.0, *, attempts: int = 2) -> "LocalRayHead":
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        if ray_bin is None:
            raise RuntimeError("the `ray` command is not installed; install memfit with the [train] extra")
        with self._lock:
            if self._stopped:
                raise RuntimeError("the local Ray head was stopped while it started")
            # A short temp dir: Ray's unix socket paths must stay under 107 characters.
            self.temp_dir = tempfile.mkdtemp(prefix="mfray-", dir="/tmp")
            # Recorded before anything starts: a SIGKILL from here on leaves a record to clean up after.
            self.ownership = Ownership(label=f"ray head {self.address}",
                                       temp_dir=self.temp_dir).in_record(self.record_dir)
        if self.dashboard_port == self.gcs_port:  # two default picks can meet
            self.dashboard_port = free_ports(1, taken=(self.gcs_port,))[0]
        ports = iter(free_ports(7, taken=(self.gcs_port, self.dashboard_port)))
        cmd = [
            ray_bin, "start", "--head", "--block", "--disable-usage-stats",
            f"--port={self.gcs_port}",
            f"--node-ip-address={self.node_ip}",
            f"--num-cpus={self.num_cpus}", "--num-gpus=0",
            "--include-dashboard=true", f"--dashboard-host={self.node_ip}",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={next(ports)}",
            f"--dashboard-agent-grpc-port={next(ports)}",
            f"--metrics-export-port={next(ports)}",
            f"--runtime-env-agent-port={next(ports)}",
            f"--ray-client-server-port={next(ports)}",
            f"--node-manager-port={next(ports)}",
            f"--object-manager-port={next(ports)}",
            f"--temp-dir={self.temp_dir}",
        ]
        env = ray_env(self.auth_mode)
        # A head of its own: a RAY_ADDRESS inherited from the caller (another cluster's) would have
        # its dashboard and job supervisors talk to that cluster's GCS instead.
        env.pop("RAY_ADDRESS", None)
        env[OWNER_ENV] = self.ownership.env_chain()
        # On SIGTERM `ray start --block` first drains the node for up to 30 s (for Ray Serve) before
        # it stops its daemons; we stop the whole head at once, so the drain only delays the stop.
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        env.update(self.extra_env)
        log_path = self.log_path or Path(self.temp_dir) / "ray-start.log"
        try:
            with self._lock:
                if self._stopped:
                    raise RuntimeError("the local Ray head was stopped while it started")
                log = open(log_path, "ab")
                try:
                    # start_new_session: `ray start` leads a session (and process group) of its own, out
                    # of reach of the terminal's Ctrl-C, and that session is part of what we own.
                    self.process = process = subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                finally:
                    log.close()
                self.ownership.session_pid = process.pid
                self.ownership.session_started = process_started(process.pid)
                self.ownership.save()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self._stopped:
                    raise RuntimeError("the local Ray head was stopped while it started")
                if process.poll() is not None:
                    raise RuntimeError(f"ray head exited with code {process.returncode}: {_last_line(log_path)}")
                # The dashboard answers before the raylet has registered the node; a job submitted
                # then waits for minutes or fails, so "up" means the Jobs API answers AND a node is alive.
                if self._node_alive():
                    return self
                time.sleep(0.5)
            raise RuntimeError(f"ray head at {self.dashboard_url} had no live node within {timeout_s:.0f} s")
        except RuntimeError as exc:
            with self._lock:
                self._stop(timeout_s=20.0)  # not stop(): that would also refuse the retry below
            # `ray start` gives the raylet a hard-coded 30 s to register with the GCS, too little on a
            # loaded machine ("The current node timed out during startup"), and a daemon's port may be
            # taken by another server between its pick and its bind ("… the same port is not used by
            # multiple components"): try once more, from scratch, with fresh picks.
            if attempts > 1 and not self._stopped and any(
                    sign in str(exc) for sign in ("timed out during startup", "same port is not used")):
                return self.start(timeout_s, attempts=attempts - 1)
            raise
        except BaseException:  # an exception or a signal while waiting: stop what started
            with self._lock:
                self._stop(timeout_s=20.0)
            raise

    def _node_alive(self) -> bool:
        request = urllib.request.Request(f"{self.dashboard_url}/api/v0/nodes", headers=auth_headers(self.auth_mode))
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return False
        nodes = ((body.get("data") or {}).get("result") or {}).get("result") or []
        return any(n.get("state") == "ALIVE" for n in nodes)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the head we started and every process it forked, wherever Ray put it; nothing else.
        Safe from another thread while start() runs: it then starts nothing more."""
        with self._lock:
            self._stopped = True
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        if self.process is not None:
            # SIGTERM to `ray start` and its daemons: `ray start` stops raylet, GCS, dashboard and agents
            # and the raylet its workers — but not the job drivers, which live in sessions of their own.
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=max(1.0, timeout_s / 2))
            except subprocess.TimeoutExpired:
                pass
        if self.ownership is not None:
            self.ownership.end(timeout_s=max(5.0, timeout_s / 2))  # SIGKILL whatever is left; rm temp dir
        elif self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.process is not None:
            try:
                self.process.wait(timeout=5)  # reap our child
            except subprocess.TimeoutExpired:
                pass
        self.process = None
        self.ownership = None


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return lines[-1] if lines else "(no output)"
