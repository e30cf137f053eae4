"""A job over HTTP with MEMFIT_STORAGE_URL on a real S3-compatible server (moto's, tests/s3server.py;
issue 33, item 6): its training file is uploaded into the bucket, Ray Train writes its checkpoints
there (RunConfig's storage_filesystem), it is paused (interrupted) after a checkpoint, and its second
attempt resumes from the checkpoint staged in the bucket — nothing of it on the volume — and its
exported adapter and result files download through the API from the bucket."""

from __future__ import annotations

import json

import pytest

from service.scheduler.loop import Scheduler, start_in_thread
from service.store.models import File, Job
from tests.s3server import BUCKET, CREDENTIALS
from tests.stack import Stack

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

PREFIX = "job-e2e"


@pytest.fixture
def stack(new_database, ray_head, s3_server, tmp_path):
    with new_database() as url:
        stack = Stack(url, tmp_path / "volume", ray_head, **s3_server.settings(PREFIX))
        # The keys reach the Ray job as a deployment gives them to every Ray container (docs/deploy.md).
        stack.scheduler = Scheduler(stack.app.state.sessions, stack.settings, stack.ray, extra_env=dict(CREDENTIALS))
        stack._thread, stack._stop = start_in_thread(stack.scheduler)
        yield stack
        stack.close()


def test_a_job_uploads_checkpoints_resumes_and_exports_in_object_storage(stack, s3_server):
    volume = stack.settings.storage_dir
    with stack.app.state.sessions() as s:
        train_path = s.get(File, stack.train_file).path
    assert train_path.startswith(f"s3://{BUCKET}/{PREFIX}/files/")
    assert not list((volume / "files").rglob("*.jsonl"))

    job_id = stack.create(strategy="ddp", peft={"method": "lora", "r": 8},
                          hyperparameters={"max_steps": 16}, checkpoint_every_steps=2)
    first = f"{PREFIX}/jobs/{job_id}/attempts/1"
    stack.wait_until(lambda: stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=stack.auth)
                     .json()["data"], what="a first checkpoint", job_id=job_id)
    r = stack.http.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=stack.auth)
    assert r.status_code == 200, r.text
    stack.wait(job_id, ("paused",))
    ckpts = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=stack.auth).json()["data"]
    paused_at = ckpts[0]["step_number"]
    assert paused_at < 16
    assert ckpts[0]["path"].startswith(f"s3://{BUCKET}/{first}/ray/")  # shown where it is
    keys = s3_server.keys(first)
    assert any(k.startswith(f"{first}/ray/") and k.endswith("/meta.json") for k in keys), keys
    assert not (volume / "jobs" / job_id / "attempts" / "1" / "ray").exists()  # nothing of Ray Train's on the volume

    r = stack.http.post(f"/v1/fine_tuning/jobs/{job_id}/resume", headers=stack.auth)
    assert r.status_code == 200, r.text
    job = stack.wait(job_id, ("succeeded",))
    with stack.app.state.sessions() as s:
        assert s.get(Job, job_id).attempt == 2
    second = f"{PREFIX}/jobs/{job_id}/attempts/2"
    resumed = [e for e in stack.events(job_id) if "resumes from the checkpoint" in e["message"]]
    assert resumed and resumed[0]["data"]["checkpoint"].startswith(f"s3://{BUCKET}/{first}/ray/"), resumed
    assert f"{second}/resume/meta.json" in s3_server.keys(second)  # staged in the bucket, server-side
    assert not (volume / "jobs" / job_id / "attempts" / "2" / "resume").exists()
    spool = volume / "jobs" / job_id / "metrics-attempt-2.jsonl"
    steps = [r["step"] for r in map(json.loads, spool.read_text().splitlines())
             if r.get("kind") == "metrics" and r.get("rank") == 0]
    assert steps[0] == resumed[0]["data"]["step"] + 1 and steps[-1] == 16, (paused_at, steps)  # resumed, not restarted

    # The exported adapter: in the bucket, listed and downloaded through the API, not on the volume.
    listed = {f["path"]: f["bytes"] for f in stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts",
                                                             headers=stack.auth).json()["data"]}
    assert "adapter/adapter_config.json" in listed and any(p.startswith("adapter/adapter_model") for p in listed), listed
    r = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/adapter/adapter_config.json", headers=stack.auth)
    assert r.status_code == 200 and json.loads(r.content)["r"] == 8
    assert len(r.content) == listed["adapter/adapter_config.json"]
    assert not (volume / "jobs" / job_id / "attempts" / "2" / "adapter").exists()
    assert not [k for k in s3_server.keys(second) if ".part" in k]
    results = stack.results(job)  # results.json, itself a file in the bucket
    assert results["artifacts"]["adapter"] == f"s3://{BUCKET}/{second}/adapter"
    assert f"{PREFIX}/jobs/{job_id}/results.json" in s3_server.keys(f"{PREFIX}/jobs/{job_id}")
