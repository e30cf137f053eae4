"""A model that cannot be loaded fails the job at once with ``model_unavailable`` (param ``model``):
the Ray job's driver checks it before any worker starts (workers/models.py: check_model), so Ray
Train's retries, which are for faults, never see bad input; a worker that still cannot load it (a
corrupt weight file) ends the job with the same code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from service.domain.spec import JobSpec, RunRequest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
UNCACHED = "memfit-tests/never-downloaded-model"  # a valid hub id that no cache holds


@pytest.fixture(scope="module")
def tiny_llama() -> Path:
    from workers.models import build_preset

    return build_preset("preset:tiny-llama")


def _variant(tiny_llama: Path, dest: Path, drop: tuple[str, ...] = (), write: dict[str, str | bytes] | None = None) -> str:
    shutil.copytree(tiny_llama, dest)
    for name in drop:
        (dest / name).unlink()
    for name, content in (write or {}).items():
        (dest / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(dest)


# --- the driver's check, case by case ------------------------------------------------------------


def test_a_complete_directory_and_a_preset_pass(tiny_llama, tmp_path):
    from workers.models import check_model

    copy = _variant(tiny_llama, tmp_path / "m")
    assert check_model(copy, copy) == copy
    assert check_model("preset:tiny-llama") == str(tiny_llama)


@pytest.mark.parametrize(("drop", "write", "why"), [
    (("config.json",), {}, "has no config.json"),
    ((), {"config.json": '{"model_type": "no-such-architecture"}'}, "config.json cannot be read"),
    (("tokenizer.json", "tokenizer_config.json"), {}, "no tokenizer loads from"),
    (("model.safetensors",), {}, "has no weights"),
    (("model.safetensors",), {"model.safetensors.index.json": '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}'},
     "lacks 1 of the 1 weight shards model.safetensors.index.json names, e.g. model-00001-of-00002.safetensors"),
], ids=["no-config", "unknown-architecture", "no-tokenizer", "no-weights", "missing-shard"])
def test_a_directory_that_cannot_be_loaded_is_refused_naming_why(tiny_llama, tmp_path, drop, write, why):
    from workers.models import ModelSourceError, check_model

    bad = _variant(tiny_llama, tmp_path / "m", drop, write)
    with pytest.raises(ModelSourceError) as caught:
        check_model(bad, bad)
    assert bad in str(caught.value) and why in str(caught.value)


def _check_in_subprocess(model: str, **env: str) -> dict:
    """check_model in a fresh process: huggingface_hub reads HF_* once, at import."""
    code = ("import json, sys\nfrom workers.models import ModelSourceError, check_model\n"
            "try:\n    print(json.dumps({'ok': check_model(sys.argv[1])}))\n"
            "except ModelSourceError as exc:\n    print(json.dumps({'error': str(exc)}))\n")
    proc = subprocess.run([sys.executable, "-c", code, model], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hf_cache_with(model_dir: Path, repo: str, cache: Path) -> None:
    """``repo`` in a Hugging Face cache laid out as huggingface_hub writes it (refs/main → snapshot)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(model_dir, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_offline_a_hub_id_is_used_from_the_local_cache_or_refused(tiny_llama, tmp_path):
    cache = tmp_path / "hub"
    _hf_cache_with(tiny_llama, "memfit-tests/cached", cache)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    ok = _check_in_subprocess("memfit-tests/cached", **env)
    assert Path(ok["ok"]).parent.parent == cache / "models--memfit-tests--cached"
    refused = _check_in_subprocess(UNCACHED, **env)["error"]
    assert UNCACHED in refused and "HF_HUB_OFFLINE" in refused and "not in the local cache" in refused


class _FakeHub(BaseHTTPRequestHandler):
    """Answers the one HEAD request check_model makes the way huggingface.co does, by repo name."""

    def do_HEAD(self):  # noqa: N802 - http.server's name
        repo = self.path.split("/resolve/")[0].strip("/")
        code, error = {"acme/public": (200, None), "acme/gated": (403, "GatedRepo"),
                       "acme/weights-only": (404, "EntryNotFound")}.get(repo, (404, "RepoNotFound"))
        self.send_response(code)
        if error:
            self.send_header("X-Error-Code", error)
        else:
            self.send_header("ETag", '"abc"')
            self.send_header("X-Repo-Commit", "0" * 40)
            self.send_header("Content-Length", "2")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_online_one_head_request_tells_a_missing_or_gated_model(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": ""}
        assert _check_in_subprocess("acme/public", **env) == {"ok": "acme/public"}
        assert "is gated" in _check_in_subprocess("acme/gated", **env)["error"]
        assert "has no config.json" in _check_in_subprocess("acme/weights-only", **env)["error"]
        assert "'acme/nothing' is not on the Hugging Face Hub" in _check_in_subprocess("acme/nothing", **env)["error"]
    finally:
        server.shutdown()
    closed = {**env, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}  # nothing listens there now
    error = _check_in_subprocess("acme/public", **closed)["error"]
    assert "the Hugging Face Hub did not answer" in error and "HF_HUB_OFFLINE=1" in error


# --- on Ray: a job over the API, and a worker that still cannot load the model ----------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_with_an_uncached_hub_id_fails_model_unavailable_without_starting_a_worker(ray_head, tmp_path):
    """The whole path: API → scheduler → Ray job → the driver's check → failure record → job failed.
    Today the same job started Ray Train's worker group again and again (`[FailurePolicy] RETRY`)."""
    from api.app import create_app
    from service.scheduler.local_head import free_port
    from service.scheduler.loop import Scheduler, start_in_thread
    from service.scheduler.paths import submission_id
    from service.scheduler.ray_jobs import RayJobs
    from service.store import db
    from tests.factories import create_job, new_key, settings_for, upload
    from tests.scheduler_support import LiveServer

    url = f"sqlite:///{tmp_path / 'memfit.db'}"
    db.upgrade(url)
    port = free_port()
    settings = settings_for(url, tmp_path / "storage", api_url=f"http://127.0.0.1:{port}", poll_seconds=0.3)
    app = create_app(settings)
    server = LiveServer(app, port=port).start()
    http = server.client()
    key = new_key(app.state.sessions)
    auth = {"Authorization": f"Bearer {key}"}
    file_id = upload(http, key)
    ray = RayJobs(ray_head.dashboard_url)
    # An empty Hugging Face cache for the Ray job: the hub id is certainly not in it.
    scheduler = Scheduler(app.state.sessions, settings, ray, restart_check_s=0.5,
                          extra_env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
                                     "HF_HUB_OFFLINE": "1"})
    thread, stop = start_in_thread(scheduler)
    try:
        job = create_job(http, key, file_id, {"resources": {"num_workers": 2}, "max_failures": 3,
                                              "hyperparameters": {"max_steps": 2}}, model=UNCACHED)
        deadline = time.monotonic() + 600
        while (job := http.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json())["status"] not in (
                "succeeded", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
        events = http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}, headers=auth).json()["data"]
        log = "\n".join(ray.log_tail(submission_id(job["id"], 1), 100_000))
    finally:
        stop.set()
        thread.join(30)
        server.stop()
    assert job["status"] == "failed", job
    error = job["error"]
    assert (error["code"], error["param"]) == ("model_unavailable", "model"), error
    assert UNCACHED in error["message"] and "not in the local cache" in error["message"]
    # Refused by the driver: Ray Train never started a worker group, so it never retried one.
    assert "[FailurePolicy]" not in log and "training worker group" not in log, log[-3000:]
    assert not [e for e in events if "restarted the worker group" in e["message"]]


def _request(tmp_path: Path, model_dir: str, max_failures: int) -> RunRequest:
    spec = JobSpec.model_validate({"model": "preset:tiny-llama", "training_file": "file-1", "training": {
        "resources": {"num_workers": 1}, "max_failures": max_failures,
        "hyperparameters": {"max_steps": 2, "micro_batch_size": 2}}})
    out = tmp_path / "out"
    return RunRequest(job_id="ftjob-corrupt-weights", spec=spec, training_path=str(DATA / "completion.jsonl"),
                      model_path=model_dir, output_dir=str(out), metrics_path=str(out / "metrics.jsonl"))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_that_cannot_load_the_weights_fails_the_job_model_unavailable(ray_session, tiny_llama, tmp_path):
    """A corrupt weight file passes the driver's check (the file is there) and fails in the workers."""
    from workers.run import RunFailed, fit

    corrupt = _variant(tiny_llama, tmp_path / "corrupt", write={"model.safetensors": b"\x00" * 64})
    req = _request(tmp_path, corrupt, max_failures=0)
    with pytest.raises(RunFailed) as caught:
        fit(req)
    error = caught.value.error
    assert (error["code"], error.get("param"), error.get("phase")) == ("model_unavailable", "model", "load_model"), error
    assert corrupt in error["message"]
    records = [json.loads(line) for line in Path(req.metrics_path).read_text().splitlines()]
    failures = [r for r in records if r["kind"] == "failure"]
    assert failures and {(f["code"], f["param"]) for f in failures} == {("model_unavailable", "model")}
