"""The artifacts routes serve a job's model artefacts and nothing else, and the ingest token is never
where a tenant can read it.

`/v1/fine_tuning/jobs/{id}/artifacts[/{path}]` list and serve, by service.jobs.artifacts' allowlist, the
adapter, merged and model folders and each checkpoint's metrics (meta.json); everything else of the
job's output folder — Ray's run state, the record spool, failure and request files — is a 404, as is
any path through ``..`` or a symlink. The run request, which carries the per-attempt ingest token,
lies outside that folder (service.scheduler.paths.request_path)."""

from __future__ import annotations

import http.client
import os
import stat
from pathlib import Path
from urllib.parse import urlparse

import pytest

from service.jobs.artifacts import is_allowed
from service.scheduler.paths import attempt_dir, job_dir, request_path
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import app_without_ray

ARTIFACTS = "/v1/fine_tuning/jobs/{}/artifacts"


def raw_get(base_url: str, path: str, key: str) -> int:
    """GET with the path sent byte for byte (HTTP clients normalise ``..`` away before sending)."""
    u = urlparse(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


# --- the allowlist on a folder laid out like a run's ----------------------------------------------


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


SECRET = "mfi_not-for-tenants"
SERVED = {
    "adapter/adapter_config.json": b"{}",
    "adapter/adapter_model.safetensors": b"weights",
    "merged/config.json": b"{}",
    "merged/sub/tokenizer.json": b"{}",
    "model/model.safetensors": b"weights",
    "ray/run/checkpoint_2026-12-01_10-55-37.830535/meta.json": b'{"step": 3}',
    "checkpoints/step-4/meta.json": b'{"step": 4}',
}
HIDDEN = {
    "request-attempt-1.json": SECRET.encode(),
    "metrics-attempt-1.jsonl": b'{"kind": "metrics"}\n',
    "metrics-attempt-1.jsonl.delivered": b"20",
    "failure-rank0.json": b"{}",
    "results.json": b"{}",
    ".failed-at-3-rank0": b"",
    "ray/run/checkpoint_manager_snapshot.json": SECRET.encode(),
    "ray/run/.validate_storage_marker": b"",
    "ray/run/checkpoint_2026-12-01_10-55-37.830535/state.pt": b"optimizer state",
    "ray/run/checkpoint_2026-12-01_10-55-37.830535/rng-rank0.pt": b"rng",
    "adapter/.hidden": b"",
    "adapter/adapter_model.safetensors.part": b"half",
    "checkpoints/step-4/state.pt": b"optimizer state",
    "modelx/config.json": b"{}",
}
LINKS = {  # symlinks planted in served folders: neither listed nor served
    "adapter/request.json": "../request-attempt-1.json",
    "adapter/passwd": "/etc/passwd",
    "adapter/inside.json": "adapter_config.json",
    "merged/ray": "../ray",
}


def laid_out_job(env, tmp_path) -> tuple[str, str, Path]:
    """(job id, tenant key, output folder) of a claimed job whose folder holds every kind of file."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    sched.claim(limit=100)
    out = attempt_dir(sched.settings, job["id"], 1)  # the claimed attempt's folder: what is served
    for rel, data in {**SERVED, **HIDDEN}.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    for rel, target in LINKS.items():
        os.symlink(target, out / rel)
    return job["id"], key, out


def test_the_listing_holds_only_the_allowlisted_files(env, tmp_path):
    _, client, _ = env
    job_id, key, _ = laid_out_job(env, tmp_path)
    r = client.get(ARTIFACTS.format(job_id), headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert {f["path"]: f["bytes"] for f in r.json()["data"]} == {p: len(d) for p, d in SERVED.items()}
    page = client.get(f"/ui/jobs/{job_id}/view.json", headers={"Authorization": f"Bearer {key}"}).json()
    assert {f["path"] for f in page["files"]} == set(SERVED)  # the job page links the same files


def test_only_allowlisted_files_are_served(env, tmp_path):
    _, client, _ = env
    job_id, key, _ = laid_out_job(env, tmp_path)
    auth = {"Authorization": f"Bearer {key}"}
    for rel, data in SERVED.items():
        r = client.get(f"{ARTIFACTS.format(job_id)}/{rel}", headers=auth)
        assert (r.status_code, r.content) == (200, data), rel
    for rel in [*HIDDEN, *LINKS, "adapter", "ray/run", "merged/ray/run/checkpoint_manager_snapshot.json",
                "missing.bin", "adapter/missing.json"]:
        r = client.get(f"{ARTIFACTS.format(job_id)}/{rel}", headers=auth)
        assert r.status_code == 404, rel
        assert SECRET.encode() not in r.content
    other = new_key(env[0].state.sessions)  # another tenant: the job itself is not found
    r = client.get(f"{ARTIFACTS.format(job_id)}/adapter/adapter_config.json", headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 404


@pytest.mark.parametrize("path", ["adapter/../request-attempt-1.json", "adapter/%2e%2e/request-attempt-1.json",
                                  "adapter/..%2frequest-attempt-1.json", "./adapter/adapter_config.json",
                                  "adapter//adapter_config.json", "%2fetc/passwd", "adapter\\..\\results.json"])
def test_dot_segments_and_odd_paths_are_not_found(env, tmp_path, path):
    from tests.scheduler_support import LiveServer

    app, _, _ = env
    job_id, key, _ = laid_out_job(env, tmp_path)
    server = LiveServer(app).start()
    try:
        assert raw_get(server.url, f"{ARTIFACTS.format(job_id)}/{path}", key) == 404
    finally:
        server.stop()


@pytest.mark.parametrize("path,allowed", [
    ("adapter/adapter_config.json", True), ("merged/a/b/c.bin", True), ("model/config.json", True),
    ("ray/ftjob-x/checkpoint_1/meta.json", True), ("checkpoints/step-2/meta.json", True),
    ("adapter", False), ("ray/ftjob-x/checkpoint_1/state.pt", False), ("ray/ftjob-x/meta.json", False),
    ("request-attempt-1.json", False), ("metrics-attempt-1.jsonl", False), ("adapter/.env", False),
    ("model/weights.part", False), ("Adapter/x", False),
])
def test_the_allowlist(path, allowed):
    assert is_allowed(path) is allowed


# --- a real job -----------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_jobs_artifacts_are_its_model_and_the_token_is_nowhere_a_tenant_reads(shared_stack, finished_job):
    stack, job_id = shared_stack, finished_job["id"]
    out = job_dir(stack.settings, job_id)

    # The run request, token and all, lies outside the job's folder, readable by its owner only.
    request = request_path(stack.settings, job_id, 1)
    token = __import__("json").loads(request.read_text())["ingest_token"]
    assert token.startswith("mfi_")
    assert out not in request.parents and not (out / request.name).exists()
    assert stat.S_IMODE(request.stat().st_mode) == 0o600
    # Nothing in the folder tenants read from holds it: not the spool, not Ray's state.
    for path in out.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert token.encode() not in path.read_bytes(), path

    listing = stack.http.get(ARTIFACTS.format(job_id), headers=stack.auth).json()["data"]
    paths = {f["path"] for f in listing}
    assert all(is_allowed(p) for p in paths), paths
    assert {p.split("/")[0] for p in paths} == {"adapter", "merged", "ray"}
    assert "adapter/adapter_config.json" in paths and "merged/config.json" in paths
    checkpoint_metrics = sorted(p for p in paths if p.startswith("ray/"))
    assert len(checkpoint_metrics) == 2 and all(p.endswith("/meta.json") for p in checkpoint_metrics)
    for f in listing:
        r = stack.http.get(f["url"], headers=stack.auth)
        assert r.status_code == 200 and token.encode() not in r.content, f["path"]

    planted = attempt_dir(stack.settings, job_id, 1) / "adapter" / "request.json"
    planted.symlink_to(request)  # even a symlink to it planted by hand (removed after: the job is the session's)
    try:
        for rel in ["request-attempt-1.json", "metrics-attempt-1.jsonl", "results.json", "adapter/request.json",
                    checkpoint_metrics[0].replace("meta.json", "state.pt"),
                    f"ray/{job_id}/checkpoint_manager_snapshot.json"]:
            r = stack.http.get(f"{ARTIFACTS.format(job_id)}/{rel}", headers=stack.auth)
            assert r.status_code == 404 and token.encode() not in r.content, rel
        assert raw_get(stack.server.url, f"{ARTIFACTS.format(job_id)}/adapter/../../../requests/{job_id}/{request.name}",
                       stack.key) == 404
        assert "adapter/request.json" not in {f["path"] for f in stack.http.get(
            ARTIFACTS.format(job_id), headers=stack.auth).json()["data"]}
    finally:
        planted.unlink()
