"""The production topology, tested (issue 37, item 6): the driver placed as production places it, and a
lost node that leaves the cluster too small said at once.

One cluster for the module (the CI budget): a Ray head with no CPUs of its own, its GCS kept in a Redis of
the test's own (GCS fault tolerance: RAY_REDIS_ADDRESS, as deploy/kubernetes/raycluster.yaml's
gcsFaultToleranceOptions set it), and three worker nodes of one CPU each, each its own raylet and its
own session (tests/ray_nodes.py: it outlives a head that restarts, as a worker pod does). memfit's
scheduler submits with the driver's production placement (``entrypoint_num_cpus`` 0.1: the driver
lands on a worker node, since the head has no CPUs).

Real: Ray, Redis, Postgres, the API, the scheduler, the training. Simulated: the nodes share this
machine's loopback (not a network of their own); a machine's loss is every process of its node
SIGKILLed at once.

**The driver's node is lost** — the node that runs the driver (and Ray Jobs' supervisor) is killed:
Ray reports the supervisor dead, memfit resubmits (``ray_run_lost``); the two nodes left (one CPU each)
cannot hold the driver and two one-CPU ranks, and the job says so at once — an event naming what the
run needs and what the cluster has — and then fails ``insufficient_resources`` after a bound derived
from its start-up time, instead of waiting in silence (before, it stayed ``running``: a run that never
reaches a step is never "stalled").

**The head restarts** (GCS fault tolerance) — the head's processes SIGKILLed mid-job and the head started
again at its address: the worker nodes, the driver, Ray Train's controller (pinned to the driver's node)
and the ranks live on, and the job ends on attempt 1 with every step once. Until the driver attached to
its own node's raylet (workers/run.py: supervisor_temp_dir) it attached to the head's — Ray prefers the
head among several raylets of one host — so the controller ran on the head, the restart took it, and
the driver exited 75 into a resubmission. On Kubernetes (one node per pod) the driver's node was always
its own; the test reaches that topology on one host.

Not here: nodes in network namespaces of their own (tests/netns.py builds them) hung pulling the train
function across the bridge here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from sqlalchemy import select

from service.scheduler.local_head import LocalRayHead, free_port
from service.scheduler.paths import submission_id
from service.scheduler.ray_jobs import RayJobs
from service.store.models import Job, JobEvent
from tests.ray_nodes import RayNode, alive_actors, alive_nodes
from tests.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS_THROUGH_RESTART = 120  # 0.3 s apart: about 40 s of training, more than the head takes to come back


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except Exception:  # noqa: BLE001 - the head restarting answers nothing for a while
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("gcs-redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import redis

        _wait(lambda: redis.Redis(port=port).ping(), 20, "redis-server")
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


@pytest.fixture(scope="module")
def cluster(redis_port, tmp_path_factory):
    """(head factory, [the heads, the live one last], [three worker nodes])."""
    pytest.importorskip("ray", reason="the [train] extra is not installed")
    logs = tmp_path_factory.mktemp("topology")
    namespace = f"memfit-{os.getpid()}-{time.monotonic_ns()}"
    gcs = {"RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_port}", "RAY_external_storage_namespace": namespace}
    heads: list[LocalRayHead] = []

    def start_head(like: LocalRayHead | None = None) -> LocalRayHead:
        ports = {"gcs_port": like.gcs_port, "dashboard_port": like.dashboard_port} if like else {}
        head = LocalRayHead(num_cpus=0, extra_env=gcs, log_path=logs / f"head-{len(heads)}.log", **ports).start()
        heads.append(head)
        return head

    nodes: list[RayNode] = []
    try:
        head = start_head()
        import redis

        assert redis.Redis(port=redis_port).dbsize() > 0, "the GCS keeps nothing in Redis: no fault tolerance"
        for i in range(3):  # one at a time (tests/ray_nodes.py)
            for tries_left in (1, 0):  # `ray start` gives a raylet 30 s to register: a loaded machine misses it now and then
                node = RayNode(head, num_cpus=1, outlive_head=True, log_path=logs / f"node{i}.log",
                               extra_env={"RAY_gcs_rpc_server_reconnect_timeout_s": "180"})
                try:
                    nodes.append(node.start())
                    break
                except RuntimeError:
                    node.kill()
                    if not tries_left:
                        raise
        assert len(alive_nodes(head)) == 4
        yield start_head, heads, nodes
    finally:
        for node in nodes:
            node.kill()
        for head in heads:
            head.stop()


@pytest.fixture(scope="module")
def stack(cluster, new_database, tmp_path_factory):
    _, heads, _ = cluster
    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("topology-storage"), heads[0], lease_seconds=6)
        # The production placement: the driver takes 0.1 CPU wherever Ray puts it (the head has none).
        s.ray = RayJobs(heads[0].dashboard_url, entrypoint_num_cpus=0.1)
        sched = s.start_scheduler()
        sched.capacity_check_s, sched.capacity_floor_s, sched.capacity_factor = 1.0, 10.0, 2.0
        yield s
        s.close()


def driver_node(stack: Stack, head: LocalRayHead, nodes: list[RayNode], job_id: str) -> RayNode | None:
    """The node running the job's driver, as Ray's Jobs API and node list tell it."""
    info = stack.ray.client.get_job_info(submission_id(job_id, 1))
    names = {n["node_id"]: n.get("node_name") for n in alive_nodes(head)}
    name = names.get(info.driver_node_id)
    return next((node for node in nodes if node.name == name), None)


def rows(stack: Stack, job_id: str, *columns):
    with stack.app.state.sessions() as s:
        return s.execute(select(*columns).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()


def test_the_head_restarts_mid_job_and_the_run_goes_on_without_a_resubmission(cluster, stack):
    """GCS fault tolerance: the whole head (GCS, raylet, dashboard, Jobs API) SIGKILLed mid-job and started
    again at its address; the worker nodes, the driver, Ray Train's controller and the ranks live on, and
    the job ends on attempt 1 with every step once. First here, the module's other test loses a node."""
    start_head, heads, nodes = cluster
    stack.scheduler.extra_env["MEMFIT_WORKER_STEP_PAUSE_S"] = "0.3"  # the run outlasts the restart
    try:
        job_id = stack.create(hyperparameters={"max_steps": STEPS_THROUGH_RESTART}, checkpoint_every_steps=20)
    finally:
        stack.scheduler.extra_env.pop("MEMFIT_WORKER_STEP_PAUSE_S")
    _wait(lambda: len(stack.metrics_steps(job_id)) >= 4, 300, "the job to train")
    old = heads[-1]
    drivers = _wait(lambda: driver_node(stack, old, nodes, job_id), 60, "the driver's node")
    # Ray Train pins its controller to the driver's node (workers/run.py: supervisor_temp_dir): a worker
    # node here, so the head's loss does not take the controller with it
    names = {n["node_id"]: n.get("node_name") for n in alive_nodes(old)}
    [controller] = [a for a in alive_actors(old) if a.get("class_name") == "TrainController"]
    assert names.get(controller.get("node_id")) == drivers.name, (names, controller)

    killed_at = time.monotonic()
    old.ownership.end(timeout_s=10.0)  # the head pod's processes, all at once; the worker nodes are pods of their own
    old.stop()
    steps_while_down = len(stack.metrics_steps(job_id))
    start_head(like=old)
    back_after = time.monotonic() - killed_at
    job = stack.wait(job_id, ("succeeded",), timeout=600)
    steps = stack.metrics_steps(job_id)
    assert steps_while_down < STEPS_THROUGH_RESTART, "the run had ended before the head was killed"
    assert sorted(steps) == list(range(1, STEPS_THROUGH_RESTART + 1)), steps  # every step once, rank 0
    assert sorted(stack.metrics_steps(job_id, rank=1)) == list(range(1, STEPS_THROUGH_RESTART + 1))
    with stack.app.state.sessions() as s:
        assert s.get(Job, job_id).attempt == 1
    statuses = [d["status"] for (d,) in rows(stack, job_id, JobEvent.data) if d and "status" in d]
    assert "queued" not in statuses[statuses.index("running"):], statuses  # never requeued
    assert set(stack.ray.submissions_of(job_id)) == {submission_id(job_id, 1)}  # the restarted head knows it
    assert job["error"] is None
    print(f"head killed at step {steps_while_down}, back after {back_after:.1f} s; the run went on to "
          f"step {STEPS_THROUGH_RESTART} on attempt 1")


def test_losing_the_drivers_node_resubmits_and_a_cluster_too_small_says_so_then_fails(cluster, stack):
    _, heads, nodes = cluster
    job_id = stack.create(hyperparameters={"max_steps": 400}, checkpoint_every_steps=5)
    _wait(lambda: len(stack.metrics_steps(job_id)) >= 2, 300, "the job to train")
    victim = _wait(lambda: driver_node(stack, heads[-1], nodes, job_id), 60, "the driver's node")
    killed_at = time.monotonic()
    victim.kill()  # the driver, Ray Jobs' supervisor and whatever else ran there: a lost machine
    job = stack.wait(job_id, ("failed",), timeout=400)
    failed_after = time.monotonic() - killed_at
    messages = [m for (m,) in rows(stack, job_id, JobEvent.message)]
    datas = [d for (d,) in rows(stack, job_id, JobEvent.data)]
    lost = [d for d in datas if d and d.get("status") == "queued" and d.get("reason") == "ray_run_lost"]
    assert lost and "JOB_SUPERVISOR_ACTOR_DIED" in lost[0].get("detail", ""), (lost, messages[-12:])
    short = [m for m in messages if m.startswith("Waiting for resources the cluster cannot give")]
    assert short and "needs 2 workers of 1 CPU" in short[0] and "room for 1" in short[0], messages[-12:]
    # the live nodes, in Ray's order: the two one-CPU nodes left and the head, which has none
    listed = re.search(r"live nodes have (.*), room for", short[0]).group(1).split(", ")
    assert sorted(listed) == ["0 CPU", "1 CPU", "1 CPU"], short[0]
    assert job["error"]["code"] == "insufficient_resources", job["error"]
    assert "cannot hold the run" in job["error"]["message"] and "resources.min_workers" in job["error"]["message"]
    assert failed_after < 240, failed_after  # not the 300 s stall floor, not a silent wait
    with stack.app.state.sessions() as s:
        assert s.get(Job, job_id).attempt == 2
    print(f"driver's node {victim.name} killed; resubmitted, told, failed insufficient_resources {failed_after:.0f} s later")

