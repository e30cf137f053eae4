"""Job start: the code package built once per code version, driver logs read by offset (Ray Train
restarts still become job events, once each), and `memfit serve` answering before its Ray head is up."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.scheduler.local_head import free_port

MEMFIT = Path(sys.executable).with_name("memfit")
# Ray Train's controller logs "[FailurePolicy] RETRY" to the driver for each restart. Built at run time:
# the driver log also shows the entrypoint's command line, which must not count as a restart.
PRINT_LINES = ("import time\n"
               "for i in range(6):\n"
               "    print(f'line {i}' + (' [Failure' + 'Policy] RETRY' if i in (1, 4) else ''), flush=True)\n"
               "    time.sleep(0.4)\n")


def _entrypoint(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def _wait_done(ray, sid: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = ray.status(sid)
        if st is not None and st.status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return st.status
        time.sleep(0.2)
    raise AssertionError(f"{sid} did not end within {timeout_s:.0f} s")


@pytest.mark.ray
def test_the_code_is_hashed_once_and_submitted_as_package_uris(ray_head):
    from service.scheduler.ray_jobs import RayJobs, _code_dirs, _package_uri

    ray = RayJobs(ray_head.dashboard_url)
    uris = ray.code_packages()
    assert uris == [_package_uri(p) for p in _code_dirs()]
    assert all(u.startswith("gcs://_ray_pkg_") and u.endswith(".zip") for u in uris)
    assert all(ray.client._package_exists(u) for u in uris)
    assert ray.code_packages() == uris and ray._packages == uris  # computed once, kept

    sid = f"pkg-uri-{os.getpid()}-{time.time_ns()}"
    assert ray.submit(sid, _entrypoint("import service.scheduler.ray_jobs, workers.run"), {}, {})
    assert _wait_done(ray, sid) == "SUCCEEDED", ray.log_tail(sid)
    # Ray got the URIs, not folders to zip: the driver imported memfit's code from them.
    assert ray.client.get_job_info(sid).runtime_env["py_modules"] == uris


@pytest.mark.ray
def test_a_package_the_cluster_lacks_is_uploaded(ray_head, tmp_path):
    from service.scheduler.ray_jobs import RayJobs, _package_uri

    pkg = tmp_path / "memfit_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"TOKEN = {time.time_ns()}\n")  # content no cluster has seen
    ray = RayJobs(ray_head.dashboard_url)
    uri = _package_uri(pkg)
    assert not ray.client._package_exists(uri)
    ray._ensure_package(uri, pkg)
    assert ray.client._package_exists(uri)


@pytest.mark.ray
@pytest.mark.parametrize("source", ["file", "jobs_api"])
def test_driver_log_lines_are_read_once_each(ray_head, source):
    from service.scheduler.ray_jobs import LogCursor, RayJobs

    ray = RayJobs(ray_head.dashboard_url, driver_log_dir=ray_head.logs_dir if source == "file" else None)
    sid = f"log-{source}-{os.getpid()}-{time.time_ns()}"
    ray.submit(sid, _entrypoint(PRINT_LINES), {"PYTHONUNBUFFERED": "1"}, {})
    cursor, seen, polls = LogCursor(), [], 0
    while ray.status(sid) is None or ray.status(sid).status not in ("SUCCEEDED", "FAILED"):
        seen += ray.new_log_lines(sid, cursor)
        polls += 1
        time.sleep(0.3)
    seen += ray.new_log_lines(sid, cursor)
    assert [line for line in seen if line.startswith("line ")] == [
        f"line {i}" + (" [FailurePolicy] RETRY" if i in (1, 4) else "") for i in range(6)]
    assert cursor.from_file == (source == "file")
    assert polls > 2  # read while it was being written, not only at the end


@pytest.mark.ray
def test_ray_train_restarts_in_the_driver_log_become_job_events_once_each(ray_head, tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.scheduler.loop import Scheduler, _Watch
    from service.scheduler.paths import submission_id
    from service.scheduler.ray_jobs import RayJobs
    from service.store import db
    from service.store.models import JobEvent
    from tests.factories import create_job, new_key, settings_for, upload

    url = f"sqlite:///{tmp_path / 'memfit.db'}"
    db.upgrade(url)
    settings = settings_for(url, tmp_path / "storage")
    app = create_app(settings)
    ray = RayJobs(ray_head.dashboard_url, driver_log_dir=ray_head.logs_dir)
    scheduler = Scheduler(app.state.sessions, settings, ray, restart_check_s=0.0)
    with TestClient(app) as http:
        key = new_key(app.state.sessions)
        job = create_job(http, key, upload(http, key))
    sid = submission_id(job["id"], 1) + f"-{time.time_ns()}"  # a stand-in driver that logs two retries
    ray.submit(sid, _entrypoint(PRINT_LINES), {"PYTHONUNBUFFERED": "1"}, {})
    watch = _Watch()
    while ray.status(sid) is None or ray.status(sid).status not in ("SUCCEEDED", "FAILED"):
        scheduler._watch_restarts(job["id"], 1, sid, watch)
        time.sleep(0.3)
    for _ in range(3):  # the rest, and polls that find nothing new
        scheduler._watch_restarts(job["id"], 1, sid, watch)
    with app.state.sessions() as s:
        restarts = [e.data["restart"] for e in s.query(JobEvent).filter(JobEvent.job_id == job["id"])
                    if "restarted the worker group" in e.message]
    assert restarts == [1, 2] and watch.restarts_seen == 2 and watch.log.from_file
    app.state.engine.dispose()


# --- memfit serve ------------------------------------------------------------------------------------


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMFIT_", "RAY_ADDRESS"))}
    env.update({"MEMFIT_DATABASE_URL": f"sqlite:///{home / 'memfit.db'}", "MEMFIT_STORAGE_DIR": str(home / "storage"),
                "MEMFIT_PRESET_CACHE": str(home / "presets"), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    return env


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_answers_before_its_ray_head_is_up_and_keeps_the_jobs_posted_meanwhile(tmp_path):
    """/healthz first, /readyz 503 with the reason while the local head starts, then 200; a job posted
    before Ray is up waits in the queue and is submitted once it is. The seconds to /healthz are
    printed (bench/serve_start.py measures them), not asserted."""
    from tests.factories import CHAT_JSONL, MODEL

    env = _env(tmp_path)
    key = subprocess.run([str(MEMFIT), "keys", "create", "--tenant", "early"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    proc = subprocess.Popen([str(MEMFIT), "serve", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    # Long timeouts: the first requests wait while the API is built (seconds; more on a loaded machine).
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=180, headers={"Authorization": f"Bearer {key}"})
    try:
        healthy_at = None
        while healthy_at is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < 120, "no /healthz within 120 s"
            try:
                if http.get("/healthz", timeout=2).status_code == 200:
                    healthy_at = time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(0.05)
        print(f"memfit serve answered /healthz {healthy_at:.2f} s after its start")
        early = http.get("/readyz")
        file_id = http.post("/v1/files", files={"file": ("train.jsonl", CHAT_JSONL)},
                            data={"purpose": "fine-tune"}).json()["id"]
        posted = http.post("/v1/fine_tuning/jobs", json={
            "model": MODEL, "training_file": file_id,
            "training": {"hyperparameters": {"max_steps": 1}, "resources": {"num_workers": 1}}})
        posted_while_starting = http.get("/readyz").status_code == 503
        assert posted.status_code == 200, posted.text
        job_id = posted.json()["id"]
        if early.status_code == 503:  # the API still being built, or the head starting: the usual case
            assert early.json().get("api") == "starting" or early.json()["ray"] == "starting the local Ray head", \
                early.json()
            assert early.headers["Retry-After"] in ("1", "2")
        deadline = time.monotonic() + 300
        while (r := _readyz(http, proc, log)) is None or r.status_code != 200:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, r.json() if r is not None else "no answer"
            time.sleep(0.2)
        assert r.json()["ray"] == "ok"
        submitted = None
        while submitted is None and time.monotonic() < deadline:
            events = http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
            submitted = next((e for e in events if e["message"].startswith("Submitted to Ray as")), None)
            time.sleep(0.3)
        assert submitted is not None, events
        print(f"readyz 503 when the job was posted: {posted_while_starting}")
    finally:
        http.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    assert not (tmp_path / "storage" / "run" / "ray-readiness.json").exists()  # nothing stale for the next start
    with sqlite3.connect(tmp_path / "memfit.db") as db:
        assert db.execute("SELECT attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] == 1


def _readyz(http: httpx.Client, proc: subprocess.Popen, log: Path) -> httpx.Response | None:
    """GET /readyz; None where the connection failed while the server still runs (the caller retries):
    once, in a CI run, a connection was refused here mid-start. If the server has exited, its exit
    code and the end of its log say why."""
    try:
        return http.get("/readyz")
    except httpx.TransportError as exc:
        time.sleep(0.5)
        assert proc.poll() is None, f"{exc!r}; memfit serve exited {proc.poll()}: {log.read_text()[-3000:]}"
        print(f"/readyz: {exc!r} while memfit serve runs; retrying")
        return None


# --- /readyz and the booting API -------------------------------------------------------------------


def test_readyz_says_why_while_the_embedded_scheduler_cannot_reach_ray(api_app):
    from starlette.testclient import TestClient

    from service.scheduler import readiness

    settings = api_app.state.settings
    client = TestClient(api_app)
    try:
        readiness.mark(settings, False, "starting the local Ray head")
        r = client.get("/readyz")
        assert r.status_code == 503 and r.headers["Retry-After"] == "2"
        assert r.json()["ray"] == "starting the local Ray head" and r.json()["database"] == "ok"
        readiness.mark(settings, True, "Ray at http://127.0.0.1:1")
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["ray"] == "ok"
    finally:
        readiness.clear(settings)
    assert "ray" not in client.get("/readyz").json()  # no embedded scheduler: Ray is not the API's concern


def test_the_booting_api_answers_healthz_at_once_and_holds_other_requests_until_it_is_built(api_settings):
    import threading

    from starlette.testclient import TestClient

    from api.app import create_app
    from service.cli.embedded import BootingApp
    from tests.factories import new_key

    release = threading.Event()
    built = {}

    def slow_factory():
        release.wait(60)
        built["app"] = create_app(api_settings)
        return built["app"]

    with TestClient(BootingApp(slow_factory)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json() == {"status": "unavailable", "api": "starting"}
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(client.get("/v1/fine_tuning/jobs")))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not answers  # held, not refused
        release.set()
        waiting.join(60)
        assert answers[0].status_code == 401  # the real app answered it (no key sent)
        key = new_key(built["app"].state.sessions)
        r = client.get("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["data"] == []
        assert client.get("/readyz").status_code == 200


def test_a_posted_job_wakes_the_scheduler_instead_of_waiting_for_its_next_poll(new_database, tmp_path):
    """`memfit serve` and `memfit run` serve the API wrapped so that a created job wakes the loop: with
    a 60 s poll interval the job still leaves validating_files within seconds."""
    from starlette.testclient import TestClient

    from service.cli.embedded import WakeSchedulerOnPost
    from service.scheduler.loop import start_in_thread
    from tests.factories import create_job, new_key, upload
    from tests.scheduler_support import app_without_ray

    with app_without_ray(new_database, tmp_path / "storage", poll_seconds=60) as (app, _, sched):
        thread, stop = start_in_thread(sched)
        try:
            deadline = time.monotonic() + 60
            while not (sched._last_heartbeat and sched._tick_started is None):  # the first tick is over
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with TestClient(WakeSchedulerOnPost(app)) as http:
                key = new_key(app.state.sessions)
                job = create_job(http, key, upload(http, key))
                posted = time.monotonic()
                while (status := http.get(f"/v1/fine_tuning/jobs/{job['id']}",
                                          headers={"Authorization": f"Bearer {key}"}).json()["status"]) \
                        == "validating_files" and time.monotonic() - posted < 30:
                    time.sleep(0.1)
        finally:
            stop.set()
            thread.join(30)
    assert status != "validating_files"  # a tick ran long before the 60 s poll was due
