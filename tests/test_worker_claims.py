"""What a worker reports is a claim, checked (issue 37, item 1).

Real Postgres, the real app and the scheduler's own code; no Ray (nothing here needs a run). The attack:
tenant B holds a leaked or forged ingest token of one of its jobs and reports, as that job's
checkpoint or artefact, a path of tenant A's (or an upload, or a symlink out of its own folder); the
next attempt would hard-link it and load it. And a checkpoint file that is a pickle which runs code
when loaded. Each is refused, and nothing is linked or executed:

- ingest accepts a path only inside the attempt's own folder (resolved: ``..`` and symlinks followed)
  and stores it relative to that folder; anything else is a 422 naming the record's field, the whole
  batch refused;
- the scheduler links a checkpoint into a new attempt only from the job's own folders, and never a
  symlink inside it (a row an older memfit stored, or one written to the database by other means);
- every checkpoint load in workers/ is ``torch.load(weights_only=True)`` (workers/checkpoint.py:
  safe_load), and what memfit saves — model, optimizer, schedule, RNG — loads that way.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from service.domain.states import JobStatus
from service.scheduler.paths import attempt_dir, job_dir
from service.store.models import Checkpoint, Job
from service.store.transitions import transition
from tests.factories import bearer, create_job, new_key, upload
from tests.scheduler_support import app_without_ray
from workers import checkpoint as ckpt

INGEST = "/v1/internal/jobs/{}/ingest"


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


def running_job(env) -> tuple[str, str, str]:
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    tokens = {job_id: token for job_id, _, token in sched.claim(limit=100)}
    return job["id"], tokens[job["id"]], key


def a_checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint folder as Ray Train leaves one: meta.json and a state file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(f'{{"step": {step}, "strategy": "ddp", "trained_tokens": 1}}')
    (folder / "state.pt").write_bytes(b"tenant A's weights")
    return folder


def checkpoint_record(path: str, step: int = 4) -> dict:
    return {"kind": "checkpoint", "attempt": 1, "time": time.time(), "step": step, "path": path, "metrics": {}}


def post(client, job_id: str, token: str, records: list[dict]):
    return client.post(INGEST.format(job_id), json={"records": records}, headers=bearer(token))


def stored_checkpoints(app, job_id: str) -> list[tuple[int, str]]:
    with app.state.sessions() as s:
        return [tuple(r) for r in s.execute(select(Checkpoint.step, Checkpoint.path).where(Checkpoint.job_id == job_id))]


def test_a_forged_path_of_another_tenant_is_refused_and_never_linked(env):
    app, client, sched = env
    settings = sched.settings
    job_a, _, _ = running_job(env)
    job_b, token_b, key_b = running_job(env)
    theirs = a_checkpoint(attempt_dir(settings, job_a, 1) / "ray" / job_a / "checkpoint_000004", 4)
    mine = attempt_dir(settings, job_b, 1)
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "escape").symlink_to(theirs)  # a symlink inside B's folder that leads to A's checkpoint
    upload_path = next((settings.storage_dir / "files").rglob("*.jsonl"))

    forged = {
        "another tenant's checkpoint": str(theirs),
        "a path that climbs out": f"../../../{job_a}/attempts/1/ray/{job_a}/checkpoint_000004",
        "a symlink out of the attempt's folder": str(mine / "escape"),
        "an upload": str(upload_path),
        "the storage root": str(settings.storage_dir),
        "the attempt's folder itself": str(mine),
    }
    for what, path in forged.items():
        r = post(client, job_b, token_b, [checkpoint_record(path)])
        assert r.status_code == 422, (what, r.text)
        body = r.json()
        assert body["code"] == "path_outside_attempt" and body["param"] == "records[0].path", (what, body)
    r = post(client, job_b, token_b, [{"kind": "result", "attempt": 1, "time": time.time(),
                                        "fine_tuned_model": "ft:x", "artifacts": {"adapter": str(theirs)}}])
    assert r.status_code == 422 and r.json()["param"] == "records[0].artifacts.adapter", r.text
    assert stored_checkpoints(app, job_b) == []
    with app.state.sessions() as s:
        assert s.get(Job, job_b).status == "running"  # the forged result ended nothing

    # A real checkpoint of B's own attempt: accepted, stored relative to the attempt's folder, shown where it is.
    own = a_checkpoint(mine / "ray" / job_b / "checkpoint_000002", 2)
    r = post(client, job_b, token_b, [checkpoint_record(str(own), step=2)])
    assert r.status_code == 200, r.text
    assert stored_checkpoints(app, job_b) == [(2, f"ray/{job_b}/checkpoint_000002")]
    listed = client.get(f"/v1/fine_tuning/jobs/{job_b}/checkpoints", headers=bearer(key_b)).json()["data"]
    assert [c["path"] for c in listed] == [str(own)]

    # The next attempt resumes from B's own checkpoint, and links nothing of A's.
    with app.state.sessions.begin() as s:
        transition(s, job_b, JobStatus.queued, expected_attempt=1, lease_owner=None)
    with app.state.sessions.begin() as s:
        transition(s, job_b, JobStatus.running, expected_attempt=1, attempt=2)
    out = attempt_dir(settings, job_b, 2)
    with app.state.sessions() as s:
        staged = sched._stage_resume(s, job_b, 2, out)
    assert staged == str(out / "resume") and (out / "resume" / "meta.json").read_text().startswith('{"step": 2')


def test_the_scheduler_links_only_from_the_jobs_own_folders(env):
    """Rows written around the ingest (an older memfit stored absolute paths; a database writer): the
    staging of a resume checks again, and skips symlinks inside a checkpoint folder."""
    app, _, sched = env
    settings = sched.settings
    job_a, _, _ = running_job(env)
    job_b, _, _ = running_job(env)
    theirs = a_checkpoint(attempt_dir(settings, job_a, 1) / "ray" / job_a / "checkpoint_000009", 9)
    own = a_checkpoint(attempt_dir(settings, job_b, 1) / "ray" / job_b / "checkpoint_000003", 3)
    (own / "stolen.pt").symlink_to(theirs / "state.pt")
    with app.state.sessions.begin() as s:
        s.add(Checkpoint(id="ftckpt-forged9", job_id=job_b, attempt=1, step=9, path=str(theirs), metrics={}))
        s.add(Checkpoint(id="ftckpt-forged8", job_id=job_b, attempt=1, step=8, path=f"../../../{job_a}/attempts/1/ray/"
                         f"{job_a}/checkpoint_000009", metrics={}))
        s.add(Checkpoint(id="ftckpt-own3", job_id=job_b, attempt=1, step=3, path=str(own), metrics={}))
    out = attempt_dir(settings, job_b, 2)
    with app.state.sessions() as s:
        staged = sched._stage_resume(s, job_b, 2, out)
    assert staged == str(out / "resume")
    assert sorted(p.name for p in (out / "resume").iterdir()) == ["meta.json", "state.pt"]  # no stolen.pt
    assert (out / "resume" / "meta.json").read_text().startswith('{"step": 3')  # not A's step 9
    assert os.stat(out / "resume" / "state.pt").st_ino == os.stat(own / "state.pt").st_ino
    assert not any(job_a in str(p.resolve()) for p in (out / "resume").rglob("*"))
    assert job_dir(settings, job_a).is_dir() and (theirs / "state.pt").read_bytes() == b"tenant A's weights"


class _Payload:
    """A pickle that makes a folder when loaded — any code could run in its place."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_pickle_payload_in_a_checkpoint_is_refused_before_it_runs(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    good = tmp_path / "good"
    good.mkdir()
    ckpt.save_torch_state(str(good), model, optimizer, scheduler, step=1, strategy="ddp", trained_tokens=1,
                          rank=0, trainable_only=False)
    for name in ("state.pt", "rng-rank0.pt"):  # each file a resume reads, in turn the one that is forged
        d = tmp_path / name.removesuffix(".pt")
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        marker = tmp_path / f"ran-{name}"
        torch.save({"model": {}, "optimizer": _Payload(marker), "scheduler": {}, "torch": _Payload(marker),
                    "python": _Payload(marker)}, d / name)
        with pytest.raises(pickle.UnpicklingError):
            ckpt.load_torch_state(str(d), model, optimizer, scheduler, rank=0, trainable_only=False)
        assert not marker.exists(), f"the payload in {name} ran"
    marker = tmp_path / "ran-safe-load"
    torch.save({"scheduler": _Payload(marker)}, tmp_path / "scheduler.pt")  # fsdp's and pipeline's schedule file
    with pytest.raises(pickle.UnpicklingError):
        ckpt.safe_load(tmp_path / "scheduler.pt")
    assert not marker.exists()


def test_what_memfit_saves_loads_back_with_weights_only(tmp_path):
    """The model, the optimizer's moments, the schedule and the RNG state of a checkpoint load under
    weights_only=True and restore the run exactly (the next random draw, the next step's update)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    ckpt.save_torch_state(str(tmp_path), model, optimizer, scheduler, step=2, strategy="ddp", trained_tokens=8,
                          rank=0, trainable_only=False)
    expected_draw = torch.rand(3)
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda step: 1.0 / (step + 1))
    meta = ckpt.load_torch_state(str(tmp_path), other, other_opt, other_sched, rank=0, trainable_only=False)
    assert meta["step"] == 2
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG state came back
    assert torch.equal(other.weight, model.weight) and other_sched.last_epoch == scheduler.last_epoch
    moments = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], moments)
