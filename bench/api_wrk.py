"""memfit's API against a hand-written endpoint, driven by Debian's wrk (issue 15 item 4).

    python bench/api_wrk.py [--rounds 3] [--duration 10] [--connections 32] [--threads 2] [--workers 1]
                            [--profile DIR] [--whatif FIX[,FIX]] [--no-count] [--shared-postgres]

Starts, on this machine and on a throwaway Postgres database (a private server from
tests/pgserver.py, so the bench neither fills nor measures the shared one; ``--shared-postgres``
for the tests' server): memfit's real API (``uvicorn --factory api.app:create_app``, no scheduler) and the anchor,
a minimal FastAPI + SQLAlchemy app on the same database
(bench/anchor_app.py: the key looked up by prefix and checked by its sha256, the job selected by
id, two queries). It seeds a tenant with an API key and a realistic set of jobs through the real
API (bench/api_harness.py: seed), then drives, with ``wrk -t2 -c32 -d10s --latency`` and the key's
``Authorization: Bearer`` header:

- ``GET /healthz`` on memfit (the framework's floor with memfit's middleware) and on the anchor
  (bare FastAPI);
- the anchor's ``GET /v1/fine_tuning/jobs/{id}`` and memfit's, on the same succeeded job (events,
  checkpoints, memory samples, a memory summary);
- memfit's ``GET /v1/fine_tuning/jobs?limit=20``;
- with ``--whatif FIX[,FIX]`` (repeatable), memfit's GET job again on bench/whatif_app.py, the
  profile's fixes tried from the outside (cached_auth, pool40, no_middleware), and what each saves.

Each round runs every endpoint once, the order rotated from round to round, after a short warm-up
of each. It prints per endpoint the req/s, p50 and p99 (median of the rounds and their range), the
server's CPU milliseconds per request (a figure a loaded machine disturbs less than req/s), the
CPU its Postgres backends spent per request, and every status that was not 200; then the ratios issue 15 sets targets for, paired round by
round: memfit GET / anchor GET (≥ 1.5), list-20 / memfit GET (≥ 0.8), and the p99s (≤ 50 ms).

Before the rounds (unless ``--no-count``) a second memfit server, bench/counted_app.py, counts the
statements, pool checkouts and new database connections per request of each kind, alone and
under wrk. With ``--profile DIR``,
after the rounds, py-spy records memfit while wrk drives GET job and list-20 (a flame graph SVG and
a collapsed-stack file speedscope opens, per endpoint) and prints where the samples fall
(bench/profile_summary.py). wrk, the servers and this script share the machine's cores: the load
average is printed with every round. Everything started is stopped by pid; the database is dropped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import api_harness as h  # noqa: E402
from tests import pgserver  # noqa: E402

P99_TARGET_MS = 50.0
GET_TARGET = 1.5
LIST_TARGET = 0.8
MEMFIT_ROUTES = ("memfit GET job", "memfit list-20")  # the ones counted and profiled
COUNT_SECONDS = 6.0
PROFILE_RATE = 100  # py-spy samples per second (--gil: only while a thread holds the GIL, i.e. Python's CPU)


@dataclass
class Endpoint:
    name: str
    server: h.Server
    path: str
    application: str  # its pool's application_name in pg_stat_activity
    runs: list[h.WrkResult] = field(default_factory=list)
    db_cpu_ms_per_request: list[float] = field(default_factory=list)
    body_bytes: int = 0

    @property
    def url(self) -> str:
        return self.server.url + self.path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every endpoint once (default 3)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    ap.add_argument("--shared-postgres", action="store_true",
                    help="use the tests' Postgres (MEMFIT_TEST_PG_ADMIN, 127.0.0.1:5432) instead of a private server")
    ap.add_argument("--workers", type=int, default=1, help="uvicorn workers of memfit and of the anchor (default 1)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of wrk per endpoint before round 1")
    ap.add_argument("--jobs", type=int, default=120, help="jobs of the bench tenant (two more tenants get a third each)")
    ap.add_argument("--profile", type=Path, help="record py-spy flame graphs of memfit's GET and list-20 here")
    ap.add_argument("--profile-seconds", type=float, default=20.0)
    ap.add_argument("--no-count", action="store_true", help="skip the per-request statement count")
    ap.add_argument("--whatif", action="append", default=[], metavar="FIX[,FIX]",
                    help="also run memfit's GET job on bench/whatif_app.py with these fixes tried from the outside "
                         "(cached_auth, pool40, no_middleware); repeatable")
    args = ap.parse_args()
    h.wrk_binary()
    if args.profile and shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")

    tmp = Path(tempfile.mkdtemp(prefix="memfit-apibench-"))
    servers: list[h.Server] = []
    try:
        with h.postgres_admin(private=not args.shared_postgres) as admin, pgserver.database(admin) as url:
            _, db, *_ = h._service()
            db.upgrade(url)
            dbname = h.database_name(url)
            print(f"Postgres: {'the tests’ server' if args.shared_postgres else 'a private server (no fsync)'} "
                  f"at {admin.split('@')[-1].split('/')[0]}, database {dbname}")
            storage = tmp / "storage"
            print(f"machine: {os.cpu_count()} CPUs, load average {_load()} (wrk, both servers and Postgres share them)")
            print(f"starting memfit and the anchor ({args.workers} uvicorn worker(s) each)", flush=True)
            memfit = h.Server.start("memfit", "api.app:create_app", h.memfit_env(url, storage), tmp, workers=args.workers)
            servers.append(memfit)
            anchor = h.Server.start("anchor", "bench.anchor_app:create_app",
                                    {"ANCHOR_DATABASE_URL": h.with_application_name(url, "bench-anchor")}, tmp,
                                    workers=args.workers)
            servers.append(anchor)
            print("seeding through the API:", flush=True)
            seeded = h.seed(memfit.url, url, storage, jobs=args.jobs, other_jobs=max(1, args.jobs // 3))
            job_path = f"/v1/fine_tuning/jobs/{seeded.get_job_id}"
            endpoints = [
                Endpoint("healthz (memfit)", memfit, "/healthz", "bench-memfit"),
                Endpoint("healthz (bare FastAPI)", anchor, "/healthz", "bench-anchor"),
                Endpoint("anchor GET job", anchor, job_path, "bench-anchor"),
                Endpoint("memfit GET job", memfit, job_path, "bench-memfit"),
                Endpoint("memfit list-20", memfit, "/v1/fine_tuning/jobs?limit=20", "bench-memfit"),
            ]
            for variant in args.whatif:
                app_name = "bench-whatif-" + variant.replace(",", "+")
                server = h.Server.start(f"memfit[{variant}]", "bench.whatif_app:create_app",
                                        {**h.memfit_env(url, storage, app_name), "BENCH_WHATIF": variant}, tmp,
                                        workers=args.workers)
                servers.append(server)
                endpoints.append(Endpoint(f"memfit GET job [{variant}]", server, job_path, app_name))
            headers = {"Authorization": f"Bearer {seeded.key}"}
            _check_answers(endpoints, headers, len(seeded.job_ids))
            if not args.no_count:
                _count_statements(url, storage, tmp, [e for e in endpoints if e.name in MEMFIT_ROUTES], headers,
                                  servers, args)

            def drive(e: Endpoint, seconds: float) -> h.WrkResult:
                b0 = h.backend_cpu_seconds(admin, dbname, e.application)
                r = h.run_wrk(e.url, threads=args.threads, connections=args.connections, duration_s=seconds,
                              headers=headers, server=e.server)
                b1 = h.backend_cpu_seconds(admin, dbname, e.application)
                if r.requests:
                    e.db_cpu_ms_per_request.append(
                        1000 * sum(t - b0.get(pid, 0.0) for pid, t in b1.items()) / r.requests)
                return r

            print(f"warm-up: {args.warmup:g} s per endpoint", flush=True)
            for e in endpoints:
                drive(e, args.warmup)
                e.db_cpu_ms_per_request.clear()
            print(f"wrk -t{args.threads} -c{args.connections} -d{args.duration:g}s --latency, "
                  f"{args.rounds} rounds, order rotated each round", flush=True)
            for rnd in range(args.rounds):
                order = endpoints[rnd % len(endpoints):] + endpoints[: rnd % len(endpoints)]
                for e in order:
                    r = drive(e, args.duration)
                    e.runs.append(r)
                    print(f"  round {rnd + 1}  {e.name:<24} {r.rps:8.1f} req/s  p50 {r.p50:7.1f} ms  "
                          f"p99 {r.p99:7.1f} ms  cpu {r.server_cpu_ms_per_request:5.2f} ms/req  "
                          f"load {r.load_average:.1f}{_bad(r)}", flush=True)
            _report(endpoints, args)
            if args.profile:
                _profile(args, [e for e in endpoints if e.name in MEMFIT_ROUTES], headers, memfit)
            failed = any(r.errors for e in endpoints for r in e.runs)
            return 1 if failed else 0
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def _bad(r: h.WrkResult) -> str:
    other = {c: n for c, n in r.statuses.items() if c != 200}
    sock = {k: v for k, v in r.socket_errors.items() if k != "status" and v}
    return (f"  NOT 200: {other}" if other else "") + (f"  socket errors: {sock}" if sock else "")


def _check_answers(endpoints: list[Endpoint], headers: dict[str, str], tenant_jobs: int) -> None:
    """Each endpoint answers 200 with a body, and the anchor names the same job, status and tenant as memfit."""
    bodies = {}
    for e in endpoints:
        r = httpx.get(e.url, headers=headers, timeout=60)
        if r.status_code != 200:
            raise SystemExit(f"{e.name}: {e.url} answered {r.status_code}: {r.text[:500]}")
        e.body_bytes = len(r.content)
        bodies[e.name] = r.json()
    m = bodies["memfit GET job"]
    for name, body in bodies.items():
        if "GET job" in name and body != m:
            diff = sorted(k for k in set(body) | set(m) if body.get(k) != m.get(k))
            raise SystemExit(f"{name} and memfit GET job answer differently: {diff}")
    if len(bodies["memfit list-20"]["data"]) != min(20, tenant_jobs):
        raise SystemExit(f"the list returned {len(bodies['memfit list-20']['data'])} jobs, not 20")


def _count_statements(url: str, storage: Path, tmp: Path, endpoints: list[Endpoint], headers, servers, args) -> None:
    """Statements, pool checkouts and new connections per request, from bench/counted_app.py: one
    request alone (its SQL shown), then under wrk at the bench's concurrency for a few seconds."""
    counted = h.Server.start("memfit-counted", "bench.counted_app:create_app", h.memfit_env(url, storage), tmp)
    servers.append(counted)
    try:
        print("per request (bench/counted_app.py), alone and then under wrk "
              f"-c{args.connections} for {COUNT_SECONDS:g} s:")
        for e in endpoints:
            for _ in range(3):
                r = httpx.get(counted.url + e.path, headers=headers, timeout=60)
                r.raise_for_status()
            h.run_wrk(counted.url + e.path, threads=args.threads, connections=args.connections, duration_s=2,
                      headers=headers)  # the pool filled, as in the timed rounds
            httpx.get(counted.url + "/_bench/counts", timeout=60)
            h.run_wrk(counted.url + e.path, threads=args.threads, connections=args.connections,
                      duration_s=COUNT_SECONDS, headers=headers)
            t = httpx.get(counted.url + "/_bench/counts", timeout=60).json()
            n = max(1, t["requests"])
            print(f"  {e.name:<16} alone: {r.headers['x-bench-statements']} statements, "
                  f"{r.headers['x-bench-checkouts']} checkout, {r.headers['x-bench-connects']} connects; "
                  f"under load ({t['requests']} requests): {t['statements'] / n:.2f} statements, "
                  f"{t['checkouts'] / n:.2f} checkouts, {t['connects'] / n:.3f} new connections per request")
            print(f"    {r.headers['x-bench-sql']}")
    finally:
        counted.stop()
        servers.remove(counted)


def _ratio_line(name: str, nums: list[float], dens: list[float], target: float, above: bool = True) -> str:
    ratios = [n / d for n, d in zip(nums, dens) if d]
    med = statistics.median(ratios) if ratios else float("nan")
    ok = med >= target if above else med <= target
    return f"  {name:<34} {h.spread(ratios, '{:.2f}'):<22} target {'≥' if above else '≤'} {target:g}  {'PASS' if ok else 'FAIL'}"


def _report(endpoints: list[Endpoint], args) -> None:
    print()
    print("| endpoint | req/s | p50 ms | p99 ms | server CPU ms/req | DB CPU ms/req | body bytes | not 200 |")
    print("|---|---|---|---|---|---|---|---|")
    for e in endpoints:
        bad = sum(r.errors for r in e.runs)
        print(f"| {e.name} | {h.spread([r.rps for r in e.runs])} | {h.spread([r.p50 for r in e.runs], '{:.1f}')} | "
              f"{h.spread([r.p99 for r in e.runs], '{:.1f}')} | "
              f"{h.spread([r.server_cpu_ms_per_request for r in e.runs], '{:.2f}')} | "
              f"{h.spread(e.db_cpu_ms_per_request, '{:.2f}')} | "
              f"{e.body_bytes} | {bad} |")
    by = {e.name: e for e in endpoints}
    anchor, get, lst = by["anchor GET job"], by["memfit GET job"], by["memfit list-20"]
    loads = [r.load_average for e in endpoints for r in e.runs]
    print(f"\nmedian (min–max) over {args.rounds} rounds; wrk -t{args.threads} -c{args.connections} "
          f"-d{args.duration:g}s; {args.workers} worker(s); load average {min(loads):.1f}–{max(loads):.1f} "
          f"on {os.cpu_count()} CPUs")
    print("ratios (paired round by round, median (min–max)):")
    print(_ratio_line("memfit GET / anchor GET (req/s)", [r.rps for r in get.runs], [r.rps for r in anchor.runs],
                      GET_TARGET))
    print(_ratio_line("list-20 / memfit GET (req/s)", [r.rps for r in lst.runs], [r.rps for r in get.runs],
                      LIST_TARGET))
    print(_ratio_line("anchor / memfit GET (CPU ms/req)", [r.server_cpu_ms_per_request for r in anchor.runs],
                      [r.server_cpu_ms_per_request for r in get.runs], GET_TARGET))
    print(_ratio_line("memfit GET / list-20 (CPU ms/req)", [r.server_cpu_ms_per_request for r in get.runs],
                      [r.server_cpu_ms_per_request for r in lst.runs], LIST_TARGET))
    for e in endpoints:
        if e.name.startswith("memfit GET job ["):
            fix = e.name.removeprefix("memfit GET job ")
            speedup = [r.rps / g.rps for g, r in zip(get.runs, e.runs) if g.rps]
            saved = [g.server_cpu_ms_per_request - r.server_cpu_ms_per_request for g, r in zip(get.runs, e.runs)]
            vs_anchor = [r.rps / a.rps for a, r in zip(anchor.runs, e.runs) if a.rps]
            print(f"  {fix:<34} req/s × {h.spread(speedup, '{:.2f}')} of memfit GET, CPU saved "
                  f"{h.spread(saved, '{:.2f}')} ms/req, {h.spread(vs_anchor, '{:.2f}')} × the anchor")
    for e in (get, lst):
        p99 = statistics.median(r.p99 for r in e.runs)
        calm = min(e.runs, key=lambda r: r.load_average)
        print(f"  {e.name + ' p99 ms':<34} {h.spread([r.p99 for r in e.runs], '{:.1f}'):<22} target ≤ "
              f"{P99_TARGET_MS:g} ms  {'PASS' if p99 <= P99_TARGET_MS else 'FAIL'}  (least-loaded round: "
              f"{calm.p99:.1f} ms at load {calm.load_average:.1f})")


def _profile(args, endpoints: list[Endpoint], headers, memfit: h.Server) -> None:
    from bench import profile_summary

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = args.profile
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for e in endpoints:
        slug = e.name.replace("memfit ", "").replace(" ", "-")
        for fmt, ext in (("flamegraph", "svg"), ("raw", "txt")):
            path = out / f"{stamp}-{slug}.{ext}"
            target = ["--pid", str(memfit.process.pid)] + (["--subprocesses"] if args.workers > 1 else [])
            spy_proc = subprocess.Popen([spy, "record", "--gil", "--nonblocking", "--format", fmt, "-o", str(path),
                                         "--rate", str(PROFILE_RATE),
                                         "--duration", str(round(args.profile_seconds)), *target],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            time.sleep(1.0)  # py-spy attached
            try:
                r = h.run_wrk(e.url, threads=args.threads, connections=args.connections,
                              duration_s=args.profile_seconds - 2, headers=headers, server=memfit)
            finally:
                log, _ = spy_proc.communicate(timeout=args.profile_seconds + 120)
            if spy_proc.returncode != 0:
                print(f"py-spy failed ({spy_proc.returncode}): {log[-1500:]}")
                return
            print(f"profiled {e.name} ({fmt}): {r.rps:.1f} req/s under py-spy, load {r.load_average:.1f} → {path}")
            if fmt == "raw":
                print(profile_summary.summarize(path, requests=r.requests, rate=PROFILE_RATE))


if __name__ == "__main__":
    sys.exit(main())
