"""The whole service on one Postgres database, for tests that run real jobs: the API on a port, a
scheduler in a thread submitting to the session's shared Ray head, and an uploaded training and
validation file. The conftest fixtures `shared_stack` and `finished_job` hold one for the session;
modules that need a stack of their own (their own scheduler, faults) build one with `Stack(...)`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from api.app import create_app
from service.scheduler.local_head import free_port
from service.scheduler.loop import Scheduler, start_in_thread
from service.scheduler.ray_jobs import RayJobs
from tests.factories import create_job, new_key, settings_for, upload
from tests.scheduler_support import LiveServer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"

# max_seq_length 64: at 48 the chat template leaves 49 of the 64 example rows with no assistant token.
TINY = {"hyperparameters": {"max_steps": 6, "micro_batch_size": 2, "max_seq_length": 64, "learning_rate": 0.003},
        "resources": {"num_workers": 2}, "checkpoint_every_steps": 3}


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def training(**overrides) -> dict:
    t = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(t.get(key), dict):
            t[key].update(value)
        else:
            t[key] = value
    return t


class Stack:
    """API + scheduler on one Postgres database, submitting to the session's Ray head."""

    def __init__(self, url: str, storage: Path, ray_head, host: str = "127.0.0.1", **settings_overrides):
        self.port = free_port()
        self.settings = settings_for(url, storage, **{"api_url": f"http://{host}:{self.port}",
                                                      "lease_seconds": 3, "poll_seconds": 0.3, **settings_overrides})
        self.app = create_app(self.settings)
        self.server = LiveServer(self.app, port=self.port, host=host).start()
        self.http = self.server.client()
        self.ray = RayJobs(ray_head.dashboard_url)
        self.key = new_key(self.app.state.sessions)
        self.auth = {"Authorization": f"Bearer {self.key}"}
        self.train_file = upload(self.http, self.key, rows("chat.jsonl"))
        self.valid_file = upload(self.http, self.key, rows("chat-validation.jsonl"), name="valid.jsonl")
        self.scheduler = None
        self._thread = self._stop = None

    def start_scheduler(self) -> Scheduler:
        self.scheduler = Scheduler(self.app.state.sessions, self.settings, self.ray)
        self._thread, self._stop = start_in_thread(self.scheduler)
        return self.scheduler

    def stop_scheduler(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(30)
            self._stop = None

    def create(self, **training_overrides) -> str:
        return create_job(self.http, self.key, self.train_file, training(**training_overrides),
                          validation_file=self.valid_file)["id"]

    def job(self, job_id: str) -> dict:
        return self.http.get(f"/v1/fine_tuning/jobs/{job_id}", headers=self.auth).json()

    def events(self, job_id: str) -> list[dict]:
        out, after = [], None
        while True:
            params = {"limit": 100, **({"after": after} if after else {})}
            page = self.http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params, headers=self.auth).json()
            out.extend(page["data"])
            if not page["has_more"]:
                return sorted(out, key=lambda e: int(e["id"].split("-")[-1]))
            after = page["data"][-1]["id"]

    def metrics_steps(self, job_id: str, rank: int = 0) -> list[int]:
        return [e["data"]["step"] for e in self.events(job_id) if e["type"] == "metrics" and e["data"]["rank"] == rank]

    def wait(self, job_id: str, statuses: tuple[str, ...], timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if job["status"] in ("succeeded", "failed", "cancelled"):
                raise AssertionError(f"job ended {job['status']}: {job.get('error')}; events: "
                                     f"{[e['message'] for e in self.events(job_id)][-15:]}")
            time.sleep(0.5)
        raise AssertionError(f"job still {self.job(job_id)['status']} after {timeout} s; events: "
                             f"{[e['message'] for e in self.events(job_id)][-15:]}")

    def wait_until(self, predicate, timeout: float = 480, what: str = "condition", job_id: str | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if job_id is not None and self.job(job_id)["status"] in ("succeeded", "failed", "cancelled"):
                value = predicate()
                if value:
                    return value
                job = self.job(job_id)
                raise AssertionError(f"job ended {job['status']} ({job.get('error')}) while waiting for {what}; "
                                     f"events: {[e['message'] for e in self.events(job_id)][-12:]}")
            time.sleep(0.3)
        detail = ""
        if job_id is not None:
            detail = f"; job {self.job(job_id)['status']}, events: {[e['message'] for e in self.events(job_id)][-12:]}"
        raise AssertionError(f"timed out waiting for {what}{detail}")

    def results(self, job: dict) -> dict:
        """The job's results.json (the second of its result files: the first is OpenAI's metrics CSV)."""
        csv_id, json_id = job["result_files"]
        return self.http.get(f"/v1/files/{json_id}/content", headers=self.auth).json()

    def artifacts(self, job: dict) -> dict[str, str]:
        return self.results(job)["artifacts"]

    def close(self) -> None:
        self.stop_scheduler()
        self.http.close()
        self.server.stop()
        self.app.state.engine.dispose()
