"""A bounded mixed load on memfit's API, held for a minute (issue 14 item 11).

    python bench/api_mixed_load.py [--duration 60] [--sse-clients 50] [--sse-jobs 5] [--workers 1]
        [--creates CONNS:RATE] [--polls CONNS:RATE] [--lists CONNS:RATE] [--ingest CONNS:RATE] [--shared-postgres]

memfit's real API (``uvicorn --factory api.app:create_app``, no scheduler, so new jobs stay where
creation leaves them) on a throwaway Postgres database (a private server, or ``--shared-postgres``),
seeded through the API like bench/api_wrk.py.
Then, all at once for ``--duration`` seconds, each kind from its own wrk process (bench/wrk/*.lua),
with ``--<kind> CONNS:RATE`` (connections, and requests per second over all of them; rate 0 means
as fast as answers come):

- creates: ``POST /v1/fine_tuning/jobs`` on the tenant's training file, each with its own
  Idempotency-Key (create.lua);
- polls: ``GET /v1/fine_tuning/jobs/{id}`` of a random job of the tenant (poll.lua);
- lists: ``GET /v1/fine_tuning/jobs?limit=20`` (paced.lua);
- ingest: ``POST /v1/internal/jobs/{id}/ingest`` with each running job's own ingest token, one
  metrics record (one event) and two memory samples per post, round-robin over the SSE jobs
  (ingest.lua) — what keeps events flowing to
- ``--sse-clients`` Server-Sent-Events readers (this process, plain asyncio sockets) spread over
  ``--sse-jobs`` running jobs on ``GET /v1/fine_tuning/jobs/{id}/events/stream``.

It reports every status of every kind (the run fails on any 5xx or socket error), each kind's
latency percentiles and achieved rate, what the SSE clients received (each must have every event
of its job, once and in order, up to the last it saw: checked against job_events), the database
connections of the bench database sampled from pg_stat_activity once a second (min / max / last,
by state, and their course), and the API's CPU and memory. wrk's latencies are from a closed
loop: a slow answer delays the next request on its connection (no coordinated-omission correction).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import api_harness as h  # noqa: E402
from tests import pgserver  # noqa: E402


@dataclass(frozen=True)
class Load:
    connections: int
    rate: float  # requests per second over all connections; 0 = unpaced

    @classmethod
    def parse(cls, text: str) -> Load:
        try:
            conns, _, rate = text.partition(":")
            load = cls(int(conns), float(rate or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CONNECTIONS:RATE such as 4:20, got {text!r}") from None
        if load.connections < 1 or load.rate < 0:
            raise argparse.ArgumentTypeError(f"expected at least 1 connection and a rate ≥ 0, got {text!r}")
        return load

    @property
    def delay_ms(self) -> int:
        """wrk's delay() per connection that makes ``rate`` over all of them (ignoring service time)."""
        return round(1000 * self.connections / self.rate) if self.rate else 0

    def __str__(self) -> str:
        return f"{self.connections} conn, " + (f"≤ {self.rate:g}/s" if self.rate else "unpaced")


# --- SSE readers --------------------------------------------------------------------------------------


@dataclass
class SSEClient:
    job_id: str
    status: int | None = None
    ids: list[int] = field(default_factory=list)
    keepalives: int = 0
    ended: str | None = None  # "end event", "eof", or an error: why it stopped before being told to
    error: str | None = None


async def read_sse(port: int, key: str, client: SSEClient, connected: asyncio.Event) -> None:
    """One EventSource-like reader on a raw socket: HTTP/1.1, chunked body decoded, SSE ids recorded."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write((f"GET /v1/fine_tuning/jobs/{client.job_id}/events/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n").encode())
        await writer.drain()
        status_line = await reader.readline()
        client.status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        connected.set()
        if client.status != 200:
            client.error = f"status {client.status}"
            return
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        buffer = b""
        while True:
            if chunked:
                size_line = await reader.readline()
                if not size_line:
                    client.ended = "eof"
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    client.ended = "eof"
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)
            else:
                data = await reader.read(65536)
                if not data:
                    client.ended = "eof"
                    return
            buffer += data
            *messages, buffer = buffer.split(b"\n\n")
            for message in messages:
                fields = {}
                for line in message.decode().split("\n"):
                    if line.startswith(":"):
                        client.keepalives += 1
                    elif line:
                        name, _, value = line.partition(":")
                        fields[name] = value.removeprefix(" ")
                if fields.get("event") == "end":
                    client.ended = "end event"
                    return
                if "id" in fields and "data" in fields:
                    client.ids.append(int(fields["id"]))
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        client.error = f"{type(exc).__name__}: {exc}"
        connected.set()
    finally:
        writer.close()


class SSEReaders:
    """The SSE clients on an event loop in a thread of their own, stopped (disconnected) on demand."""

    def __init__(self, port: int, key: str, job_ids: list[str], clients: int):
        self.clients = [SSEClient(job_ids[i % len(job_ids)]) for i in range(clients)]
        self.port, self.key = port, key
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sse-readers", daemon=True)
        self.tasks: list[asyncio.Future] = []

    def start(self, timeout_s: float = 120) -> None:
        self.thread.start()

        async def open_all():
            events = [asyncio.Event() for _ in self.clients]
            tasks = [asyncio.ensure_future(read_sse(self.port, self.key, c, e)) for c, e in zip(self.clients, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)
            return tasks

        self.tasks = asyncio.run_coroutine_threadsafe(open_all(), self.loop).result(timeout_s + 5)

    def stop(self) -> None:
        async def cancel_all():
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.loop.close()


def check_deliveries(db_url: str, clients: list[SSEClient]) -> tuple[int, list[str]]:
    """Each client's ids must be exactly the job's event ids up to the last one it received."""
    problems = []
    complete = 0
    with pgserver.connect(h.with_application_name(db_url, "bench-check")) as conn:
        for i, c in enumerate(clients):
            if not c.ids:
                problems.append(f"client {i} ({c.job_id}): no events")
                continue
            expected = [r[0] for r in conn.execute("SELECT id FROM job_events WHERE job_id = %s AND id <= %s "
                                                   "ORDER BY id", (c.job_id, c.ids[-1]))]
            if c.ids == expected:
                complete += 1
            else:
                missing = sorted(set(expected) - set(c.ids))
                dup = len(c.ids) - len(set(c.ids))
                problems.append(f"client {i} ({c.job_id}): {len(missing)} missing, {dup} duplicated, "
                                f"{'in' if c.ids == sorted(c.ids) else 'OUT OF'} order")
    return complete, problems


# --- the run ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds the load is held (default 60)")
    ap.add_argument("--sse-clients", type=int, default=50)
    ap.add_argument("--sse-jobs", type=int, default=5, help="running jobs the SSE clients spread over")
    ap.add_argument("--creates", type=Load.parse, default=Load(2, 2), help="CONNS:RATE (default 2:2)")
    ap.add_argument("--polls", type=Load.parse, default=Load(8, 40), help="CONNS:RATE (default 8:40)")
    ap.add_argument("--lists", type=Load.parse, default=Load(4, 8), help="CONNS:RATE (default 4:8)")
    ap.add_argument("--ingest", type=Load.parse, default=Load(2, 10), help="CONNS:RATE (default 2:10)")
    ap.add_argument("--shared-postgres", action="store_true",
                    help="use the tests' Postgres (MEMFIT_TEST_PG_ADMIN, 127.0.0.1:5432) instead of a private server")
    ap.add_argument("--workers", type=int, default=1, help="uvicorn workers (default 1)")
    ap.add_argument("--jobs", type=int, default=60, help="jobs seeded for the tenant")
    args = ap.parse_args()
    h.wrk_binary()

    tmp = Path(tempfile.mkdtemp(prefix="memfit-mixedload-"))
    server = None
    try:
        with h.postgres_admin(private=not args.shared_postgres) as admin, pgserver.database(admin) as url:
            _, db, *_ = h._service()
            db.upgrade(url)
            dbname = h.database_name(url)
            print(f"Postgres: {'the tests’ server' if args.shared_postgres else 'a private server (no fsync)'} "
                  f"at {admin.split('@')[-1].split('/')[0]}, database {dbname}")
            storage = tmp / "storage"
            print(f"machine: {os.cpu_count()} CPUs, load average {_load()} (wrk, this process, the API and "
                  f"Postgres share them)")
            server = h.Server.start("memfit", "api.app:create_app", h.memfit_env(url, storage), tmp, workers=args.workers)
            print("seeding through the API:", flush=True)
            seeded = h.seed(server.url, url, storage, jobs=args.jobs, other_jobs=max(1, args.jobs // 3), steps=60)
            if len(seeded.running) < args.sse_jobs:
                raise SystemExit(f"the seed has {len(seeded.running)} running jobs, fewer than --sse-jobs {args.sse_jobs}")
            sse_jobs = seeded.running[: args.sse_jobs]
            ids_file, ingest_file = tmp / "job-ids.txt", tmp / "ingest.txt"
            ids_file.write_text("\n".join(seeded.job_ids) + "\n")
            ingest_file.write_text("".join(f"{j} {t}\n" for j, t in sse_jobs))
            auth = {"Authorization": f"Bearer {seeded.key}"}
            kinds = {
                "create": dict(script="create.lua", path="/", load=args.creates,
                               args=[seeded.file_id, f"mixed-{secrets.token_hex(4)}", str(args.creates.delay_ms)]),
                "poll": dict(script="poll.lua", path="/", load=args.polls, args=[str(ids_file), str(args.polls.delay_ms)]),
                "list": dict(script="paced.lua", path="/v1/fine_tuning/jobs?limit=20", load=args.lists,
                             args=[str(args.lists.delay_ms)]),
                "ingest": dict(script="ingest.lua", path="/", load=args.ingest,
                               args=[str(ingest_file), str(args.ingest.delay_ms), "1000"]),
            }
            print(f"mixed load for {args.duration:g} s: " + "; ".join(f"{k} {v['load']}" for k, v in kinds.items())
                  + f"; {args.sse_clients} SSE clients on {len(sse_jobs)} running jobs", flush=True)
            cpu0, rss0 = server.cpu_seconds(), server.rss_bytes()
            with h.ConnectionSampler(admin, dbname) as sampler:
                time.sleep(2)  # the idle baseline
                readers = SSEReaders(server.port, seeded.key, [j for j, _ in sse_jobs], args.sse_clients)
                readers.start()
                load0 = os.getloadavg()[0]
                t0 = time.monotonic()
                procs = {k: h.WrkProcess(k, server.url + v["path"], script=v["script"], threads=1,
                                         connections=v["load"].connections, duration_s=args.duration,
                                         headers=auth, args=v["args"]) for k, v in kinds.items()}
                try:
                    results = {k: p.result(args.duration + 120) for k, p in procs.items()}
                finally:
                    for p in procs.values():
                        p.stop()
                held_s = time.monotonic() - t0
                load1 = os.getloadavg()[0]
                time.sleep(1)  # let the last ingested events reach the streams
                readers.stop()
                time.sleep(2)  # connections after the load
            cpu1, rss1 = server.cpu_seconds(), server.rss_bytes()
            complete, problems = check_deliveries(url, readers.clients)
            bad = _report(args, results, readers.clients, complete, problems, sampler, held_s, load0, load1,
                          cpu1 - cpu0, rss0, rss1)
            if server.process.poll() is not None:
                print(f"the API exited during the run; its log:\n{server.log_tail()}")
                bad = True
            return 1 if bad else 0
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def _report(args, results: dict[str, h.WrkResult], clients: list[SSEClient], complete: int, problems: list[str],
            sampler: h.ConnectionSampler, held_s: float, load0: float, load1: float, cpu_s: float,
            rss0: int, rss1: int) -> bool:
    print()
    print("| kind | requests | req/s | p50 ms | p90 ms | p99 ms | max ms | statuses | socket errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    five_xx = 0
    failures = 0
    for kind, r in results.items():
        statuses = ", ".join(f"{c}: {n}" for c, n in sorted(r.statuses.items()))
        sock = {k: v for k, v in r.socket_errors.items() if k != "status" and v}
        five_xx += r.count(lambda c: c >= 500)
        failures += sum(sock.values())
        lat = r.latency_ms
        print(f"| {kind} | {r.requests} | {r.rps:.1f} | {lat['p50']:.1f} | {lat['p90']:.1f} | {lat['p99']:.1f} | "
              f"{lat['max']:.1f} | {statuses} | {sock or 0} |")
    sse_status = {}
    for c in clients:
        sse_status[c.status] = sse_status.get(c.status, 0) + 1
    counts = [len(c.ids) for c in clients]
    five_xx += sum(n for s, n in sse_status.items() if s is not None and s >= 500)
    early = [c for c in clients if c.ended or c.error]
    print(f"| SSE streams | {len(clients)} | – | – | – | – | – | {', '.join(f'{s}: {n}' for s, n in sse_status.items())} "
          f"| {len([c for c in clients if c.error])} |")
    print(f"\nheld {held_s:.0f} s; load average {load0:.1f} at the start, {load1:.1f} at the end ({os.cpu_count()} CPUs)")
    print(f"5xx answers: {five_xx}   socket errors: {failures}")
    print(f"SSE: {complete}/{len(clients)} clients received every event of their job once and in order "
          f"(events per client: min {min(counts)}, median {statistics.median(counts):.0f}, max {max(counts)}; "
          f"ended early: {len(early)})")
    for p in problems[:10]:
        print(f"  {p}")
    for c in early[:5]:
        print(f"  ended early on {c.job_id}: {c.ended or c.error}")
    print(f"API process: {cpu_s:.1f} CPU-s over the run ({100 * cpu_s / held_s:.0f}% of one core), "
          f"RSS {rss0 / 2**20:.0f} → {rss1 / 2**20:.0f} MiB")
    _connections(sampler, held_s)
    return bool(five_xx or failures or problems or complete != len(clients))


def _connections(sampler: h.ConnectionSampler, held_s: float) -> None:
    """min / max / last of the bench database's connections, by state, and their course every 5 s."""
    print("database connections of the bench database (pg_stat_activity, every second):")
    states = sorted({s for _, counts in sampler.samples for (_, s) in counts})
    for label, state in [("all", None), *[(s or "(no state)", s) for s in states]]:
        series = sampler.series(state=state)
        if series:
            print(f"  {label:<22} min {min(series):3d}  max {max(series):3d}  last {series[-1]:3d}")
    series = sampler.series()
    times = [t for t, _ in sampler.samples]
    course = []
    next_t = 0.0
    for t, n in zip(times, series):
        if t >= next_t:
            course.append(f"{t:.0f}s:{n}")
            next_t = t + 5
    print("  course (all): " + " ".join(course))


if __name__ == "__main__":
    sys.exit(main())
