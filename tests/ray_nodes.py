"""More Ray nodes on this machine, each its own raylet joined to a head (`ray start --address=…`),
for the multi-node tests: what KubeRay's worker pods are to a real cluster.

Each node is a session we start and own (service/scheduler/lifetime.py Ownership: a token in the
environment of every process the node runs, its Ray workers included), so :meth:`RayNode.kill`
ends the whole node at once, as a machine that loses power would, and :meth:`RayNode.stop` leaves
nothing behind. Nodes start one at a time: several raylets registering at once on 2 cores miss
`ray start`'s 30 s registration deadline (../shared/measured-on-cpu.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service.scheduler.lifetime import OWNER_ENV, Ownership, chained, process_started
from service.ports import free_ports
from service.scheduler.local_head import LocalRayHead, ray_env


def _alive(head: LocalRayHead, query: str, timeout_s: float) -> list[dict]:
    """What the head's dashboard lists (its state API over HTTP: ray.util.state would ask the cluster that
    RAY_ADDRESS names instead, the session head's where a test has started it), the live ones."""
    with urllib.request.urlopen(f"{head.dashboard_url}/api/v0/{query}", timeout=timeout_s) as r:
        body = json.loads(r.read())
    listed = ((body.get("data") or {}).get("result") or {}).get("result") or []
    return [x for x in listed if x.get("state") == "ALIVE"]


def alive_nodes(head: LocalRayHead) -> list[dict]:
    return _alive(head, "nodes?limit=100", 10)


def alive_actors(head: LocalRayHead) -> list[dict]:
    return _alive(head, "actors?limit=1000&detail=true", 30)


@dataclass
class RayNode:
    head: LocalRayHead
    num_cpus: int = 1
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    ownership: Ownership = field(default_factory=lambda: Ownership(label="ray worker node"))
    # A host of its own (tests/netns.py): the node runs in that network namespace, at its address, with
    # a temp dir of its own, and outlives its head (a head restart must not take the node with it).
    host: object | None = None
    extra_env: dict = field(default_factory=dict)
    temp_dir: str | None = None
    outlive_head: bool = False  # on this host, but as a machine of its own: a head restart leaves it running
    name: str = field(default_factory=lambda: f"mfnode-{os.urandom(4).hex()}")  # its node_name in Ray's node list

    def start(self, timeout_s: float = 120.0) -> "RayNode":
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        before = len(alive_nodes(self.head))
        alone = self.host is not None or self.outlive_head
        if alone:
            import tempfile

            self.temp_dir = tempfile.mkdtemp(prefix="mfrn-", dir="/tmp")
        ip = self.host.address if self.host is not None else "127.0.0.1"
        ports = iter(free_ports(6))  # each daemon its own
        cmd = [ray_bin, "start", "--block", "--disable-usage-stats", f"--address={self.head.address}",
               f"--node-ip-address={ip}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               f"--temp-dir={self.temp_dir or self.head.temp_dir}",
               f"--node-manager-port={next(ports)}", f"--object-manager-port={next(ports)}", f"--node-name={self.name}",
               f"--metrics-export-port={next(ports)}", f"--runtime-env-agent-port={next(ports)}",
               f"--dashboard-agent-listen-port={next(ports)}", f"--dashboard-agent-grpc-port={next(ports)}"]
        env = ray_env(self.head.auth_mode)
        env.pop("RAY_ADDRESS", None)
        # The head's token and the node's: the head's stop() ends the node too, kill() only the node.
        # A node on a host of its own carries its token only: it outlives a head that is restarted.
        env[OWNER_ENV] = (self.ownership.token if alone
                          else chained(self.head.ownership.env_chain(), self.ownership.token))
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        env.update(self.extra_env)
        if self.host is not None:
            cmd = self.host.command(cmd)
        log = open(self.log_path or os.devnull, "ab")
        try:
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.ownership.session_pid = self.process.pid
        self.ownership.session_started = process_started(self.process.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray worker node exited with code {self.process.returncode}")
            if len(alive_nodes(self.head)) > before:
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ray worker node did not register with {self.head.address} within {timeout_s:.0f} s")

    def pids(self) -> set[int]:
        return {p.pid for p in self.ownership.processes()}

    def kill(self) -> list[str]:
        """SIGKILL every process of the node at once (`ray start`, raylet, agents, its Ray workers)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)
        left = self.ownership.end(timeout_s=20)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left

    stop = kill  # a node is disposable: nothing of it needs a graceful end
