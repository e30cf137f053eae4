"""Hostile paths, names and URLs: what a job spec, a file id or an artefact path may name.

One table of hostile ``model`` values, each refused with its code and ``param == "model"`` by the
resolver (service/domain/model_ref.py), by job creation (422 ``invalid_model``) and by
/v1/memory/plan (422 ``unknown_model_shape``); fields that would steer where a worker reads or
fetches (``model_path``, ``env``, ``hf_endpoint`` …) are unknown fields; file ids that look like
paths are unknown files; artefact paths that climb out of the job folder are not found. A hub id is
only ever an id: the workers build its URL on the Hub endpoint of their own environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.domain.model_ref import ModelRefError, resolve_model
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import LiveServer, app_without_ray
from tests.test_api_jobs import assert_problem
from tests.test_artifacts import raw_get

OUTSIDE = "__outside__"  # replaced by a directory outside every model directory (it holds config.json)
MODELS = "__models__"  # replaced by the first model directory

# (model, the resolver's code). Job creation answers each as 422 invalid_model, the planner as 422
# unknown_model_shape; both with param "model".
HOSTILE_MODELS = [
    # traversal and absolute paths outside MEMFIT_MODEL_DIRS
    ("../../etc", "model_not_allowed"),
    ("/etc", "model_not_allowed"),
    (OUTSIDE, "model_not_allowed"),
    (f"{MODELS}/tiny/../../outside", "model_not_allowed"),
    ("tiny/../../../etc", "model_not_allowed"),
    ("org/../../etc", "model_not_allowed"),
    ("~root/.ssh", "model_not_allowed"),
    ("\\\\server\\share\\model", "model_not_allowed"),
    # symlinks planted in a model directory that lead out of it
    ("link-out", "model_not_allowed"),  # a symlinked folder, by name
    (f"{MODELS}/link-out", "model_not_allowed"),  # the same, by path
    ("leaky-config", "model_not_allowed"),  # a real folder whose config.json links out
    ("leaky-weights", "model_not_allowed"),  # … whose weight file links out
    ("loop", "model_not_found"),  # a symlink loop: "cannot be resolved"
    # NUL bytes, control characters, names no filesystem holds
    ("tiny\x00/../../etc", "invalid_model"),
    ("tiny\n", "invalid_model"),
    ("org/name\r", "invalid_model"),
    ("x" * 300 + "/" + "y" * 200, "invalid_model"),
    ("z" * 600, "invalid_model"),  # over 512 characters (the API refuses it as a field first)
    # URLs: never fetched (SSRF)
    ("http://169.254.169.254/latest/meta-data/iam", "invalid_model"),
    ("https://huggingface.co/org/name", "invalid_model"),
    ("file:///etc/passwd", "invalid_model"),
    ("hf://org/name", "invalid_model"),
    ("s3://bucket/model", "invalid_model"),
    ("localhost:8080/model", "invalid_model"),
    ("gopher://127.0.0.1:6379/_", "invalid_model"),
    # hub-id tricks
    ("org/name@main", "invalid_model"),
    ("org/name@169.254.169.254", "invalid_model"),
    ("org/name:latest", "invalid_model"),
    ("org/name?revision=x", "invalid_model"),
    ("org/name#frag", "invalid_model"),
    (" org/name", "invalid_model"),
    ("org/na..me", "invalid_model"),
    ("org--x/name", "invalid_model"),
    ("org/name.", "invalid_model"),
    ("org/..", "invalid_model"),
    ("оrg/name", "invalid_model"),  # a Cyrillic "о"
    ("preset:../../etc", "model_not_found"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[list[Path], Path]:
    """A model directory laid out with the hostile entries above, and a folder outside it."""
    root = tmp_path_factory.mktemp("paths")
    models, outside = root / "models", root / "outside"
    for d in (models / "tiny", outside, models / "leaky-config", models / "leaky-weights"):
        d.mkdir(parents=True)
    (models / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    (outside / "config.json").write_text('{"model_type": "llama", "secret": "outside"}')
    (outside / "model.safetensors").write_bytes(b"not yours")
    os.symlink(outside, models / "link-out")
    os.symlink(outside / "config.json", models / "leaky-config" / "config.json")
    (models / "leaky-weights" / "config.json").write_text('{"model_type": "llama"}')
    os.symlink(outside / "model.safetensors", models / "leaky-weights" / "model.safetensors")
    os.symlink(models / "loop", models / "loop")
    return [models], outside


def _model(raw: str, dirs: list[Path], outside: Path) -> str:
    return raw.replace(OUTSIDE, str(outside)).replace(MODELS, str(dirs[0]))


@pytest.mark.parametrize("raw, code", HOSTILE_MODELS, ids=[repr(m)[:40] for m, _ in HOSTILE_MODELS])
def test_the_resolver_refuses_each_hostile_model(model_dirs, raw, code):
    dirs, outside = model_dirs
    with pytest.raises(ModelRefError) as caught:
        resolve_model(_model(raw, dirs, outside), dirs)
    assert (caught.value.code, caught.value.param, caught.value.status) == (code, "model", 422)
    assert caught.value.message  # says which problem, in words


def test_what_is_allowed_still_resolves(model_dirs):
    dirs, _ = model_dirs
    assert resolve_model("tiny", dirs).path == dirs[0] / "tiny"
    assert resolve_model(str(dirs[0] / "tiny"), dirs).path == dirs[0] / "tiny"
    assert resolve_model("preset:tiny-llama", dirs).kind == "preset"
    assert resolve_model("Qwen/Qwen2.5-0.5B", dirs).hub_id == "Qwen/Qwen2.5-0.5B"
    # A symlink that stays inside the model directories is fine (a Hugging Face cache's snapshots).
    inside = dirs[0] / "alias"
    if not inside.exists():
        os.symlink(dirs[0] / "tiny", inside)
    assert resolve_model("alias", dirs).path == dirs[0] / "tiny"


def test_a_hub_id_is_only_ever_a_path_on_the_configured_hub():
    """An id made of an internal address is a name on the Hub, not a host: the URL the workers ask
    (workers/models.py: hf_hub_url) is on HF_ENDPOINT of their environment, which no spec field sets."""
    from huggingface_hub import constants, hf_hub_url

    ref = resolve_model("169.254.169.254/latest", [])
    assert ref.kind == "hub"
    url = hf_hub_url(ref.hub_id, "config.json")
    assert url.startswith(constants.ENDPOINT + "/169.254.169.254/latest/")


# --- through the HTTP API ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(model_dirs, new_database, tmp_path_factory):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.factories import settings_for

    dirs, _ = model_dirs
    with new_database() as url:
        app = create_app(settings_for(url, tmp_path_factory.mktemp("storage"), model_dirs=dirs))
        with TestClient(app) as client:
            key = new_key(app.state.sessions)
            yield client, key, upload(client, key)
        app.state.engine.dispose()


@pytest.mark.parametrize("raw, code", HOSTILE_MODELS, ids=[repr(m)[:40] for m, _ in HOSTILE_MODELS])
def test_job_creation_and_the_planner_refuse_each_hostile_model(api, model_dirs, raw, code):
    client, key, file_id = api
    model = _model(raw, *model_dirs)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "training_file": file_id}
    created = client.post("/v1/fine_tuning/jobs", json=body, headers=auth)
    planned = client.post("/v1/memory/plan", json=body, headers=auth)
    if len(model) > 512:  # JobSpec.model's max_length: a field error before any resolving
        assert_problem(created, 422, "invalid_value", "model")
        assert_problem(planned, 422, "invalid_value", "model")
        return
    assert_problem(created, 422, "invalid_model", "model")
    assert_problem(planned, 422, "unknown_model_shape", "model")
    for r in (created, planned):  # nothing read from the outside folder leaks into the answer
        assert "secret" not in r.text and "not yours" not in r.text
    assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []


@pytest.mark.parametrize("field, value", [
    ("model_path", "/etc"),
    ("output_dir", "/tmp/elsewhere"),
    ("env", {"HF_ENDPOINT": "http://169.254.169.254", "HF_HUB_OFFLINE": "0"}),
    ("hf_endpoint", "http://169.254.169.254"),
    ("runtime_env", {"env_vars": {"HF_ENDPOINT": "http://127.0.0.1"}}),
    ("revision", "main"),
    ("trust_remote_code", True),
])
def test_fields_that_would_steer_a_worker_are_unknown(api, field, value):
    client, key, file_id = api
    r = client.post("/v1/fine_tuning/jobs", json={"model": "preset:tiny-llama", "training_file": file_id, field: value},
                    headers={"Authorization": f"Bearer {key}"})
    assert_problem(r, 422, "unknown_field", field)
    r = client.post("/v1/fine_tuning/jobs", json={"model": "preset:tiny-llama", "training_file": file_id,
                                                  "training": {field: value}},
                    headers={"Authorization": f"Bearer {key}"})
    assert_problem(r, 422, "unknown_field", f"training.{field}")


@pytest.mark.parametrize("file_id", ["../../etc/passwd", "/etc/passwd", "file-../../x", "file-\x00",
                                     "file://etc/passwd", "..", "%2e%2e%2f%2e%2e"])
def test_a_file_id_that_looks_like_a_path_is_an_unknown_file(api, file_id):
    client, key, _ = api
    auth = {"Authorization": f"Bearer {key}"}
    for param in ("training_file", "validation_file"):
        body = {"model": "preset:tiny-llama", "training_file": api[2], param: file_id}
        assert_problem(client.post("/v1/fine_tuning/jobs", json=body, headers=auth), 404, "file_not_found", param)


@pytest.mark.parametrize("path", ["..%2F..%2Fetc%2Fpasswd", "%2e%2e", "..", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                                  "file-x%00", "%252e%252e%252f"])
def test_file_routes_take_ids_not_paths(api, path):
    client, key, _ = api
    server = LiveServer(client.app).start()
    try:
        for suffix in ("", "/content"):
            assert raw_get(server.url, f"/v1/files/{path}{suffix}", key) == 404, (path, suffix)
    finally:
        server.stop()


# --- artefact paths --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_folder(new_database, tmp_path_factory):
    """A claimed job whose output folder holds an adapter and symlinks planted to lead out of it."""
    from service.scheduler.paths import attempt_dir

    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("SECRET-OUTSIDE")
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as (app, client, sched):
        key = new_key(app.state.sessions)
        job = create_job(client, key, upload(client, key))
        sched.validate_pending()
        sched.claim(limit=100)
        out = attempt_dir(sched.settings, job["id"], 1)  # the claimed attempt's folder: what is served
        (out / "adapter").mkdir(parents=True)
        (out / "adapter" / "adapter_config.json").write_text("{}")
        (out / "results.json").write_text("SECRET-INSIDE")
        os.symlink(outside / "secret.txt", out / "adapter" / "secret.txt")
        os.symlink(outside, out / "adapter" / "linked")
        os.symlink(outside, out / "model")  # a whole served folder that is a symlink
        server = LiveServer(app).start()
        try:
            yield server, key, job["id"]
        finally:
            server.stop()


@pytest.mark.parametrize("path", [
    "adapter/../results.json", "adapter/%2e%2e/results.json", "adapter/%2E%2E/results.json",
    "adapter%2F..%2Fresults.json", "adapter/..%2Fresults.json", "%2e%2e/%2e%2e/requests",
    "adapter/%252e%252e/results.json", "adapter/..%5Cresults.json", "adapter\\..\\results.json",
    "adapter/adapter_config.json%00", "%2Fetc%2Fpasswd", "/etc/passwd",
    "adapter/secret.txt", "adapter/linked/secret.txt", "model/secret.txt",
])
def test_artifact_paths_never_leave_the_job_folder(job_folder, path):
    server, key, job_id = job_folder
    assert raw_get(server.url, f"/v1/fine_tuning/jobs/{job_id}/artifacts/{path}", key) == 404
    assert raw_get(server.url, f"/v1/fine_tuning/jobs/{job_id}/artifacts/adapter/adapter_config.json", key) == 200


URLS = [m for m, _ in HOSTILE_MODELS if "://" in m or m.startswith("localhost:") or "@" in m]


@pytest.mark.parametrize("model", URLS)
def test_the_workers_refuse_a_url_before_any_request(model, monkeypatch):
    """Defence in depth: the Ray job's driver (workers/models.py: check_model) resolves the model with
    the same rule before it would ask the Hub anything, online or not."""
    from workers.models import ModelSourceError, check_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelSourceError) as caught:
        check_model(model)
    assert str(caught.value).startswith(f"model {model!r} is ")
    assert "Hugging Face Hub" not in str(caught.value)  # refused by the resolver, not by a Hub answer


@pytest.mark.parametrize("path", ["ftjob-x%00", "..%2F..%2Fetc%2Fpasswd", "%2e%2e", "%252e%252e%252f"])
def test_job_routes_take_ids_not_paths(api, path):
    """A NUL byte in a job id (Postgres refuses it in text) is an unknown job, not a 500."""
    client, key, _ = api
    server = LiveServer(client.app).start()
    try:
        for suffix in ("", "/events", "/checkpoints", "/artifacts", "/memory"):
            assert raw_get(server.url, f"/v1/fine_tuning/jobs/{path}{suffix}", key) == 404, (path, suffix)
    finally:
        server.stop()
