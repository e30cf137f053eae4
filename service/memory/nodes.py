"""The Ray nodes' memory, CPUs and GPUs, for the host-memory check at admission — without importing ray.

Where from, in order:

1. ``MEMFIT_CLUSTER_NODES`` (settings.cluster_nodes): the operator's description of the nodes, used as
   it is (a cluster whose dashboard memfit cannot reach, or a fixed fleet);
2. Ray's dashboard, over HTTP — the State API's ``GET /api/v0/nodes``, the one the Jobs API client's
   head already answers (service/scheduler/local_head.py reads it to tell a head is up). Each ALIVE
   node's ``resources_total``: ``CPU``, ``GPU``, and its memory as ``memory + object_store_memory`` —
   what Ray found available when the node started, cgroup limits included
   (ray/_private/resource_and_label_spec.py: ``memory = available − object_store_memory`` unless set
   by hand). The dashboard is ``MEMFIT_RAY_ADDRESS``, or the local head `memfit serve` started (it
   publishes its address with :func:`publish_dashboard`).

Answers are cached per address (``TTL_S``; a failure for ``FAILED_TTL_S``, so that admission does not
wait on a dead head for every request), each request bounded by ``TIMEOUT_S``. Ray unreachable and
nothing in the settings: :class:`ClusterNodes` with no nodes and the reason, and the plan says the host
memory was not checked.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service.settings import Settings

TTL_S = 30.0
FAILED_TTL_S = 10.0
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    memory_bytes: int
    cpus: float
    gpus: float


@dataclass
class ClusterNodes:
    nodes: list[NodeInfo] = field(default_factory=list)
    source: str | None = None  # "settings" | "ray"
    error: str | None = None  # why there are none


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


def _published_path(settings: Settings) -> Path:
    return settings.storage_dir / "run" / "ray-dashboard.json"


def publish_dashboard(settings: Settings, url: str | None) -> None:
    """Record (or, with None, forget) the dashboard of the local head a memfit command started, for the
    API processes that serve beside it (`memfit serve --workers N` forks them)."""
    path = _published_path(settings)
    if url is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(part, path)


def dashboard_address(settings: Settings) -> str | None:
    if settings.ray_address:
        return settings.ray_address.rstrip("/")
    try:
        return json.loads(_published_path(settings).read_text())["url"].rstrip("/")
    except (OSError, ValueError, KeyError):
        return None


_cache: dict[str, tuple[float, ClusterNodes]] = {}
_lock = threading.Lock()


def cluster_nodes(settings: Settings) -> ClusterNodes:
    """The nodes (see the module docstring), cached."""
    if settings.cluster_nodes:
        # identical nodes fill alike: one of each kind is checked
        nodes = [NodeInfo(f"settings-{i}", n.memory_bytes, n.cpus, n.gpus) for i, n in enumerate(settings.cluster_nodes)]
        return ClusterNodes(nodes, "settings")
    address = dashboard_address(settings)
    if address is None:
        return ClusterNodes(error="no Ray dashboard address (MEMFIT_RAY_ADDRESS) and no MEMFIT_CLUSTER_NODES")
    now = time.monotonic()
    with _lock:
        hit = _cache.get(address)
        if hit is not None and hit[0] > now:
            return hit[1]
    answer = read_ray_nodes(address, settings.ray_auth_mode)
    with _lock:
        _cache[address] = (now + (TTL_S if answer.nodes else FAILED_TTL_S), answer)
    return answer


def read_ray_nodes(address: str, auth_mode: str = "disabled", timeout_s: float = TIMEOUT_S) -> ClusterNodes:
    """The ALIVE nodes Ray's State API lists at ``address`` (uncached)."""
    request = urllib.request.Request(f"{address}/api/v0/nodes?detail=1", headers=auth_headers(auth_mode))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except (OSError, ValueError) as exc:
        return ClusterNodes(error=f"Ray's dashboard at {address} did not answer: {exc}")
    rows = ((body.get("data") or {}).get("result") or {}).get("result") or []
    nodes = []
    for row in rows:
        if row.get("state") != "ALIVE":
            continue
        res = row.get("resources_total") or {}
        memory = int(res.get("memory", 0) + res.get("object_store_memory", 0))
        if memory > 0:
            nodes.append(NodeInfo(str(row.get("node_id")), memory, float(res.get("CPU", 0)), float(res.get("GPU", 0))))
    if not nodes:
        return ClusterNodes(error=f"Ray's dashboard at {address} lists no live node with memory")
    return ClusterNodes(nodes, "ray")
