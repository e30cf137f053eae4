"""API load from Python clients: memfit on Postgres under 32 concurrent httpx clients.

Starts `uvicorn --factory api.app:create_app` in a subprocess on a throwaway Postgres database,
then drives it with concurrent httpx clients, a bounded number of requests per kind, and prints
requests/s and p50/p99 latency for job create, get and list, and the error count.

    .venv/bin/python bench/api_load.py [--requests 2000] [--concurrency 32] [--workers 1]

The server's own figures come from bench/api_wrk.py (wrk, against a hand-written anchor) and
bench/api_mixed_load.py (creates, polls, lists, ingest and SSE at once): here the clients are Python
on the same cores, so this measures what a Python SDK user sees, client cost included, and a fixed
number of creates at full concurrency. The database is made on the tests' Postgres
(tests/pgserver.py: MEMFIT_TEST_PG_ADMIN, else a private server) and dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_harness import postgres_admin  # noqa: E402
from service.scheduler.local_head import free_port  # noqa: E402
from service.store import auth, db  # noqa: E402
from tests import pgserver  # noqa: E402

DATA = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 20


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def drive(name, make_request, total, concurrency, client):
    latencies: list[float] = []
    errors = 0
    kinds: dict[str, int] = {}
    counter = iter(range(total))

    async def worker():
        nonlocal errors
        for i in counter:
            t0 = time.perf_counter()
            try:
                r = await make_request(client, i)
                ok, kind = r.status_code == 200, str(r.status_code)
            except httpx.HTTPError as exc:
                ok, kind = False, type(exc).__name__
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors += 1
                kinds[kind] = kinds.get(kind, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    print(f"{name:<7} {total:>6} req  {total / wall:8.1f} req/s  p50 {percentile(latencies, 0.5) * 1000:7.1f} ms  "
          f"p99 {percentile(latencies, 0.99) * 1000:7.1f} ms  errors {errors}{' ' + str(kinds) if kinds else ''}",
          flush=True)
    return errors


async def run(base: str, key: str, requests: int, concurrency: int) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as client:
        r = await client.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(DATA))}, data={"purpose": "fine-tune"})
        r.raise_for_status()
        file_id = r.json()["id"]
        job_ids: list[str] = []

        async def create(c, i):
            r = await c.post("/v1/fine_tuning/jobs", json={
                "model": "preset:tiny-llama", "training_file": file_id, "metadata": {"i": str(i)},
                "training": {"peft": {"method": "lora"}, "hyperparameters": {"max_steps": 10}}})
            if r.status_code == 200:
                job_ids.append(r.json()["id"])
            return r

        async def get(c, i):
            return await c.get(f"/v1/fine_tuning/jobs/{random.choice(job_ids)}")

        async def listing(c, i):
            return await c.get("/v1/fine_tuning/jobs", params={"limit": 20})

        # warm-up: connections, caches, the server's thread pool
        await asyncio.gather(*(client.get("/healthz") for _ in range(concurrency)))
        errors = await drive("create", create, requests, concurrency, client)
        errors += await drive("get", get, requests, concurrency, client)
        errors += await drive("list", listing, requests, concurrency, client)
        return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per kind (create, get, list)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    args = ap.parse_args()

    with postgres_admin() as admin, pgserver.database(admin) as url:
        return _bench(url, args)


def _bench(url: str, args) -> int:
    server = None
    try:
        db.upgrade(url)
        engine = db.make_engine(url)
        with db.session_scope(db.make_sessionmaker(engine)) as s:
            key = auth.create_key(s, "bench").key
        engine.dispose()
        port = free_port()
        storage = tempfile.mkdtemp(prefix="memfit-bench-")
        env = {**os.environ, "MEMFIT_DATABASE_URL": url, "MEMFIT_STORAGE_DIR": storage, "PYTHONPATH": str(ROOT),
               "MEMFIT_RATE_LIMIT_ENABLED": "false", "MEMFIT_QUOTA_QUEUED_JOBS": "0"}  # the bench measures the API, not its limits
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--host", "127.0.0.1",
             "--port", str(port), "--workers", str(args.workers), "--log-level", "warning", "--no-access-log",
             "--timeout-keep-alive", "75"],
            cwd=ROOT, env=env,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.2)
        print(f"load average before: {os.getloadavg()[0]:.1f}")
        print(f"memfit API on Postgres: {args.concurrency} concurrent clients, {args.requests} requests per kind, "
              f"{args.workers} uvicorn worker(s), {os.cpu_count()} CPUs (client and server share them)", flush=True)
        errors = asyncio.run(run(base, key, args.requests, args.concurrency))
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        return 1 if errors else 0
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    sys.exit(main())
