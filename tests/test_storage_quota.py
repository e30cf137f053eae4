"""Storage quotas that count what is stored (issue 37, item 7), on real Postgres and a real volume.

- the tenant's storage is its uploads plus everything its jobs wrote — checkpoints of every attempt,
  exported models, results — measured on disk (each hard-linked file once), so an upload is refused
  when checkpoints and exports fill the quota;
- the scheduler gives each run what the quota leaves (MEMFIT_STORAGE_BUDGET_BYTES), and the workers
  check it before a checkpoint is uploaded and before an export is published: past it, nothing is
  written (the partial export is removed) and the job's error is ``storage_quota_exceeded``;
- admission refuses a model past MEMFIT_MAX_MODEL_BYTES;
- the image keeps hub downloads off (tests/test_deploy_configs.py checks the rest of the Dockerfile).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.jobs import quotas
from service.scheduler.paths import attempt_dir
from tests.factories import create_job, new_key, post_file, post_job, settings_for, upload
from workers import storage

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def db_url(new_database):
    with new_database() as url:
        yield url


def serve(db_url, storage, **overrides):
    app = create_app(settings_for(db_url, storage, **overrides))
    return app, TestClient(app)


def test_checkpoints_and_exports_count_against_the_tenants_storage(db_url, tmp_path):
    app, client = serve(db_url, tmp_path / "storage", quota_storage_bytes=200_000)
    with client:
        key, other = new_key(app.state.sessions), new_key(app.state.sessions)
        job = create_job(client, key, upload(client, key))
        folder = attempt_dir(app.state.settings, job["id"], 1)
        (folder / "ray" / "checkpoint_000001").mkdir(parents=True)
        (folder / "ray" / "checkpoint_000001" / "state.pt").write_bytes(b"x" * 120_000)  # a checkpoint
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"y" * 50_000)  # an export
        resumed = attempt_dir(app.state.settings, job["id"], 2) / "resume"
        resumed.mkdir(parents=True)
        os.link(folder / "ray" / "checkpoint_000001" / "state.pt", resumed / "state.pt")  # counted once
        with app.state.sessions() as s:
            used = quotas.storage_used(s, job["organization_id"], app.state.settings)
        assert 170_000 <= used < 175_000, used
        r = post_file(client, key, '{"text": "' + "z" * 30_000 + '"}\n')
        assert r.status_code == 429 and r.json()["code"] == "storage_quota_exceeded", r.text
        assert "checkpoints and exports" in r.json()["detail"]
        assert post_file(client, other).status_code == 200  # another tenant's storage is its own
        with app.state.sessions() as s:
            budget = quotas.storage_budget(s, job["organization_id"], app.state.settings)
        assert budget == 200_000 - used
    app.state.engine.dispose()


def test_a_checkpoint_or_export_past_the_budget_is_refused_before_it_is_written(tmp_path, monkeypatch):
    attempt = tmp_path / "attempt"
    (attempt / "resume").mkdir(parents=True)
    (attempt / "resume" / "state.pt").write_bytes(b"r" * 500_000)  # the checkpoint it resumed from: not this run's
    (attempt / "ray").mkdir()
    (attempt / "ray" / "old.pt").write_bytes(b"o" * 60_000)
    monkeypatch.setenv(storage.BUDGET_ENV, "100000")
    storage.check_storage_budget("checkpoint 2", 30_000, attempt, "checkpoint", attempt / "ray" / "checkpoint_2")  # fits
    with pytest.raises(storage.StorageQuotaError) as caught:
        storage.check_storage_budget("checkpoint 3", 50_000, attempt, "checkpoint", attempt / "ray" / "checkpoint_3")
    assert caught.value.errno == errno.EDQUOT and caught.value.phase == "checkpoint"
    assert "MEMFIT_QUOTA_STORAGE_BYTES" in str(caught.value) and "nothing was written" in str(caught.value)

    def export(d: Path) -> None:
        (d / "model.safetensors").write_bytes(b"m" * 80_000)

    with pytest.raises(storage.StorageQuotaError):
        storage.publish_folder(attempt, "model", export)
    assert not (attempt / "model").exists() and not (attempt / ".model.part").exists()  # nothing left, nothing listed
    monkeypatch.setenv(storage.BUDGET_ENV, "200000")
    assert storage.publish_folder(attempt, "model", export) == attempt / "model"  # with room, published

    # the driver reports it as the job's structured error
    from workers.run import _storage_full_error

    error = _storage_full_error(RuntimeError("worker group failed").with_traceback(None))
    assert error is None
    wrapped = RuntimeError("worker group failed")
    wrapped.__cause__ = caught.value
    error = _storage_full_error(wrapped)
    assert error["code"] == "storage_quota_exceeded" and error["phase"] == "checkpoint"


def test_admission_caps_the_model_size(db_url, tmp_path):
    app, client = serve(db_url, tmp_path / "storage", max_model_bytes=100_000)
    with client:
        key = new_key(app.state.sessions)
        r = post_job(client, key, training_file=upload(client, key))  # preset:tiny-llama: some 300,000 parameters, ~600 KB
        assert r.status_code == 422 and r.json()["errors"][0]["code"] == "model_too_large", r.text
        assert r.json()["param"] == "model" and "MEMFIT_MAX_MODEL_BYTES" in r.json()["detail"]
    app.state.engine.dispose()
    app, client = serve(db_url, tmp_path / "storage2")
    with client:
        key = new_key(app.state.sessions)
        r = post_job(client, key, training_file=upload(client, key))
        assert r.status_code == 200, r.text  # the default cap admits it
    app.state.engine.dispose()


def test_the_image_keeps_hub_downloads_off():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "HF_HUB_OFFLINE=1" in text and "HF_HUB_OFFLINE=0 \\" not in text and not text.rstrip().endswith("HF_HUB_OFFLINE=0")
