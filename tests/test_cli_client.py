"""`memfit jobs|files|plan` (the API client commands) against a live app (uvicorn on a port, real Postgres): what each command
prints for people and with --json for scripts; `jobs follow` driven by the SSE stream while records
are ingested."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.app import create_app
from api.routes.stream import StreamHub
from service.cli.main import app as cli
from service.scheduler.loop import Scheduler
from service.scheduler.ray_jobs import RayJobs
from tests.factories import create_job, new_key, settings_for, upload
from tests.scheduler_support import LiveServer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    # Its own database: a claim here must not pick up (or be crowded out by) other modules' queued jobs.
    with new_database() as url:
        settings = settings_for(url, tmp_path_factory.mktemp("storage"))
        app = create_app(settings)
        app.state.stream_hub = StreamHub(app.state.read_sessions, heartbeat_s=0.5)
        sched = Scheduler(app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))  # claims; never reaches Ray
        server = LiveServer(app).start()
        try:
            yield server, sched, app
        finally:
            server.stop()


@pytest.fixture
def tenant(env):
    server, _, app = env
    key = new_key(app.state.sessions)
    return key, {"MEMFIT_API_URL": server.url, "MEMFIT_API_KEY": key, "COLUMNS": "200"}


def run(envvars, *args, code=0):
    result = CliRunner().invoke(cli, list(args), env=envvars)
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def running_job(env, key) -> tuple[str, str]:
    server, sched, _ = env
    with server.client() as c:
        job = create_job(c, key, upload(c, key))
    sched.validate_pending()
    return job["id"], {j: t for j, _, t in sched.claim(limit=100)}[job["id"]]


def ingest(server, job_id, token, records):
    with server.client() as c:
        r = c.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": records},
                   headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text


def step_records(step, total=3):
    now = time.time()
    out = [{"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": step, "total_steps": total,
            "loss": 2.0 / step, "tokens_per_s": 500.0, "step_time_s": 0.2}]
    for rank in (0, 1):
        out.append({"kind": "memory", "attempt": 1, "time": now, "rank": rank, "step": step,
                    "parameters_bytes": 10 * 2**20, "gradients_bytes": 10 * 2**20, "optimizer_bytes": 20 * 2**20,
                    "activations_bytes": 5 * 2**20, "temporary_bytes": 2**20, "other_bytes": 0,
                    "peak_bytes": (46 + rank) * 2**20})
    return out


def test_files_upload_and_jobs_list_get(env, tenant, tmp_path):
    key, e = tenant
    data = tmp_path / "train.jsonl"
    data.write_text((ROOT / "examples" / "data" / "chat.jsonl").read_text())
    uploaded = json.loads(run(e, "files", "upload", str(data), "--json"))
    assert uploaded["id"].startswith("file-") and uploaded["filename"] == "train.jsonl"
    people = run(e, "files", "upload", str(data))
    assert people.startswith("file-") and "train.jsonl" in people and "rows" in people
    server, _, _ = env
    with server.client() as c:
        job = create_job(c, key, uploaded["id"])
    listed = json.loads(run(e, "jobs", "list", "--json"))
    assert [j["id"] for j in listed["data"]] == [job["id"]]  # only this tenant's jobs
    table = run(e, "jobs", "list")
    assert job["id"] in table and "validating_files" in table and "preset:tiny-llama" in table
    got = json.loads(run(e, "jobs", "get", job["id"], "--json"))
    assert got["id"] == job["id"] and got["object"] == "fine_tuning.job"
    people = run(e, "jobs", "get", job["id"])
    assert "status" in people and "validating_files" in people and "ddp" in people
    # Errors name the problem and exit 1; a missing key exits 2.
    out = run(e, "jobs", "get", "ftjob-nope", code=1)
    assert "404" in out and "ftjob-nope" in out
    out = run({**e, "MEMFIT_API_KEY": ""}, "jobs", "list", code=2)
    assert "MEMFIT_API_KEY" in out


def test_pause_resume_cancel(env, tenant):
    key, e = tenant
    server, sched, _ = env
    with server.client() as c:
        job_id = create_job(c, key, upload(c, key))["id"]
    sched.validate_pending()
    assert json.loads(run(e, "jobs", "pause", job_id, "--json"))["status"] == "paused"
    assert run(e, "jobs", "resume", job_id).strip() == f"{job_id}: queued"
    assert json.loads(run(e, "jobs", "cancel", job_id, "--json"))["status"] == "cancelled"
    out = run(e, "jobs", "cancel", job_id, code=1)
    assert "409" in out and "cancelled" in out


def test_follow_is_driven_by_the_stream_and_memory_prints_the_table(env, tenant):
    key, e = tenant
    server, _, _ = env
    job_id, token = running_job(env, key)
    ingest(server, job_id, token, step_records(1))

    def feed():
        time.sleep(1.0)
        for step in (2, 3):
            ingest(server, job_id, token, step_records(step))
            time.sleep(0.3)
        now = time.time()
        ingest(server, job_id, token, [
            {"kind": "memory", "attempt": 1, "time": now, "rank": r, "step": 0, "phase": "load", "source": "phase",
             "process_rss_bytes": (600 + r) * 2**20, "device": {"bytes_read": 1}} for r in (0, 1)] + [
            {"kind": "memory", "attempt": 1, "time": now, "rank": 0, "step": 3, "phase": "export", "source": "phase",
             "process_rss_bytes": 690 * 2**20}])
        ingest(server, job_id, token, [{"kind": "result", "attempt": 1, "time": time.time(),
                                        "fine_tuned_model": "ft:tiny:cli", "artifacts": {}}])

    t = threading.Thread(target=feed)
    t.start()
    out = run(e, "jobs", "follow", job_id)
    t.join(30)
    assert "step 3/3" in out
    assert "loss 0.6667" in out and "500 tok/s" in out
    assert "r0=46.0 MiB" in out and "r1=47.0 MiB" in out  # peak memory per rank
    assert f"{job_id} succeeded: ft:tiny:cli" in out

    # --json: one JSON object per event, in stream order, ending with the end marker.
    lines = [json.loads(line) for line in run(e, "jobs", "follow", job_id, "--json").splitlines() if line.strip()]
    assert lines[-1] == {"event": "end", "data": {"status": "succeeded"}}
    steps = [ev["data"]["step"] for ev in lines if ev.get("type") == "metrics"]
    assert steps == [1, 2, 3]
    ids = [int(ev["id"].removeprefix("ftevent-")) for ev in lines[:-1]]
    assert ids == sorted(set(ids))

    report = json.loads(run(e, "jobs", "memory", job_id, "--json"))
    rows = {r["category"]: r for r in report["per_rank"]["1"]}
    assert rows["parameters"]["measured_bytes"] == 10 * 2**20
    assert rows["total"]["measured_bytes"] == 47 * 2**20
    table = run(e, "jobs", "memory", job_id)
    assert "rank 0" in table and "rank 1" in table
    assert "optimizer states" in table and "20.0 MiB" in table and "47.0 MiB" in table

    # The job's phases outside the step, as the workers' PhaseMeter reported them (feed, above): planned beside
    # measured, and which phase peaks on each rank, by how much above the next.
    report = json.loads(run(e, "jobs", "memory", job_id, "--json"))
    ph = report["phases"]
    assert ph["phases"] == ["load", "step", "eval", "checkpoint", "export"]
    assert set(ph["planned"]) == set(ph["phases"]) and all(v["host_bytes"] > 0 for v in ph["planned"].values())
    assert ph["measured"]["0"]["load"]["host_bytes"] == 600 * 2**20 and "export" not in ph["measured"]["1"]
    assert ph["measured_peak"]["0"]["host"]["phase"] == "export"
    assert ph["measured_peak"]["0"]["host"]["above_next"] == pytest.approx(90 / 600)
    table = run(e, "jobs", "memory", job_id)
    assert "by phase of the job" in table and "690.0 MiB" in table and "601.0 MiB" in table
    assert "rank 0 measured host peak: export (15.0% above the next phase)" in table
    assert f"planned host peak: {ph['planned_peak']['host']['phase']}" in table


def test_follow_and_memory_are_tenant_scoped(env, tenant):
    key, e = tenant
    server, _, app = env
    job_id, _ = running_job(env, key)
    other = {**e, "MEMFIT_API_KEY": new_key(app.state.sessions)}
    assert "404" in run(other, "jobs", "follow", job_id, code=1)
    assert "404" in run(other, "jobs", "memory", job_id, code=1)


def test_plan_prints_the_breakdown_or_says_why_not(tenant, tmp_path):
    _, e = tenant
    spec = tmp_path / "job.yaml"
    spec.write_text("model: preset:small-llama\ntraining_file: data/train.jsonl\n"
                    "training:\n  peft: {method: lora, r: 16}\n  precision: bf16\n  gradient_checkpointing: true\n")
    plan = json.loads(run(e, "plan", str(spec), "--gpu", "a100-40gb", "--json"))
    assert plan["fits"] is True and plan["parameter_count"] > 0
    table = run(e, "plan", str(spec), "--gpu", "a100-40gb")
    assert "parameters" in table and "activations" in table and "total" in table and "fits" in table


def test_follow_stream_cancels_a_job_past_its_deadline(env, tenant):
    """`memfit run` follows its job with the same function and a timeout: past it, the job is cancelled."""
    import httpx
    from rich.console import Console

    from service.cli.client import follow_stream

    key, _ = tenant
    server, _, _ = env
    job_id, _ = running_job(env, key)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        t0 = time.monotonic()
        job = follow_stream(http, job_id, Console(file=io.StringIO()), timeout_s=1.0)
        assert time.monotonic() - t0 < 30
    assert job["status"] == "cancelled"
