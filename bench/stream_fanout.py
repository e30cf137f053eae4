"""SSE fan-out: 50 concurrent clients on one running job while a bounded stream of metrics is ingested.

    .venv/bin/python bench/stream_fanout.py [--clients 50] [--events 200] [--rate 20] [--db postgres|sqlite]

The API runs in its own process (uvicorn, one worker) so that its CPU use can be measured; this
process claims a job (the scheduler's claim, no Ray), opens the streams, and posts metrics records
through the ingest endpoint at ``--rate`` per second, each carrying the time it was sent. Delivery
delay = when a client parsed the event − when its record was posted. At the end the job gets its
result record, every stream must end by itself, and each client must have received every event of
the job exactly once, in order. Prints p50/p99/max delay and the API process's CPU use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    """A throwaway database: on the tests' Postgres (tests/pgserver.py: MEMFIT_TEST_PG_ADMIN, else a
    private server), dropped afterwards; or a SQLite file in ``tmp``."""
    if kind == "postgres":
        from bench.api_harness import postgres_admin
        from tests import pgserver

        with postgres_admin() as admin, pgserver.database(admin) as url:
            yield url
        return
    yield f"sqlite:///{tmp / 'bench.db'}"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def client(base: str, key: str, job_id: str, out: list, ready: asyncio.Event, started: list) -> None:
    """One EventSource-like reader: records (event id, receive time, record time) until `end`."""
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(30, read=120)) as http:
        async with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events/stream",
                               headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200, await r.aread()
            started.append(1)
            fields: dict[str, str] = {}
            async for line in r.aiter_lines():
                if line == "":
                    if "data" in fields:
                        if fields.get("event") == "end":
                            return
                        now = time.time()
                        data = json.loads(fields["data"])
                        d = data.get("data") or {}
                        out.append((int(fields["id"]), now, d.get("time"), data.get("type"), d.get("step")))
                    fields = {}
                elif line.startswith(":"):
                    continue
                else:
                    k, _, v = line.partition(":")
                    fields[k] = v[1:] if v.startswith(" ") else v


async def produce(base: str, job_id: str, token: str, n: int, rate: float, acked: dict) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        t0 = time.monotonic()
        for step in range(1, n + 1):
            await asyncio.sleep(max(0.0, t0 + (step - 1) / rate - time.monotonic()))
            now = time.time()
            records = [{"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": step, "total_steps": n,
                        "loss": 3.0 / step, "tokens_per_s": 1000.0, "step_time_s": 1 / rate}]
            records += [{"kind": "memory", "attempt": 1, "time": now, "rank": r, "step": step,
                         "parameters_bytes": 1 << 20, "activations_bytes": step << 10, "peak_bytes": 2 << 20}
                        for r in (0, 1)]
            r = await http.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": records},
                                headers={"Authorization": f"Bearer {token}"})
            r.raise_for_status()
            acked[step] = time.time()  # the records are committed: the API answered
        r = await http.post(f"/v1/internal/jobs/{job_id}/ingest", headers={"Authorization": f"Bearer {token}"},
                            json={"records": [{"kind": "result", "attempt": 1, "time": time.time(),
                                               "fine_tuned_model": "ft:bench", "artifacts": {}}]})
        r.raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--events", type=int, default=200, help="metrics records ingested (one event each)")
    ap.add_argument("--rate", type=float, default=20.0, help="records per second")
    ap.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    args = ap.parse_args()

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.scheduler.local_head import free_port
    from service.scheduler.loop import Scheduler
    from service.scheduler.ray_jobs import RayJobs
    from service.settings import Settings
    from service.store import db
    from tests.factories import create_job, new_key, upload

    tmp = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    with database(args.db, tmp) as url:
        proc = None
        try:
            db.upgrade(url)
            settings = Settings(database_url=url, storage_dir=tmp / "storage")
            setup_app = create_app(settings)
            with TestClient(setup_app) as c:
                key = new_key(setup_app.state.sessions)
                job_id = create_job(c, key, upload(c, key))["id"]
            sched = Scheduler(setup_app.state.sessions, settings, RayJobs("http://127.0.0.1:9"))
            sched.validate_pending()
            token = {j: t for j, _, t in sched.claim(limit=10)}[job_id]

            port = free_port()
            env = {**os.environ, "MEMFIT_DATABASE_URL": url, "MEMFIT_STORAGE_DIR": str(tmp / "storage"),
                   "MEMFIT_SCHEDULER_ENABLED": "false", "PYTHONPATH": str(ROOT),
                   "MEMFIT_RATE_LIMIT_ENABLED": "false"}  # --clients may open more streams than one key's burst
            proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--port", str(port),
                                     "--log-level", "warning"], env=env, cwd=ROOT)
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=2).status_code < 500:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the API did not start")
                time.sleep(0.2)
            api = psutil.Process(proc.pid)

            async def run():
                outs = [[] for _ in range(args.clients)]
                started: list = []
                ready = asyncio.Event()
                tasks = [asyncio.create_task(client(base, key, job_id, outs[i], ready, started)) for i in range(args.clients)]
                while len(started) < args.clients:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # every stream has caught up with the backlog
                me = psutil.Process()
                cpu0, mine0, t0 = sum(api.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.monotonic()
                acked: dict[int, float] = {}
                await produce(base, job_id, token, args.events, args.rate, acked)
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                cpu1, mine1, t1 = sum(api.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.monotonic()
                return outs, cpu1 - cpu0, mine1 - mine0, t1 - t0, acked

            load0 = os.getloadavg()[0]
            outs, cpu_s, bench_cpu_s, wall_s, acked = asyncio.run(run())
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as http:
                expected, after = [], None
                while True:
                    page = http.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                    params={"limit": 100, **({"after": after} if after else {})}).json()
                    expected += [int(e["id"].removeprefix("ftevent-")) for e in page["data"]]
                    if not page["has_more"]:
                        break
                    after = page["data"][-1]["id"]
            expected.sort()
            complete = sum(1 for o in outs if [i for i, *_ in o] == expected)
            delays = [(recv - sent) * 1000 for o in outs for _, recv, sent, kind, _ in o if kind == "metrics" and sent]
            after_commit = [(recv - acked[step]) * 1000 for o in outs for _, recv, _, kind, step in o
                            if kind == "metrics" and step in acked]
            print(f"clients: {args.clients}   metrics events ingested: {args.events} at {args.rate:g}/s   db: {args.db}")
            print(f"every event, once, in order: {complete}/{args.clients} clients "
                  f"({len(expected)} events each, {sum(len(o) for o in outs)} deliveries)")
            print(f"delivery delay (ms): p50 {percentile(delays, 0.5):.0f}   p99 {percentile(delays, 0.99):.0f}   "
                  f"max {max(delays):.0f}   mean {statistics.mean(delays):.0f}   (target p99 < 500)")
            print(f"  from the ingest POST's answer (commit) to the client (ms): p50 {percentile(after_commit, 0.5):.0f}   "
                  f"p99 {percentile(after_commit, 0.99):.0f}   (negative: the stream beat the POST's response)")
            print(f"API process CPU: {cpu_s:.2f} s over {wall_s:.1f} s wall = {100 * cpu_s / wall_s:.0f}% of one core "
                  f"({os.cpu_count()} cores on this machine); the 50 clients + producer used {bench_cpu_s:.2f} s")
            print(f"machine load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
                  f"(other processes share these cores; delays grow with load)")
            if complete != args.clients:
                raise SystemExit("some clients missed or duplicated events")
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
