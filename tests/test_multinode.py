"""Several Ray nodes, really (issue 12, items 4 and 5): a head with no CPUs of its own and three
worker nodes of one CPU each, every one its own raylet on this machine (tests/ray_nodes.py), memfit's
API and scheduler pointed at the head. A 2-worker job puts its ranks on two different nodes; one of
those nodes is then killed mid-job (every process of it, SIGKILL), and the job still ends
``succeeded``: the lost ranks are restarted on the nodes that remain and training resumes from the
latest checkpoint — by Ray Train's own failure handling, or, where the surviving ranks are left
waiting in a collective with no error, by memfit's stall detection."""

from __future__ import annotations

import time

import psutil
import pytest

from service.scheduler.local_head import LocalRayHead
from service.scheduler.ray_jobs import RayJobs
from tests.ray_nodes import RayNode, alive_nodes
from tests.stack import Stack

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray", reason="the [train] extra is not installed")
    logs = tmp_path_factory.mktemp("multinode")
    head = LocalRayHead(num_cpus=0, log_path=logs / "head.log").start()
    nodes: list[RayNode] = []
    try:
        for i in range(3):  # one at a time (tests/ray_nodes.py)
            nodes.append(RayNode(head, num_cpus=1, log_path=logs / f"node{i}.log").start())
        assert len(alive_nodes(head)) == 4
        yield head, nodes
    finally:
        for node in nodes:
            node.stop()
        head.stop()


def train_workers_by_node(nodes: list[RayNode]) -> dict[int, list[int]]:
    """node index → pids of the Ray Train worker processes it runs."""
    out: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for proc in node.ownership.processes():
            try:
                if "RayTrainWorker" in " ".join(proc.cmdline()):
                    out.setdefault(i, []).append(proc.pid)
            except psutil.Error:
                continue
    return out


@pytest.fixture(scope="module")
def stack(cluster, new_database, tmp_path_factory):
    head, _ = cluster
    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("multinode-storage"), head)
        # No entrypoint CPUs: the driver runs on the head (Ray's default), so every worker node's
        # CPU is free for a rank, and losing a worker node never takes the driver with it.
        s.ray = RayJobs(head.dashboard_url, entrypoint_num_cpus=0, driver_log_dir=head.logs_dir)
        s.start_scheduler()
        yield s
        s.close()


def ranks_on_two_nodes(stack, nodes, job_id) -> dict[int, list[int]]:
    hosts = stack.wait_until(lambda: (h := train_workers_by_node(nodes)) and sum(map(len, h.values())) == 2 and h,
                             300, "both ranks' worker processes", job_id=job_id)
    assert len(hosts) == 2, hosts  # one rank per node: each node has one CPU
    return hosts


def placements(stack, job_id: str) -> list[tuple[int, str]]:
    """(rank, Ray node id) as the ranks' telemetry reported them, in order."""
    return [(e["data"]["rank"], e["data"]["node_id"]) for e in stack.events(job_id)
            if e["message"].startswith("Rank ") and "runs on Ray node" in e["message"]]


def test_an_fsdp_job_spans_two_nodes(cluster, stack):
    head, nodes = cluster
    job_id = stack.create(strategy="fsdp", hyperparameters={"max_steps": 12}, checkpoint_every_steps=6)
    ranks_on_two_nodes(stack, nodes, job_id)
    job = stack.wait(job_id, ("succeeded",))
    placed = dict(placements(stack, job_id))
    worker_nodes = {n["node_id"] for n in alive_nodes(head) if not n.get("is_head_node")}
    assert sorted(placed) == [0, 1] and len(set(placed.values())) == 2 and set(placed.values()) <= worker_nodes, placed
    assert stack.metrics_steps(job_id, 0) == list(range(1, 13)) and stack.metrics_steps(job_id, 1) == list(range(1, 13))
    assert job["fine_tuned_model"]
    # The full fine-tune over HTTP exports one model that loads (tests/test_e2e.py's other strategies' twin).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stack.artifacts(job)["model"])
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_ddp_job_spans_two_nodes_and_survives_losing_one(cluster, stack):
    head, nodes = cluster
    job_id = stack.create(hyperparameters={"max_steps": 40}, checkpoint_every_steps=4,
                          stall_timeout_s=30, max_failures=2)
    checkpoints = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
    ckpt = stack.wait_until(lambda: stack.http.get(checkpoints, headers=stack.auth).json()["data"],
                            what="the first checkpoint", job_id=job_id)
    first_ckpt = ckpt[-1]["step_number"]
    stack.wait_until(lambda: max(stack.metrics_steps(job_id), default=0) > first_ckpt + 1,
                     what="steps past the checkpoint", job_id=job_id)
    hosts = ranks_on_two_nodes(stack, nodes, job_id)
    victim = min(hosts)
    before = {n["node_id"] for n in alive_nodes(head)}
    first = dict(placements(stack, job_id))
    assert sorted(first) == [0, 1] and len(set(first.values())) == 2, first  # as the ranks report it
    killed_at = time.monotonic()
    nodes[victim].kill()
    job = stack.wait(job_id, ("succeeded",), timeout=600)
    [lost] = before - {n["node_id"] for n in alive_nodes(head)}
    assert lost in first.values()
    moved = placements(stack, job_id)[2:]  # the restarted ranks (an unchanged placement is said once)
    assert moved and all(node != lost for _, node in moved), (lost, moved)
    recovered_s = time.monotonic() - killed_at
    events = stack.events(job_id)
    messages = [e["message"] for e in events]
    restarted = [m.splitlines()[0] for m in messages
                 if m.startswith(("Ray Train restarted", "worker group failed", "No training step for"))]
    assert restarted, messages
    told = [(e["data"]["source"], e["data"]["error_count"]) for e in events if e["message"].startswith("Ray Train restarted")]
    assert len(told) == len(set(told)), told  # each of Ray Train's retry decisions told once
    steps = sorted({e["data"]["step"] for e in events if e["type"] == "metrics" and e["data"]["rank"] == 0})
    assert steps == list(range(1, 41)), steps
    checkpointed = {c["step_number"] for c in stack.http.get(f"{checkpoints}?limit=100", headers=stack.auth).json()["data"]}
    resumed = [e["data"]["step"] for e in events if e["message"].startswith("Resumed from the checkpoint of step")]
    assert resumed and all(s in checkpointed and s >= first_ckpt for s in resumed), (resumed, checkpointed, messages)
    assert len(alive_nodes(head)) == 3  # the ranks ran on, and finished on, the nodes that remain
    print(f"killed node {victim} after checkpoint {first_ckpt}; succeeded {recovered_s:.0f} s later "
          f"(attempt {job['attempt']}); {restarted}")
