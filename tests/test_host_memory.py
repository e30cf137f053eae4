"""Host memory, planned (service/memory/host.py) and checked at admission against the nodes' memory
(service/memory/nodes.py): the host column's terms, the instants of one rank and of the fullest node,
Ray's dashboard read without ray, and a ZeRO-3-offload job refused over HTTP with the host shortfall named."""

from __future__ import annotations

import time

import pytest

from service.domain.spec import JobSpec
from service.memory import host, nodes, planner
from service.memory.shape import shape_for_model
from service.domain.model_ref import resolve_model

GiB = 2**30
LLAMA_7B = "meta-llama/Llama-2-7b-hf"
A100_80 = {"gpus_per_worker": 1, "gpu_type": "a100-80gb"}


def _spec(model: str = LLAMA_7B, **training) -> JobSpec:
    return JobSpec.model_validate({"model": model, "training_file": "file-1", "training": training})


def _shape(model: str = LLAMA_7B):
    return shape_for_model(resolve_model(model, []))


def _plan(spec: JobSpec, **kw):
    return planner.plan(spec, _shape(spec.model), **kw)


def test_pinned_buffers_are_rounded_up_to_powers_of_two():
    assert [host.pow2(n) for n in (1, 2, 3, 1000, 2**30, 2**30 + 1)] == [1, 2, 4, 1024, 2**30, 2**31]
    assert host.pinned_rounding([3 * 2**30, 2**30, 0]) == 2**30  # 3 GiB pins 4 GiB; 1 GiB is exact


def test_zero3_offload_host_column_is_deepspeeds_cpu_buffers_and_their_pinned_rounding():
    spec = _spec(strategy="deepspeed", precision="bf16", resources={"num_workers": 8, **A100_80},
                 deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
    p = _plan(spec)
    P = p.parameter_count
    Pp = -(-P // 8)
    h = p.per_rank.host
    assert h.parameters == 2 * P // 8  # bf16 partitions (stage3.py: param_groups_fp16_flat_cpu_memory)
    assert h.optimizer_states == 12 * P // 8  # fp32 master + two fp32 moments (DeepSpeedCPUAdam)
    assert h.gradients == 2 * P // 8 + 4 * Pp  # grad_partitions_flat_buffer (bf16) + the master's fp32 grad
    assert h.temporary == 0  # DeepSpeedCPUAdam steps in place
    # pinned: the bf16 grad flat buffer, the fp32 grad of each 1e9-element sub-group, the bf16 params
    subgroups = [min(10**9, Pp - i) for i in range(0, Pp, 10**9)]
    assert h.overhead == host.pinned_rounding([2 * Pp, *(4 * g for g in subgroups), 2 * Pp]) > 0
    # on CPU workers nothing is pinned (workers/strategies/deepspeed.py pin_memory = not on_cpu)
    cpu = _plan(_spec("preset:small-llama", strategy="deepspeed", resources={"num_workers": 2},
                      deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}))
    assert cpu.per_rank.host.overhead == 0


def test_zero2_offload_stages_gradients_on_the_host_and_more_when_accumulating():
    base = dict(strategy="deepspeed", precision="bf16", resources={"num_workers": 4, **A100_80},
                deepspeed={"zero_stage": 2, "offload_optimizer": "cpu"})
    one = _plan(_spec(**base)).per_rank.host
    four = _plan(_spec(**base, hyperparameters={"gradient_accumulation_steps": 4})).per_rank.host
    shape = _shape()
    numels = shape.parameter_numels()
    held = host._partition_numels(numels, 4)  # whole tensors of the fullest rank's partition
    assert one.gradients == 2 * shape.parameter_count() // 4 + 4 * -(-sum(numels) // 4) + 2 * max(numels)
    assert four.gradients - one.gradients == 2 * sum(held)  # accumulated_grads_in_cpu, one per tensor
    assert four.overhead > one.overhead  # each of those is pinned, and rounded


def test_fsdp2_cpu_offload_pins_every_shard_one_by_one():
    spec = _spec(strategy="fsdp", precision="bf16", fsdp={"cpu_offload": True}, resources={"num_workers": 2, **A100_80})
    numels = _shape().parameter_numels()
    expected = host.pinned_rounding([-(-n // 2) * 4 for n in numels] * 2)  # fp32 shards and their grads
    assert _plan(spec).per_rank.host.overhead == expected
    # a 4096 × 11008 MLP weight's shard is 86 MiB: it pins 128 MiB
    assert host.pow2(4096 * 11008 // 2 * 4) == 128 * 2**20


def test_one_ranks_instants_and_the_fullest_node():
    spec = _spec(strategy="deepspeed", precision="bf16", resources={"num_workers": 8, **A100_80},
                 deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
    p = _plan(spec)
    hm = p.host_memory
    P, R = p.parameter_count, planner.CPU_RUNTIME_BYTES
    # each rank reads only its bf16 partitions, here offloaded to the host, through one staging buffer: not the
    # whole model in fp32 (4 P) that every rank once built before DeepSpeed partitioned it
    largest = max(_shape().parameter_numels())
    assert hm.per_rank_bytes["load"] == R + 2 * P // 8 + min(host.LOAD_CHUNK_BYTES, 2 * largest)
    assert hm.per_rank_bytes["load"] < R + P // 2
    assert hm.per_rank_bytes["step"] == R + p.per_rank.host.total
    # the export streams one parameter at a time, gathered in bf16 and cast to the checkpoint's dtype (planned at
    # fp32): not the whole state .float().cpu() and a rebuilt fp32 model (8 P) it once held
    assert hm.rank0_export_extra_bytes == (2 + 4) * largest
    assert not hm.checked and hm.fits is None and "not checked" in hm.notes[-1]
    assert p.fits  # the GPU fits; the host is not known
    # A node of 8 GPUs and 128 GiB: it holds 8 ranks; its need peaks when all of them checkpoint (each stages
    # its largest flat fp32 partition beside the offloaded states), not when they load the model.
    small = nodes.ClusterNodes([nodes.NodeInfo("n1", 128 * GiB, 96, 8)], "settings")
    p = _plan(spec, nodes=small)
    hm = p.host_memory
    assert hm.checked and hm.ranks_on_node == 8 and hm.node_peak_instant == "checkpoint"
    assert hm.node_need_bytes == 8 * hm.per_rank_bytes["checkpoint"] > 8 * hm.per_rank_bytes["load"]
    assert hm.node_instants_bytes["export"] == 7 * hm.per_rank_bytes["step"] + hm.per_rank_bytes["export"]
    assert hm.node_usable_bytes == int(128 * GiB * 0.9) and hm.node_margin_bytes < 0
    assert hm.fits is False and p.fits is False
    big = _plan(spec, nodes=nodes.ClusterNodes([nodes.NodeInfo("n1", 192 * GiB, 96, 8)], "settings"))
    assert big.host_memory.fits is True and big.fits is True
    # placement: GPUs bound the ranks per node, and so do CPUs
    assert host.ranks_per_node(spec, nodes.NodeInfo("n", 1, 96, 4)) == 4
    assert host.ranks_per_node(spec, nodes.NodeInfo("n", 1, 3, 8)) == 3
    assert host.ranks_per_node(spec, nodes.NodeInfo("head", 1, 0, 0)) == 0


def test_a_cpu_job_per_node_is_its_ranks_whole_need():
    spec = _spec("preset:small-llama", resources={"num_workers": 2, "cpus_per_worker": 1})
    p = _plan(spec, nodes=nodes.ClusterNodes([nodes.NodeInfo("n", 16 * GiB, 2, 0)], "settings"))
    hm = p.host_memory
    assert hm.per_rank_bytes["step"] == p.need_bytes  # device and host are the same RAM, process included
    assert hm.ranks_on_node == 2 and hm.node_instants_bytes["step"] == 2 * p.need_bytes and hm.fits


def test_nodes_come_from_the_settings_or_say_why_not(tmp_path):
    from service.settings import ClusterNode, Settings

    base = dict(database_url=f"sqlite:///{tmp_path}/m.db", storage_dir=tmp_path / "s")
    given = nodes.cluster_nodes(Settings(**base, cluster_nodes=[ClusterNode(memory_bytes=GiB, cpus=4, gpus=1, count=3)]))
    assert given.source == "settings" and given.nodes == [nodes.NodeInfo("settings-0", GiB, 4, 1)]
    none = nodes.cluster_nodes(Settings(**base))
    assert none.nodes == [] and "no Ray dashboard address" in none.error
    # a head that does not answer: said so, fast, and remembered for FAILED_TTL_S
    from service.scheduler.local_head import free_port

    dead = Settings(**base, ray_address=f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    first = nodes.cluster_nodes(dead)
    assert first.nodes == [] and "did not answer" in first.error and time.monotonic() - started < 5
    assert nodes.cluster_nodes(dead) is first
    # the embedded head publishes its address for the API beside it
    nodes.publish_dashboard(Settings(**base), "http://127.0.0.1:1")
    assert nodes.dashboard_address(Settings(**base)) == "http://127.0.0.1:1"
    nodes.publish_dashboard(Settings(**base), None)
    assert nodes.dashboard_address(Settings(**base)) is None


@pytest.mark.ray
def test_rays_dashboard_gives_each_nodes_memory_cpus_and_gpus(ray_head):
    found = nodes.read_ray_nodes(ray_head.dashboard_url)
    assert found.source == "ray" and found.error is None
    [node] = found.nodes
    assert node.cpus == 8 and node.gpus == 0  # the session head: LocalRayHead(num_cpus=8)
    import psutil

    # memory + object store: what Ray found available at start, never more than the machine has
    assert 0 < node.memory_bytes <= psutil.virtual_memory().total


# --- admission over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_node_api(new_database, tmp_path_factory):
    from service.settings import ClusterNode
    from tests.scheduler_support import app_without_ray

    node = ClusterNode(memory_bytes=128 * GiB, cpus=96, gpus=8)
    with app_without_ray(new_database, tmp_path_factory.mktemp("host-admission"), cluster_nodes=[node]) as stack:
        yield stack


def test_a_zero3_offload_job_short_of_host_memory_is_a_422_naming_the_host_shortfall(small_node_api):
    from tests.factories import new_key, post_job, upload

    app, client, _ = small_node_api
    key = new_key(app.state.sessions)
    training = {"strategy": "deepspeed", "precision": "bf16", "resources": {"num_workers": 8, **A100_80},
                "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}
    r = post_job(client, key, model=LLAMA_7B, training_file=upload(client, key), training=training)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "insufficient_memory" and body["param"] == "training"
    hm = body["plan"]["host_memory"]
    assert hm["checked"] and hm["fits"] is False and hm["source"] == "settings" and hm["ranks_on_node"] == 8
    short = -hm["node_margin_bytes"]
    assert body["detail"].startswith(f"predicted host memory {hm['node_need_bytes'] / GiB:.2f} GiB on the fullest "
                                     "node (8 rank(s), at checkpoint) does not fit its 128.00 GiB")
    assert f"short by {short / GiB:.2f} GiB" in body["detail"]
    assert body["plan"]["margin_bytes"] >= 0  # the GPUs fit: it is the host
    assert body["error"]["code"] == "insufficient_memory" and body["breakdown"] == body["plan"]["per_rank"]
    assert all(s["fits"] for s in body["suggestions"])
    # the same body planned on its own: the host memory per node is in the plan
    plan = client.post("/v1/memory/plan", json={"model": LLAMA_7B, "training": training},
                       headers={"Authorization": f"Bearer {key}"}).json()
    assert plan["host_memory"] == hm and plan["fits"] is False
    # The offloaded states are per node what they are per job (≈ 20 bytes per parameter: 2 + 2 + 4 + 12,
    # each rank holding its 1/N): four workers hold the same at the step, and are refused too …
    def planned(training):
        return client.post("/v1/memory/plan", json={"model": LLAMA_7B, "training": training},
                           headers={"Authorization": f"Bearer {key}"}).json()

    four = planned({**training, "resources": {"num_workers": 4, **A100_80}})["host_memory"]
    assert four["ranks_on_node"] == 4 and four["fits"] is False
    step_8, step_4 = hm["node_instants_bytes"]["step"], four["node_instants_bytes"]["step"]
    assert abs(step_4 - step_8) / step_8 < 0.05
    # … while four workers without offload fit the node (and each GPU)
    fewer = planned({**training, "resources": {"num_workers": 4, **A100_80},
                     "deepspeed": {"zero_stage": 3}})
    assert fewer["host_memory"]["fits"] is True and fewer["fits"] is True
