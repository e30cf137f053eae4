"""A full disk on the storage path: uploads answer 507 ``storage_full`` and leave nothing behind; a
running job whose checkpoint cannot be written fails with ``storage_full``, naming what was being
written, and nothing half-written is recorded or served.

The storage folder is a small tmpfs mounted for the test (root only: skipped, with the reason,
where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from service.scheduler.paths import attempt_dir
from tests.factories import jsonl, new_tenant, post_file
from tests.scheduler_support import app_without_ray
from tests.test_api_jobs import assert_problem


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """``path`` as a tmpfs of ``size`` (mount -t tmpfs -o size=…), unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path}: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """A ballast file that takes all of ``directory``'s free space but ``leave_bytes``."""
    ballast = directory / "ballast"
    with ballast.open("wb") as out:
        while True:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize - leave_bytes
            if free <= 0:
                break
            try:
                out.write(b"\0" * min(free, 1 << 20))
                out.flush()
            except OSError:
                break
    return ballast


def rows(n: int, width: int = 200) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i} " + "q" * width},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]


def stored_files(storage: Path) -> list[str]:
    files_dir = storage / "files"
    return sorted(str(p.relative_to(storage)) for p in files_dir.rglob("*") if p.is_file()) if files_dir.exists() else []


# --- (a) uploads -------------------------------------------------------------------------------


@pytest.fixture
def small_storage(tmp_path, new_database):
    with tmpfs(tmp_path / "storage", "512k") as storage, app_without_ray(new_database, storage) as (app, client, _):
        yield app, client, storage


def test_upload_larger_than_the_free_space_is_507_and_leaves_nothing(small_storage):
    app, client, storage = small_storage
    t = new_tenant(app.state.sessions)
    content = jsonl(rows(4000))  # ~1 MB: more than the whole volume
    r = post_file(client, t.key, content, filename="big.jsonl")
    body = assert_problem(r, 507, "storage_full", "file")
    assert body["error"]["type"] == "server_error" and body["title"] == "Insufficient storage"
    assert "no space left" in body["detail"] and "'big.jsonl'" in body["detail"]
    assert r.headers["x-should-retry"] == "false"  # retrying at once cannot help
    assert client.get("/v1/files", headers=t.headers).json()["data"] == []
    assert stored_files(storage) == []  # no partial .part file, no final file
    # The space the failed upload took is free again: a small one is stored.
    ok = post_file(client, t.key, jsonl(rows(3)), filename="small.jsonl")
    assert ok.status_code == 200, ok.text
    assert [f["id"] for f in client.get("/v1/files", headers=t.headers).json()["data"]] == [ok.json()["id"]]
    assert stored_files(storage) == [f"files/{t.id}/{ok.json()['id']}.jsonl"]


def test_upload_onto_a_full_volume_is_507_and_leaves_nothing(small_storage):
    app, client, storage = small_storage
    t = new_tenant(app.state.sessions)
    first = post_file(client, t.key, jsonl(rows(3)), filename="first.jsonl")
    assert first.status_code == 200, first.text
    ballast = fill(storage)
    try:
        r = post_file(client, t.key, jsonl(rows(50)), filename="second.jsonl")
        assert_problem(r, 507, "storage_full", "file")
        listed = client.get("/v1/files", headers=t.headers).json()["data"]
        assert [f["id"] for f in listed] == [first.json()["id"]]
        assert stored_files(storage) == [f"files/{t.id}/{first.json()['id']}.jsonl"]
        # The file stored before the disk filled is intact.
        got = client.get(f"/v1/files/{first.json()['id']}/content", headers=t.headers)
        assert got.status_code == 200 and got.content == jsonl(rows(3))
    finally:
        ballast.unlink()


# --- (b) a running job ---------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_job_whose_checkpoint_does_not_fit_fails_storage_full(new_database, ray_head, tmp_path):
    """tiny-llama's full fine-tune checkpoint (model + Adam state, ~1.9 MB) does not fit a 1 MB
    storage volume that holds the uploads, the run request and the record spool."""
    from tests.stack import Stack

    with tmpfs(tmp_path / "storage", "1m") as storage, new_database() as url:
        stack = Stack(url, storage, ray_head)
        try:
            stack.start_scheduler()
            job_id = stack.create(strategy="ddp", resources={"num_workers": 1}, max_failures=0,
                                  hyperparameters={"max_steps": 2}, checkpoint_every_steps=1)
            job = stack.wait(job_id, ("failed",), timeout=240)
            error = job["error"]
            assert error["code"] == "storage_full", error
            assert error["message"].startswith("no space left on the storage volume while writing checkpoint ")
            assert str(attempt_dir(stack.settings, job_id, 1) / "ray") in error["message"]  # names where
            # Nothing half-written is recorded or served: no checkpoint, no checkpoint folder left.
            ckpts = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=stack.auth).json()
            assert ckpts["data"] == []
            listed = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts", headers=stack.auth).json()
            assert listed["data"] == []
            assert list((storage / "jobs" / job_id).rglob("checkpoint_*")) == []
            assert [p for p in storage.rglob("*") if p.name.endswith(".part")] == []
        finally:
            stack.close()


# --- the pieces: exported folders, and what fit() makes of Ray's wrapped errors --------------------


def test_an_export_that_does_not_fit_leaves_the_previous_folder_and_no_partial_one(tmp_path):
    from workers.checkpoint import StorageFullError, _publish_folder

    with tmpfs(tmp_path / "out", "256k") as out:
        (out / "model").mkdir()
        (out / "model" / "config.json").write_text("{}")  # a complete export from before
        with pytest.raises(StorageFullError) as caught:
            _publish_folder(out, "model", lambda d: (d / "model.safetensors").write_bytes(b"\0" * (1 << 20)))
        err = caught.value
        assert err.errno == 28 and err.phase == "export" and err.filename == str(out / "model")
        assert err.strerror.startswith(f"no space left on the storage volume while writing the final model folder "
                                       f"to {out / 'model'} (")
        assert sorted(p.name for p in out.iterdir()) == ["model"]  # no .model.part left
        assert [p.name for p in (out / "model").iterdir()] == ["config.json"]
        # With room, the folder is replaced whole.
        _publish_folder(out, "model", lambda d: (d / "model.safetensors").write_bytes(b"w"))
        assert [p.name for p in (out / "model").iterdir()] == ["model.safetensors"]


def test_fit_reads_storage_full_out_of_rays_wrapped_worker_errors():
    import pickle

    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    from workers.checkpoint import StorageFullError
    from workers.run import _storage_full_error

    def over_ray(exc: BaseException) -> BaseException:
        """As the driver receives a rank's error: wrapped with its traceback text (which holds the
        causes: pickling drops __cause__) in a WorkerGroupError, pickled."""
        try:
            raise exc
        except BaseException as raised:
            wrapped = construct_user_exception_with_traceback(raised)
        return pickle.loads(pickle.dumps(WorkerGroupError("rank 1 failed", {
            0: UserExceptionWithTraceback(RuntimeError("peer gone"), "tb"), 1: wrapped})))

    full = StorageFullError.writing("checkpoint checkpoint_x", "/s/jobs/j/ray/j/checkpoint_x",
                                    OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device"),
                                    "checkpoint")
    assert _storage_full_error(over_ray(full)) == {
        "code": "storage_full", "rank": 1, "phase": "checkpoint",
        "message": "no space left on the storage volume while writing checkpoint checkpoint_x to "
                   "/s/jobs/j/ray/j/checkpoint_x ([Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device)"}
    # pyarrow's own OSError, raised as the cause of a library's RuntimeError: still storage_full.
    try:
        try:
            raise OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        except OSError as exc:
            raise RuntimeError("save failed") from exc
    except RuntimeError as exc:
        wrapped = exc
    error = _storage_full_error(over_ray(wrapped))
    assert error["code"] == "storage_full" and error["rank"] == 1
    assert error["message"] == ("no space left on the storage volume: OSError: [Errno 28] Error writing bytes to "
                                "file. Detail: [errno 28] No space left on device")
    assert _storage_full_error(over_ray(RuntimeError("a plain bug"))) is None
    assert _storage_full_error(over_ray(OSError(13, "Permission denied"))) is None


def test_a_failure_the_full_spool_cannot_take_is_posted_from_a_temporary_one(tmp_path, new_database):
    """The job's record spool lies on the full volume: fit()'s failure still reaches the API."""
    from service.scheduler.paths import INGEST_PATH
    from service.store.models import Job
    from tests.factories import create_job, upload
    from tests.scheduler_support import LiveServer
    from workers.run import _deliver_failures, _failure

    with tmpfs(tmp_path / "storage", "512k") as storage, app_without_ray(new_database, storage) as (app, client, sched):
        t = new_tenant(app.state.sessions)
        job_id = create_job(client, t.key, upload(client, t.key))["id"]
        sched.validate_pending()
        [(_, attempt, token)] = [c for c in sched.claim(limit=100) if c[0] == job_id]
        server = LiveServer(app).start()
        ballast = None
        try:
            with app.state.sessions() as s:
                req = sched.run_request(s, s.get(Job, job_id), attempt, token)
            req = req.model_copy(update={"ingest_url": server.url + INGEST_PATH.format(job_id=job_id)})
            ballast = fill(storage)
            error = {"code": "storage_full", "message": "no space left on the storage volume while writing checkpoint x",
                     "rank": 0, "phase": "checkpoint"}
            _deliver_failures(req, [_failure(req, error)])
            job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=t.headers).json()
            assert job["status"] == "failed" and job["error"]["code"] == "storage_full", job
            spool = Path(req.metrics_path)
            assert not spool.exists() or b"storage_full" not in spool.read_bytes()  # it went another way
        finally:
            server.stop()
            if ballast is not None:
                ballast.unlink()


def test_a_local_checkpoint_that_does_not_fit_leaves_no_partial_folder(tmp_path):
    """The in-process runner (no Ray) copies each checkpoint under output_dir/checkpoints/."""
    from types import SimpleNamespace

    from workers.checkpoint import StorageFullError
    from workers.steps import Progress, WorkerEnv

    with tmpfs(tmp_path / "out", "256k") as out:
        env = WorkerEnv.local()
        progress = Progress(SimpleNamespace(output_dir=str(out)), env, total_steps=4, epoch_of=float)
        with pytest.raises(StorageFullError) as caught:
            progress.report({"step": 2}, lambda d: (Path(d) / "state.pt").write_bytes(b"\0" * (1 << 20)))
        assert caught.value.phase == "checkpoint"
        assert caught.value.strerror.startswith(
            f"no space left on the storage volume while writing the checkpoint of step 2 to {out / 'checkpoints' / 'step-2'}")
        assert not (out / "checkpoints" / "step-2").exists() and env.checkpoints == []
        progress.report({"step": 2}, lambda d: (Path(d) / "meta.json").write_text("{}"))  # room again
        assert env.checkpoints == [str(out / "checkpoints" / "step-2")]
