"""Training through Ray Train on the session's shared Ray cluster (TorchTrainer, gloo, 2 workers): the
JSON-lines sink gets per-rank records, a worker killed on purpose is restarted from the latest checkpoint, a
second driver run with the same RunConfig name resumes instead of starting over, and the CLI entrypoint runs
as the scheduler runs it. Each strategy's own claims (it learns, its artefacts load back, what each rank holds)
are checked on two gloo ranks forked locally (workers/local.py: the very training function a Ray worker runs,
its reports turned into records by the sink's report_to_records, as Ray Train's callback does), without the
fixed cost of a Ray Train run (a driver, a controller and its helper actors, and two rank processes importing
torch: about 20 CPU-seconds a run); every strategy also runs through Ray and over HTTP in tests/test_e2e.py,
tests/test_multinode.py, tests/test_checkpoint_sharded_ray.py and tests/test_load_memory.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from service.domain.spec import JobSpec, RunRequest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def presets():
    """A preset cache the Ray workers share (they inherit the environment of the head, so pass the
    path in the request's model_path instead: the built directory)."""
    from workers.models import build_preset

    return {name: str(build_preset(f"preset:{name}")) for name in ("tiny-llama", "tiny-qwen2")}


def _request(tmp_path, job_id: str, model_dir: str, training: dict, data: str = "completion.jsonl",
             validation: str | None = None) -> RunRequest:
    t = {"resources": {"num_workers": 2}, "checkpoint_every_steps": 100, "telemetry_every_steps": 1,
         "memory_trace_every_steps": 1000, **training}
    t["hyperparameters"] = {"learning_rate": 0.01, "warmup_steps": 2, "micro_batch_size": 8, "max_steps": 10,
                            **training.get("hyperparameters", {})}
    spec = JobSpec.model_validate({"model": "preset:tiny-llama", "training_file": "file-1", "training": t})
    out = tmp_path / job_id
    return RunRequest(job_id=job_id, spec=spec, training_path=str(DATA / data), model_path=model_dir,
                      validation_path=str(DATA / validation) if validation else None, output_dir=str(out),
                      metrics_path=str(out / "metrics.jsonl"))


def _records(req: RunRequest, path: str | None = None) -> list[dict]:
    return [json.loads(line) for line in Path(path or req.metrics_path).read_text().splitlines()]


def _losses(records: list[dict], rank: int = 0) -> list[float]:
    """Loss per step of one rank, in step order; a step reported twice (after a restart) counts once."""
    by_step = {r["step"]: r["loss"] for r in records if r["kind"] == "metrics" and r["rank"] == rank}
    return [by_step[s] for s in sorted(by_step)]


def _train_locally(req: RunRequest) -> list[dict]:
    """Train ``req`` on its number of gloo ranks forked locally; the records Ray Train's callback would have made
    of the ranks' reports (workers/sink.py: report_to_records), in report order."""
    from workers.args import train_args
    from workers.local import run_local
    from workers.sink import report_to_records

    ranks = run_local(train_args(req, fail_at=""), world_size=req.spec.training.resources.num_workers)
    return [record for per_rank in zip(*(r["reports"] for r in ranks), strict=True)
            for record in report_to_records(list(per_rank), None, attempt=1)]


def _assert_learns_and_loads(req: RunRequest, records: list[dict]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    losses = _losses(records)
    assert losses[-1] < 0.5 * losses[0], losses
    # Both ranks report the same global loss (it is all-reduced) at every step.
    assert _losses(records, 1) == pytest.approx(losses, rel=1e-5)
    result = [r for r in records if r["kind"] == "result"]
    assert len(result) == 1 and result[0]["artifacts"] == {"model": "model"}
    model = AutoModelForCausalLM.from_pretrained(Path(req.output_dir) / "model")
    AutoTokenizer.from_pretrained(Path(req.output_dir) / "model")
    assert model.config.model_type in ("llama", "qwen2")


def test_ddp_resumes_after_a_worker_dies_and_a_second_driver_resumes(ray_session, presets, tmp_path):
    from workers.run import fit

    req = _request(tmp_path, "ftjob-ddp-resume", presets["tiny-llama"],
                   {"strategy": "ddp", "checkpoint_every_steps": 3, "max_failures": 1},
                   validation="chat-validation.jsonl")
    fit(req, fail_at="5:1")  # rank 1 exits after optimizer step 5, before reporting it
    records = _records(req)
    ordered = [r for r in records if (r["kind"] == "metrics" and r.get("rank", 0) == 0)
               or (r["kind"] == "event" and "worker group failed" in r["message"])]
    failed_at = next(i for i, r in enumerate(ordered) if r["kind"] == "event")
    before = [r["step"] for r in ordered[:failed_at]]
    after = [r["step"] for r in ordered[failed_at + 1:]]
    # The restarted group says where it picked up (its events go out with its first report).
    resumed = [i for i, r in enumerate(records) if r["kind"] == "event" and r["message"] == "Resumed from the checkpoint of step 3"]
    assert len(resumed) == 1 and resumed[0] > records.index(ordered[failed_at])
    # Steps 1–3 (or 4, if the controller collected that report before it saw the failure) ran
    # first; the restarted group continued from the checkpoint taken after step 3.
    assert before in ([1, 2, 3], [1, 2, 3, 4])
    assert after == [4, 5, 6, 7, 8, 9, 10]
    # The curve matches an uninterrupted run: the same global batch (8 × 2 ranks) on one process
    # with 2 accumulation steps sees the same examples per step and scales the loss the same way.
    from workers.args import train_args
    from workers.local import run_local

    reference = train_args(req, fail_at="")
    reference.accumulation, reference.output_dir, reference.validation_path = 2, str(tmp_path / "ref"), None
    (ref,) = run_local(reference)
    assert _losses(records) == pytest.approx(_losses([{**r, "rank": 0} for r in ref["reports"] if r.get("kind") == "metrics"]), rel=1e-4)
    assert any(r["kind"] == "event" and "worker group failed" in r["message"] for r in records)
    checkpoints = [r for r in records if r["kind"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [3, 6, 9, 10]
    assert all(Path(c["path"]).is_dir() for c in checkpoints[-2:])  # num_to_keep=2
    assert "eval_loss" in checkpoints[-1]["metrics"]
    mem = [r for r in records if r["kind"] == "memory"]
    assert {r["rank"] for r in mem} == {0, 1}
    _assert_learns_and_loads(req, records)

    # A new driver with the same RunConfig(name, storage_path) picks up the latest checkpoint (step
    # 10 of 10): it trains no step and only re-exports the artifacts — what the scheduler relies on
    # to resubmit a job after a Ray head restart. Its load and export phases still report their memory.
    second = req.model_copy(update={"metrics_path": str(tmp_path / "second.jsonl")})
    fit(second)
    again = _records(second)
    assert [r["kind"] for r in again if r["kind"] != "memory"] == ["result"]


def test_lora_ddp_through_the_cli_entrypoint(ray_head, presets, tmp_path):
    """`python -m workers.run REQUEST.json` as the scheduler runs it, on examples/tiny-lora.yaml."""
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    body = yaml.safe_load((ROOT / "examples" / "tiny-lora.yaml").read_text())
    body["training"]["hyperparameters"]["max_steps"] = 6
    body["training"]["checkpoint_every_steps"] = 3
    out = tmp_path / "lora"
    req = RunRequest(job_id="ftjob-lora-cli", spec=JobSpec.model_validate({**body, "training_file": "file-1",
                                                                           "validation_file": "file-2"}),
                     training_path=str(ROOT / "examples" / body["training_file"]),
                     validation_path=str(ROOT / "examples" / body["validation_file"]),
                     model_path=presets["tiny-llama"], output_dir=str(out), metrics_path=str(out / "metrics.jsonl"))
    path = tmp_path / "request.json"
    path.write_text(req.model_dump_json())
    env = {**os.environ, "RAY_ADDRESS": ray_head.address}
    proc = subprocess.run([sys.executable, "-m", "workers.run", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == "succeeded"
    records = _records(req)
    losses = _losses(records)
    # telemetry_every_steps 2, the traced step 3, and step 1 that carries the load phase's memory
    # record: steps 1, 2, 3, 4, 6. A random base learns little through a low-rank adapter, but it does learn.
    steps = sorted({r["step"] for r in records if r["kind"] == "metrics" and r["rank"] == 0})
    assert steps == [1, 2, 3, 4, 6] and losses[-1] < losses[0]
    (result,) = [r for r in records if r["kind"] == "result"]
    assert result["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    assert result["trained_tokens"] > 0
    base = AutoModelForCausalLM.from_pretrained(presets["tiny-llama"])
    adapted = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    # The run started Ray Train's controller and its two workers but neither of the actors memfit leaves out
    # (workers/run.py: TRAIN_ENV, trainer_class): no dataset manager, no preemption watcher, on this head
    # where every memfit run of the session has run.
    from ray.util.state import list_actors

    started = {a.class_name for a in list_actors(address=ray_head.dashboard_url, limit=10_000, raise_on_missing_output=False)}
    assert {"TrainController", "RayTrainWorker"} <= started, started
    assert not started & {"DatasetManager", "PreemptionWatcher"}, started


def test_cli_reports_a_bad_request_as_one_json_line(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"job_id": "x", "spec": {"model": "m"}, "output_dir": "/tmp/x"}))
    proc = subprocess.run([sys.executable, "-m", "workers.run", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    error = json.loads(proc.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "invalid_request"
    assert {"training_path", "spec.training_file"} <= {e["param"] for e in error["errors"]}


def test_fsdp_two_workers_learn_and_each_holds_half_the_parameters(presets, tmp_path):
    from transformers import AutoModelForCausalLM

    req = _request(tmp_path, "ftjob-fsdp", presets["tiny-qwen2"], {"strategy": "fsdp"}, data="text.jsonl")
    records = _train_locally(req)
    _assert_learns_and_loads(req, records)
    full = AutoModelForCausalLM.from_pretrained(presets["tiny-qwen2"])
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    for rank in (0, 1):
        sample = next(r for r in records if r["kind"] == "memory" and r["rank"] == rank and r["phase"] == "step")
        held = (sample.get("parameters_bytes") or 0) + (sample.get("host_parameters_bytes") or 0)
        assert 0.45 * full_bytes <= held <= 0.55 * full_bytes, (rank, held, full_bytes)


def test_fsdp_bf16_checkpointing_and_cpu_offload(presets, tmp_path):
    req = _request(tmp_path, "ftjob-fsdp-off", presets["tiny-llama"],
                   {"strategy": "fsdp", "precision": "bf16", "gradient_checkpointing": True,
                    "fsdp": {"cpu_offload": True, "reshard_after_forward": False}})
    _assert_learns_and_loads(req, _train_locally(req))


def test_lora_bf16_ddp_holds_the_frozen_base_in_bf16(presets, tmp_path):
    from transformers import AutoModelForCausalLM

    req = _request(tmp_path, "ftjob-lora-bf16", presets["tiny-llama"],
                   {"strategy": "ddp", "precision": "bf16", "peft": {"method": "lora", "r": 8},
                    "hyperparameters": {"learning_rate": 0.03}})
    records = _train_locally(req)
    losses = _losses(records)
    assert losses[-1] < losses[0] - 0.2, losses
    assert _losses(records, 1) == pytest.approx(losses, rel=1e-5)
    result = [r for r in records if r["kind"] == "result"]
    assert len(result) == 1 and result[0]["artifacts"]["adapter"] == "adapter"
    fp32_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(presets["tiny-llama"]).parameters())
    for rank in (0, 1):  # telemetry counts a bf16 base (half the fp32 bytes) plus a small fp32 adapter
        sample = next(r for r in records if r["kind"] == "memory" and r["rank"] == rank and r["phase"] == "step")
        assert 0.5 * fp32_bytes < sample["parameters_bytes"] < 0.55 * fp32_bytes, (rank, sample["parameters_bytes"])


@pytest.mark.parametrize(
    "stage, offload_optimizer, offload_param, precision",
    [(2, "none", "none", "fp32"), (2, "cpu", "none", "bf16"), (3, "none", "none", "bf16"), (3, "cpu", "cpu", "fp32")],
    ids=["zero2", "zero2-offload-bf16", "zero3-bf16", "zero3-offload"],
)
def test_deepspeed_two_workers_learn(presets, tmp_path, stage, offload_optimizer, offload_param, precision):
    req = _request(tmp_path, f"ftjob-ds{stage}-{offload_optimizer}", presets["tiny-llama"],
                   {"strategy": "deepspeed", "precision": precision,
                    "deepspeed": {"zero_stage": stage, "offload_optimizer": offload_optimizer,
                                  "offload_param": offload_param}})
    _assert_learns_and_loads(req, _train_locally(req))
