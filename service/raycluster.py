"""A local Ray head that memfit starts, owns and stops — and nothing else.

The embedded service (`memfit run`, `memfit serve` without MEMFIT_RAY_ADDRESS) and the test suite
share this: `ray start --head --block` as a child process on free, non-default ports, so that
stopping it stops exactly the Ray processes we started (never `ray stop`, which kills every Ray
process of the user on the host). No ray import here: this module runs in the service process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env(auth_mode: str = "disabled") -> dict[str, str]:
    """Environment for every Ray process and client we start: auth mode set explicitly (Ray 2.60
    turns token auth on for local clusters otherwise) and no usage reporting."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = auth_mode
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    return env


def auth_headers(auth_mode: str) -> dict[str, str]:
    """The header Ray's dashboard wants in token mode (it answers 401 otherwise), with the token
    found where Ray looks for it: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token."""
    if auth_mode != "token":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        try:
            token = path.read_text().strip()
        except OSError:
            return {}
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass
class LocalRayHead:
    num_cpus: int = 8
    auth_mode: str = "disabled"
    log_path: Path | None = None
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    temp_dir: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout_s: float = 180.0) -> "LocalRayHead":
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        if ray_bin is None:
            raise RuntimeError("the `ray` command is not installed; install memfit with the [train] extra")
        # A short temp dir: Ray's unix socket paths must stay under 107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="mfray-", dir="/tmp")
        min_worker = free_port()
        cmd = [
            ray_bin, "start", "--head", "--block", "--disable-usage-stats",
            f"--port={self.gcs_port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.num_cpus}", "--num-gpus=0",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        ]
        del min_worker
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # start_new_session: the head and everything it forks form one process group we can signal.
        self.process = subprocess.Popen(
            cmd, env=ray_env(self.auth_mode), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray head exited with code {self.process.returncode} (log: {self.log_path})")
            # The dashboard answers before the raylet has registered the node; a job submitted
            # then waits for minutes or fails, so "up" means the Jobs API answers AND a node is alive.
            if self._node_alive():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ray head at {self.dashboard_url} had no live node within {timeout_s:.0f} s")

    def _node_alive(self) -> bool:
        request = urllib.request.Request(f"{self.dashboard_url}/api/v0/nodes", headers=auth_headers(self.auth_mode))
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return False
        nodes = ((body.get("data") or {}).get("result") or {}).get("result") or []
        return any(n.get("state") == "ALIVE" for n in nodes)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the head we started and every process in its group; nothing else."""
        if self.process is None:
            return
        pgid = self.process.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # Workers Ray forked into the same session may outlive the head briefly: finish them.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_session_leftovers(pgid)
        self.process = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _kill_session_leftovers(sid: int) -> None:
    """Ray daemons call setsid() for some children; find processes whose session is ours or whose
    command line names our temp dir and end them."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == sid:
                proc.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
