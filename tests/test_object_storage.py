"""Object storage (issue 33, item 6) without Ray: service/domain/storage.py's ObjectStore against a real
S3-compatible server (moto's, tests/s3server.py) — objects and prefixes put, read, listed, copied,
published whole and deleted; every key outside the store refused — and the API on it: an upload is
stored in the bucket (not on the volume), read back, counted by the quota, deleted; a job's artefacts
are listed and served from the bucket with the same allowlist as on the volume.

The whole path (a job that uploads, trains, checkpoints, resumes and exports there) is
tests/test_object_storage_job.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from sqlalchemy import select
from service.domain.storage import ObjectStore, StorageEscape, clean_key, localize
from service.settings import SettingsInvalid, load_settings
from tests.factories import bearer, jsonl, new_key, settings_for, upload
from tests.s3server import BUCKET
from tests.test_api_jobs import assert_problem


@pytest.fixture
def store(s3_server, request) -> ObjectStore:
    cfg = s3_server.settings("unit-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40])
    return ObjectStore(url=cfg["storage_url"], endpoint=cfg["storage_endpoint"], region=cfg["storage_region"])


def test_objects_and_prefixes_round_trip(store, s3_server, tmp_path):
    store.put_bytes("a/b/one.txt", b"one")
    (tmp_path / "two.bin").write_bytes(b"\x00" * 3000)
    store.put_file(tmp_path / "two.bin", "a/two.bin")
    assert store.get_bytes("a/b/one.txt") == b"one"
    assert b"".join(store.iter_bytes("a/two.bin", chunk=1000)) == b"\x00" * 3000
    assert store.size("a/two.bin") == 3000 and store.size("a/missing") is None
    assert store.exists("a") and store.exists("a/b/one.txt") and not store.exists("nothing")
    assert store.list("a") == [("b/one.txt", 3), ("two.bin", 3000)]
    assert store.list("nothing") == []
    assert store.bytes_under("a") == 3003 and store.bytes_under("a", skip=("b",)) == 3000
    assert store.uri("a/two.bin") == f"{store.url}/a/two.bin" and store.key_of(store.uri("a/two.bin")) == "a/two.bin"

    # a folder up and down again, a server-side copy, a publish that replaces the earlier folder whole
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"w" * 10)
    (src / "link").symlink_to(src / "config.json")  # never followed nor uploaded
    assert store.upload_tree(src, "t/up") == 12
    assert store.list("t/up") == [("config.json", 2), ("sub/w.bin", 10)]
    assert sorted(p.relative_to(tmp_path / "down").as_posix() for p in
                  store.download_tree("t/up", tmp_path / "down").rglob("*") if p.is_file()) == ["config.json", "sub/w.bin"]
    assert store.copy_tree("t/up", "t/copy", last="config.json") == 2 and store.list("t/copy") == store.list("t/up")
    store.put_bytes("t/model/stale.bin", b"old")
    store.publish_tree(src, "t/model")
    assert store.list("t/model") == [("config.json", 2), ("sub/w.bin", 10)]  # the earlier folder is gone
    assert not [k for k in s3_server.keys(store.root.split("/", 1)[1]) if ".part" in k]  # the partial upload too

    # a stored file as a local path, downloaded once
    local = localize(store.uri("a/b/one.txt"), store, tmp_path / "cache")
    assert Path(local).read_bytes() == b"one" and localize(local, store, tmp_path / "cache") == local

    store.delete("a/b/one.txt")
    store.delete("a/b/one.txt")  # gone already: no error
    store.delete_tree("t")
    assert store.list("t") == [] and store.list("a") == [("two.bin", 3000)]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a\\b", "a/\x00", "a/\nb", "a/"])
def test_a_key_outside_the_store_is_refused(key):
    with pytest.raises(StorageEscape):
        clean_key(key)


def test_paths_and_uris_outside_the_store_are_refused(store, tmp_path):
    for uri in (f"s3://{BUCKET}/elsewhere/x", "s3://other-bucket/x", f"{store.url}/../x", f"{store.url}x/y", store.url):
        with pytest.raises(StorageEscape):
            store.key_of(uri)
    with pytest.raises(StorageEscape):
        store.get_bytes("../escape")
    with pytest.raises(StorageEscape):
        localize(f"s3://{BUCKET}/elsewhere/x", store, tmp_path)
    root = tmp_path / "storage"
    assert store.key_for(root, root / "jobs" / "j1" / "model") == "jobs/j1/model"
    for outside in (tmp_path / "other" / "x", root, Path(f"{root}-x") / "y", root / "jobs" / ".." / ".." / "x"):
        with pytest.raises(StorageEscape):
            store.key_for(root, outside)


def test_the_setting_is_checked_at_start():
    assert load_settings(storage_url=" s3://bucket-1/a/b/ ").storage_url == "s3://bucket-1/a/b"
    assert load_settings(storage_url="").storage_url is None
    for bad in ("/data/memfit", "s3://Bucket", "s3://b", "s3://bucket/../x", "s3://key:secret@bucket", "s3://bucket?x=1"):
        with pytest.raises(SettingsInvalid, match="MEMFIT_STORAGE_URL"):
            load_settings(storage_url=bad)
    with pytest.raises(SettingsInvalid, match="MEMFIT_STORAGE_ENDPOINT"):
        load_settings(storage_endpoint="minio:9000")


@pytest.fixture(scope="module")
def db_url(new_database):
    with new_database() as url:
        yield url


def test_uploads_results_and_artefacts_live_in_the_bucket(db_url, s3_server, tmp_path):
    from service.jobs.artifacts import artifact_file
    from service.store.models import File, Job

    storage = tmp_path / "storage"
    settings = settings_for(db_url, storage, quota_storage_bytes=10_000_000, **s3_server.settings("api"))
    app = create_app(settings)
    http = TestClient(app)
    key = new_key(app.state.sessions)
    store = ObjectStore(url=settings.storage_url, endpoint=settings.storage_endpoint, region=settings.storage_region)

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(4)]
    file_id = upload(http, key, rows)
    with app.state.sessions() as s:
        row = s.get(File, file_id)
        tenant, path = row.tenant_id, row.path
    assert path == store.uri(f"files/{tenant}/{file_id}.jsonl")
    assert store.get_bytes(f"files/{tenant}/{file_id}.jsonl") == jsonl(rows)
    assert not list((storage / "files").rglob("*.jsonl"))  # nothing of it left on the volume
    r = http.get(f"/v1/files/{file_id}/content", headers=bearer(key))
    assert r.status_code == 200 and r.content == jsonl(rows) and r.headers["content-length"] == str(len(jsonl(rows)))

    # A job's folder in the bucket: its artefacts are served from there, under the same allowlist.
    job_id = "ftjob-s3unit"
    attempt = storage / "jobs" / job_id / "attempts" / "1"
    prefix = f"jobs/{job_id}/attempts/1"
    for rel, data in {"adapter/adapter_config.json": b"{}", "adapter/.x.part": b"p", ".model.part/w": b"p",
                      "ray/run/checkpoint_1/meta.json": b'{"step": 1}', "ray/run/checkpoint_1/model.pt": b"secret",
                      "failure-rank0.json": b"{}"}.items():
        store.put_bytes(f"{prefix}/{rel}", data)
    with app.state.sessions.begin() as s:
        s.add(Job(id=job_id, tenant_id=tenant, status="succeeded", model="tiny-llama", spec={}, training_file=file_id,
                  output_dir=str(attempt), attempt=1))
    listed = http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts", headers=bearer(key)).json()["data"]
    assert [(f["path"], f["bytes"]) for f in listed] == [("adapter/adapter_config.json", 2),
                                                        ("ray/run/checkpoint_1/meta.json", 11)]
    r = http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/adapter/adapter_config.json", headers=bearer(key))
    assert r.status_code == 200 and r.content == b"{}"
    for refused in ("ray/run/checkpoint_1/model.pt", "failure-rank0.json", "adapter/.x.part", ".model.part/w",
                    "adapter/../failure-rank0.json", "adapter/missing.json"):
        r = http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/{refused}", headers=bearer(key))
        assert r.status_code == 404, (refused, r.status_code)
    with app.state.sessions() as s:  # a job whose output_dir a forged write put outside the volume
        job = s.get(Job, job_id)
        job.output_dir = str(tmp_path / "elsewhere")
        with pytest.raises(Exception, match="elsewhere|adapter"):
            artifact_file(job, settings, "adapter/adapter_config.json")

    # The quota counts the bucket: the upload and every object under the job's prefix.
    from service.jobs import quotas

    with app.state.sessions() as s:
        used = quotas.storage_used(s, tenant, settings)
        assert used == len(jsonl(rows)) + 2 + 1 + 1 + 11 + 6 + 2
        with pytest.raises(quotas.QuotaExceeded):
            quotas.check_storage(s, tenant, settings, adding_bytes=settings.quota_storage_bytes - used + 1)

    assert http.delete(f"/v1/files/{file_id}", headers=bearer(key)).status_code == 200
    assert store.size(f"files/{tenant}/{file_id}.jsonl") is None
    assert http.get(f"/v1/files/{file_id}/content", headers=bearer(key)).status_code == 404


def test_a_worker_publishes_its_export_into_the_bucket_and_counts_the_quota_there(store, tmp_path, monkeypatch):
    from workers import storage as ws

    attempt = tmp_path / "volume" / "jobs" / "j1" / "attempts" / "1"
    attempt.mkdir(parents=True)
    uri = store.uri("jobs/j1/attempts/1")
    ws.attach(attempt, store, uri)
    try:
        def export(d: Path) -> None:
            (d / "config.json").write_text("{}")
            (d / "weights.bin").write_bytes(b"w" * 100)

        final = ws.publish_folder(attempt, "model", export)
        assert final == attempt / "model" and not final.exists()  # published, then no local copy
        assert store.list("jobs/j1/attempts/1/model") == [("config.json", 2), ("weights.bin", 100)]
        # Ray Train's path of a checkpoint in the bucket, named as in the volume's layout for ingest
        assert ws.remote_to_local(store.fs_path("jobs/j1/attempts/1/ray/r/checkpoint_1")) == str(
            attempt / "ray" / "r" / "checkpoint_1")
        assert ws.remote_to_local(store.fs_path("jobs/j2/attempts/1/x")) == store.fs_path("jobs/j2/attempts/1/x")

        # The budget counts the objects under the attempt's prefix (the staged resume left out)
        store.put_bytes("jobs/j1/attempts/1/resume/big.bin", b"r" * 1000)
        monkeypatch.setenv(ws.BUDGET_ENV, "150")
        ws.check_storage_budget("a checkpoint", 40, attempt, "checkpoint", attempt / "ray")
        with pytest.raises(ws.StorageQuotaError, match="storage quota exceeded"):
            ws.check_storage_budget("a checkpoint", 60, attempt, "checkpoint", attempt / "ray")
        with pytest.raises(ws.StorageQuotaError):
            ws.publish_folder(attempt, "merged", export)
        assert store.list("jobs/j1/attempts/1/merged") == [] and not (attempt / ".merged.part").exists()
    finally:
        ws.attach(attempt, None, None)


def test_an_upload_the_store_does_not_take_is_503_and_nothing_is_recorded(db_url, tmp_path):
    from service.ports import free_port
    from service.store.models import File

    settings = settings_for(db_url, tmp_path / "storage", storage_url=f"s3://{BUCKET}/down",
                            storage_endpoint=f"http://127.0.0.1:{free_port()}", storage_region="us-east-1")
    app = create_app(settings)
    http = TestClient(app)
    key = new_key(app.state.sessions)
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    r = http.post("/v1/files", headers=bearer(key), files={"file": ("t.jsonl", jsonl(rows), "application/jsonl")},
                  data={"purpose": "fine-tune"})
    assert_problem(r, 503, "storage_unavailable", None)
    assert r.headers["retry-after"] == "5"
    with app.state.sessions() as s:
        assert not s.scalars(select(File).where(File.path.like(f"s3://{BUCKET}/down/%"))).all()
    assert not list((tmp_path / "storage").rglob("*.jsonl")) and not list((tmp_path / "storage").rglob("*.part"))
