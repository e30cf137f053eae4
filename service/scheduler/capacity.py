"""Can the cluster as it is now hold a running job? Asked while it runs, so that a lost node that leaves
the cluster too small is said at once instead of being a silent wait.

Ray Train places a job's workers (each ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs, all on
one node) on the live nodes, beside the job's driver (the Ray Jobs entrypoint's CPUs, somewhere). When a
node is lost and what remains cannot hold them, Ray Train waits for resources with no error (the
measurement in issue 37: a 2-rank job, 3 one-CPU nodes, one lost, still ``running`` 10 minutes later).
:func:`workers_that_fit` counts, from the nodes' total resources (the State API's ``resources_total``),
the most workers the cluster could hold with the driver placed where it leaves most room; the
scheduler (service/scheduler/loop.py: ``_watch_capacity``) compares it with what the job needs:
``num_workers``, or ``min_workers`` for an elastic job (which Ray Train then starts with the workers
there are room for, re-planned: service/memory/elastic.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.memory.nodes import NodeInfo

EPSILON = 1e-9


@dataclass(frozen=True)
class Demand:
    num_workers: int
    min_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    driver_cpus: float

    @classmethod
    def of(cls, spec: dict[str, Any], driver_cpus: float) -> "Demand":
        res = ((spec or {}).get("training") or {}).get("resources") or {}
        num = int(res.get("num_workers") or 1)
        low = res.get("min_workers")
        return cls(num, int(low) if low is not None and int(low) < num else num,
                   float(res.get("cpus_per_worker", 1.0)), float(res.get("gpus_per_worker", 0.0)), float(driver_cpus))

    def worker(self) -> str:
        parts = [f"{self.cpus_per_worker:g} CPU"] + ([f"{self.gpus_per_worker:g} GPU"] if self.gpus_per_worker else [])
        return " + ".join(parts)


def _fits(cpus: float, gpus: float, d: Demand) -> int:
    by_cpu = math.floor(cpus / d.cpus_per_worker + EPSILON) if d.cpus_per_worker > 0 else 10**6
    by_gpu = math.floor(gpus / d.gpus_per_worker + EPSILON) if d.gpus_per_worker > 0 else 10**6
    return max(0, min(by_cpu, by_gpu))


def workers_that_fit(nodes: list[NodeInfo], d: Demand) -> int:
    """The most workers of ``d`` the nodes hold, the driver's CPUs taken from the node where that costs least."""
    if not nodes:
        return 0
    whole = [_fits(n.cpus, n.gpus, d) for n in nodes]
    best = 0
    for i, n in enumerate(nodes):
        if n.cpus + EPSILON < d.driver_cpus:
            continue
        best = max(best, sum(whole) - whole[i] + _fits(n.cpus - d.driver_cpus, n.gpus, d))
    return best


def describe(nodes: list[NodeInfo]) -> str:
    if not nodes:
        return "no live node"
    return ", ".join(f"{n.cpus:g} CPU" + (f" + {n.gpus:g} GPU" if n.gpus else "") for n in nodes)
