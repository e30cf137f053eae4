"""ZeRO-Infinity's offload to a local disk (DeepSpeed offload ``device: nvme``, service/memory/nvme.py): the spec's
rules, the plan (states on the disk, swap buffers on the host, disk bytes per rank and node), admission over HTTP
(refused, naming the field and why, when the disk is too small or DeepSpeed's async_io op cannot build here), and a
ZeRO-3 job on two gloo ranks that swaps its parameters and optimizer states to files and removes them at the end."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import pytest

from service.domain.model_ref import resolve_model
from service.domain.spec import JobSpec, check_rules
from service.memory import nvme, planner
from service.memory.shape import shape_for_model

GiB = 2**30
A100_80 = {"gpus_per_worker": 1, "gpu_type": "a100-80gb"}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"


def _spec(model="meta-llama/Llama-2-7b-hf", **training) -> JobSpec:
    return JobSpec.model_validate({"model": model, "training_file": "file-1", "training": training})


def _problems(**training) -> dict[str, str]:
    return {p.param: p.message for p in check_rules(_spec(**training))}


def test_the_spec_asks_for_stage_3_and_an_absolute_path():
    ok = dict(strategy="deepspeed", deepspeed={"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                               "nvme_path": "/local/nvme"})
    assert _problems(**ok) == {}
    assert "needs nvme_path" in _problems(strategy="deepspeed", deepspeed={"zero_stage": 3, "offload_param": "nvme"})[
        "training.deepspeed.nvme_path"]
    assert "zero_stage 3" in _problems(strategy="deepspeed", deepspeed={
        "zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/x"})["training.deepspeed.offload_optimizer"]
    assert "absolute" in _problems(strategy="deepspeed", deepspeed={
        "zero_stage": 3, "offload_param": "nvme", "nvme_path": "relative/dir"})["training.deepspeed.nvme_path"]
    assert "only read" in _problems(strategy="deepspeed", deepspeed={"zero_stage": 3, "nvme_path": "/x"})[
        "training.deepspeed.nvme_path"]


def test_the_plan_puts_the_states_on_the_disk_and_the_swap_buffers_on_the_host(tmp_path):
    from service.domain.training import NVME_OPTIMIZER_BUFFERS, NVME_PARAM_BUFFERS, NVME_SUB_GROUP_ELEMENTS

    spec = _spec(strategy="deepspeed", precision="bf16", resources={"num_workers": 8, **A100_80},
                 deepspeed={"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                            "nvme_path": str(tmp_path)})
    shape = shape_for_model(resolve_model(spec.model, []))
    p = planner.plan(spec, shape)
    P = p.parameter_count
    part = -(-P // 8)
    host = p.per_rank.host
    assert host.optimizer_states == NVME_OPTIMIZER_BUFFERS * 4 * NVME_SUB_GROUP_ELEMENTS
    largest = max(shape.parameter_numels())
    assert host.parameters == NVME_PARAM_BUFFERS * 2 * max(10**8, largest)
    assert p.model_states.device.parameters == 0 and p.model_states.device.optimizer_states == 0
    disk = p.disk
    assert disk.per_rank_bytes == 12 * part + 2 * part and disk.node_bytes == 8 * disk.per_rank_bytes
    assert disk.checked and disk.free_bytes > 0 and disk.fits == (disk.node_bytes <= disk.free_bytes)
    # the same job offloading to host memory holds ~16 bytes a parameter per rank there; to the disk, the buffers
    cpu = planner.plan(_spec(strategy="deepspeed", precision="bf16", resources={"num_workers": 8, **A100_80},
                             deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}), shape)
    assert cpu.per_rank.host.optimizer_states + cpu.per_rank.host.parameters > 4 * (host.optimizer_states + host.parameters)
    assert any("ZeRO-Infinity" in a for a in p.assumptions)


def test_async_io_needs_libaio_and_a_compiler():
    assert nvme.async_io_problem() is None  # this machine's install: libaio-dev and g++ (docs/memory.md)


# --- admission over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(new_database, tmp_path_factory):
    from tests.scheduler_support import app_without_ray

    # no cap on the model's size (MEMFIT_MAX_MODEL_BYTES): a 405B model is admitted up to the disk's check
    with app_without_ray(new_database, tmp_path_factory.mktemp("nvme-admission"), max_model_bytes=0) as stack:
        yield stack


def _post(api, training: dict, model="meta-llama/Llama-2-7b-hf"):
    from tests.factories import new_key, post_job, upload

    app, client, _ = api
    key = new_key(app.state.sessions)
    return post_job(client, key, model=model, training_file=upload(client, key), training=training)


def test_a_disk_too_small_for_the_swap_files_is_a_422_naming_nvme_path(api, tmp_path):
    training = {"strategy": "deepspeed", "precision": "bf16", "resources": {"num_workers": 8, **A100_80},
                "deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                              "nvme_path": str(tmp_path)}}
    free = nvme.free_bytes(str(tmp_path))
    # Llama-3.1-405B's states, 14 bytes a parameter, on this machine's disk: more than it has
    r = _post(api, training, model="meta-llama/Llama-3.1-405B")
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "insufficient_disk" and body["param"] == "training.deepspeed.nvme_path"
    assert f"which has {free / GiB:.2f} GiB free" in body["detail"] or "GiB free" in body["detail"]
    assert str(tmp_path) in body["detail"]


def test_where_async_io_cannot_build_nvme_is_a_422_saying_why(api, tmp_path, monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # as on a node without libaio
    training = {"strategy": "deepspeed", "precision": "bf16", "resources": {"num_workers": 2, **A100_80},
                "deepspeed": {"zero_stage": 3, "offload_param": "nvme", "nvme_path": str(tmp_path)}}
    r = _post(api, training, model="preset:tiny-llama")
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "nvme_unavailable" and body["param"] == "training.deepspeed.offload_param"
    assert "libaio's shared library" in body["detail"] and "async_io" in body["detail"]


# --- a real run -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)  # without the op built at install (Makefile), DeepSpeed compiles it first: minutes
def test_zero3_swaps_to_files_trains_exports_and_removes_them(tmp_path):
    """Two gloo ranks, ZeRO-3 with parameters and optimizer states offloaded to files (DeepSpeed's async_io op,
    built at install or on first use): it trains, the merged export loads, and the job's swap folder is gone at the end."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from workers.args import TrainArgs
    from workers.local import run_local

    swap = tmp_path / "nvme"
    swap.mkdir()
    args = TrainArgs(job_id="ftjob-nvme", output_dir=str(tmp_path / "out"), training_path=str(EXAMPLES / "chat.jsonl"),
                     model="preset:tiny-llama", strategy="deepspeed", ds_stage=3, ds_offload_optimizer="nvme",
                     ds_offload_param="nvme", ds_nvme_path=str(swap), peft_method="lora", learning_rate=1e-2,
                     micro_batch_size=2, max_steps=3, max_seq_length=64, checkpoint_every_steps=3,
                     memory_trace_every_steps=1000)
    ranks = run_local(args, world_size=2)
    losses = [r["loss"] for r in ranks[0]["reports"] if r.get("kind") == "metrics"]
    assert len(losses) == 3 and all(v == v for v in losses)
    assert ranks[0]["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    assert not (swap / "memfit" / "ftjob-nvme").exists()  # the swap files of the job, removed
    assert torch is not None
