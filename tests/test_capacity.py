"""Can the cluster as it is hold a job (service/scheduler/capacity.py)? The arithmetic, on the shapes of
issue 37's measurement: a 2-rank job of one CPU per worker, its driver 0.1 CPU."""

from __future__ import annotations

from service.memory.nodes import NodeInfo
from service.scheduler.capacity import Demand, describe, workers_that_fit


def nodes(*cpus: float, gpus: float = 0) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", 8 << 30, c, gpus) for i, c in enumerate(cpus)]


def test_three_one_cpu_nodes_hold_two_ranks_and_the_driver_two_do_not():
    job = Demand.of({"training": {"resources": {"num_workers": 2, "cpus_per_worker": 1}}}, driver_cpus=0.1)
    assert (job.num_workers, job.min_workers) == (2, 2)
    assert workers_that_fit(nodes(1, 1, 1), job) == 2  # the driver on one node, a rank on each of the others
    assert workers_that_fit(nodes(1, 1), job) == 1  # the measurement's hang: 0.9 + 1 CPU left, 2 ranks of 1
    assert workers_that_fit(nodes(1, 1), Demand.of({"training": {"resources": {"num_workers": 2}}}, 0)) == 2
    assert workers_that_fit(nodes(0, 1, 1), job) == 1  # a head with no CPUs cannot take the driver
    assert workers_that_fit([], job) == 0
    assert describe(nodes(1, 2)) == "1 CPU, 2 CPU" and describe([]) == "no live node"


def test_an_elastic_job_needs_only_its_min_workers_and_gpus_count_per_node():
    elastic = Demand.of({"training": {"resources": {"num_workers": 4, "min_workers": 2, "cpus_per_worker": 2}}}, 0.1)
    assert (elastic.num_workers, elastic.min_workers) == (4, 2)
    assert workers_that_fit(nodes(4, 2), elastic) == 2  # 3.9 → 1, 2 → 1: two of the four
    gpu = Demand.of({"training": {"resources": {"num_workers": 8, "gpus_per_worker": 1, "cpus_per_worker": 1}}}, 0.1)
    assert workers_that_fit(nodes(16, 16, gpus=4), gpu) == 8 and workers_that_fit(nodes(16, gpus=4), gpu) == 4
    assert gpu.worker() == "1 CPU + 1 GPU"
