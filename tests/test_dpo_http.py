"""A DPO job over HTTP (OpenAI's method object, its preference rows), with both integrations running: the
job trains (its loss falls, its preference accuracy rises), reports its rewards in its events, and what W&B
(offline, the run folder an artefact) and MLflow (its store in the job's folder) hold is the job's events'
metrics, step for step. One short job on the session's stack (tests/conftest.py shared_stack)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from tests.factories import create_job, upload

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header (":W&B", magic 0xBEE1,
    version 0), then LevelDB-log blocks of 32 KiB whose chunks are CRC32, length, type (1 full, 2 first,
    3 middle, 4 last) and the bytes of one wandb_internal_pb2.Record (wandb-core writes it so; its Python
    reader is gone in wandb 0.31)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """step → the metrics logged at it, and the run's summary, read back from an offline run folder."""
    [run_file] = run_dir.glob("run-*.wandb")
    history, summary = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(int(items.pop("_step", record.history.step.num)), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update})
    return history, summary


@pytest.mark.timeout(900)
def test_a_dpo_job_over_http_learns_and_its_wandb_and_mlflow_runs_hold_its_metrics(shared_stack):
    stack = shared_stack
    train = upload(stack.http, stack.key, rows("preference.jsonl"), name="preference.jsonl")
    valid = upload(stack.http, stack.key, rows("preference-validation.jsonl"), name="preference-validation.jsonl")
    job = create_job(stack.http, stack.key, train, {
        "hyperparameters": {"max_steps": 6, "micro_batch_size": 4, "max_seq_length": 64, "learning_rate": 0.003},
        "peft": {"method": "lora", "r": 8}, "resources": {"num_workers": 1}, "checkpoint_every_steps": 6,
        "eval_every_steps": 3},
        validation_file=valid, suffix="dpo", method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
        integrations=[{"type": "wandb", "wandb": {"project": "memfit-ci", "tags": ["dpo"]}},
                      {"type": "mlflow", "mlflow": {"experiment": "memfit-ci"}}])
    assert job["method"] == {"type": "dpo", "dpo": {"hyperparameters": {
        "n_epochs": job["hyperparameters"]["n_epochs"], "batch_size": 4, "learning_rate_multiplier": 1.0, "beta": 0.1}}}
    done = stack.wait(job["id"], ("succeeded",), timeout=600)
    assert done["fine_tuned_model"] == f"ft:preset:tiny-llama:dpo:{job['id']}"

    events = stack.events(job["id"])
    steps = {e["data"]["step"]: e["data"] for e in events if e["type"] == "metrics" and e["data"]["rank"] == 0}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert steps[1]["train_loss"] == pytest.approx(math.log(2), abs=1e-4) and steps[1]["preference_accuracy"] == 0
    assert steps[6]["train_loss"] < steps[1]["train_loss"] - 0.1 and steps[6]["preference_accuracy"] >= 0.75
    assert steps[6]["reward_margin"] > 0 and steps[6]["valid_preference_accuracy"] >= 0.75
    assert [s for s in steps if "valid_loss" in steps[s]] == [3, 6]
    started = [e["message"] for e in events if (e.get("data") or {}).get("integration")]
    assert any(m.startswith("W&B run") and "offline" in m for m in started), started
    assert any(m.startswith("MLflow run") for m in started), started

    # What each integration holds is the events' metrics, step for step.
    folder = Path(stack.settings.storage_dir) / "jobs" / job["id"] / "attempts" / "1"
    [run_dir] = [p for p in (folder / "wandb").glob("offline-run-*") if not p.is_symlink()]
    history, summary = wandb_history(run_dir)
    metric_keys = ("train_loss", "reward_margin", "preference_accuracy", "learning_rate", "valid_loss")
    for step, data in steps.items():
        for key in metric_keys:
            if key in data:
                assert history[step][key] == pytest.approx(data[key], rel=1e-6), (step, key)
    assert summary["fine_tuned_model"] == done["fine_tuned_model"]
    listed = stack.http.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts", headers=stack.auth).json()["data"]
    assert any(f["path"].startswith("wandb/offline-run-") and f["path"].endswith(".wandb") for f in listed)

    from mlflow.tracking import MlflowClient

    from workers.integrations import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(folder))
    experiment = client.get_experiment_by_name("memfit-ci")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["memfit.job_id"] == job["id"]
    assert run.data.params["method.type"] == "dpo" and run.data.params["training.peft.method"] == "lora"
    for key in metric_keys:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx({s: d[key] for s, d in steps.items() if key in d}, rel=1e-6), key
