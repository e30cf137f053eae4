"""Cost that does not grow with the job's length: a synthetic long job through the real ingest endpoint.

One uvicorn memfit server on a private Postgres (bench/api_harness.py). Two jobs of the same tenant
are claimed by the scheduler's own claim (their ingest tokens; no Ray is reached):

- the *reference* job gets 1 000 steps × 8 ranks at the start;
- the *long* job gets up to ``--steps`` steps × 8 ranks (default 100 000), each step one memory sample
  and one metrics record per rank, posted to POST /v1/internal/jobs/{id}/ingest with the job's token
  in batches of ``--batch`` records (the workers' sink sends 200; bigger batches only cut the HTTP
  round trips of the bench, each batch is still one ingest transaction).

At 1 000, 10 000 and 100 000 steps (those ≤ --steps) the bench measures, alternating between the two
jobs request by request so the shared machine's noise falls on both alike: GET …/memory and the job
page (GET /ui/jobs/{id}, the HTML with its embedded chart data) — median of ``--rounds`` requests each
— and prints the long job's time over the reference job's. It also prints the rows and bytes the
tables hold (pg_total_relation_size, indexes and TOAST included) and the ingest rate of each stretch.
PASS when the long job's GET …/memory and page stay within 2× of the reference's at every point.

    .venv/bin/python bench/long_job.py [--steps 100000] [--ranks 8] [--batch 2000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from bench import api_harness as h  # noqa: E402
from tests import pgserver  # noqa: E402

REFERENCE_STEPS = 1_000
CHECKPOINTS = (1_000, 10_000, 100_000)
TABLES = ("memory_samples", "job_events", "series_rollups", "series_heads")
LIMIT = 2.0


def records(step: int, ranks: int, total: int, now: float) -> list[dict]:
    """One step of every rank: a memory sample (a traced step's peak every 10th step) and its metrics."""
    out = []
    for rank in range(ranks):
        traced = step % 10 == 0
        out.append({"kind": "memory", "attempt": 1, "time": now, "rank": rank, "step": step,
                    "source": "profiler" if traced else "counters",
                    "parameters_bytes": 1 << 28, "gradients_bytes": 1 << 26, "optimizer_bytes": 1 << 27,
                    "activations_bytes": ((step * 7 + rank) % 13 + 1) << 22 if traced else None,
                    "temporary_bytes": 1 << 20 if traced else None,
                    "peak_bytes": (3 << 28) + (((step * 31 + rank) % 97) << 20) if traced else None,
                    "process_rss_bytes": (2 << 30) + (step % 11 << 20)})
        out.append({"kind": "metrics", "attempt": 1, "time": now, "rank": rank, "step": step, "total_steps": total,
                    "loss": 3.0 / (1 + step / 1000), "learning_rate": 1e-4, "grad_norm": 1.1,
                    "tokens_per_s": 1200.0 + step % 17, "trained_tokens": 512 * step, "step_time_s": 0.4})
    return out


def ingest(http: httpx.Client, job_id: str, token: str, start: int, stop: int, *, ranks: int, total: int,
           batch: int) -> int:
    """Post steps start..stop-1 of every rank; returns the records posted."""
    sent, pending = 0, []
    headers = {"Authorization": f"Bearer {token}"}

    def flush():
        nonlocal sent, pending
        r = http.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": pending}, headers=headers)
        r.raise_for_status()
        sent += len(pending)
        pending = []

    for step in range(start, stop):
        pending += records(step, ranks, total, time.time())
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    return sent


def measure(http: httpx.Client, key: str, jobs: dict[str, str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """{job name: {"memory": [s…], "page": [s…]}}, one request of each kind per job per round, alternating."""
    out = {name: {"memory": [], "page": []} for name in jobs}
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(rounds):
        for name, job_id in jobs.items():
            t = time.perf_counter()
            r = http.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=auth)
            out[name]["memory"].append(time.perf_counter() - t)
            r.raise_for_status()
            t = time.perf_counter()
            r = http.get(f"/ui/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
            out[name]["page"].append(time.perf_counter() - t)
            r.raise_for_status()
    return out


def stored(engine) -> dict[str, tuple[int, int]]:
    with engine.connect() as conn:
        return {t: (conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one(),
                    conn.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar_one()) for t in TABLES}


def claim_two(url: str, storage: Path, base_url: str) -> tuple[str, list[tuple[str, str]]]:
    """A tenant key and two running jobs (id, ingest token) of it, through the API and the scheduler's claim."""
    auth, db, RayJobs, Scheduler, Settings = h._service()
    settings = Settings(database_url=url, storage_dir=storage, quota_running_jobs=0)
    engine = db.make_engine(url, pool_size=2)
    sessions = db.make_sessionmaker(engine)
    try:
        with db.session_scope(sessions) as s:
            key = auth.create_key(s, "bench-long").key
        with httpx.Client(base_url=base_url, timeout=120) as http:
            file_id = h._upload(http, key, rows=64)
            ids = []
            for i in range(2):
                r = http.post("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"},
                              json=h.create_body(file_id, i))
                r.raise_for_status()
                ids.append(r.json()["id"])
        scheduler = Scheduler(sessions, settings, RayJobs("http://127.0.0.1:9"))
        h._validate_all(scheduler)
        tokens = {}
        while won := scheduler.claim(limit=10):
            tokens.update({job_id: token for job_id, _, token in won})
        return key, [(jid, tokens[jid]) for jid in ids]
    finally:
        engine.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2000, help="records per ingest request (≤ 5000)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    points = [c for c in CHECKPOINTS if c <= args.steps] or [args.steps]
    t_start = time.monotonic()
    with h.postgres_admin(private=True) as admin, pgserver.database(admin) as url, \
            tempfile.TemporaryDirectory(prefix="memfit-long-") as tmp:
        from service.store import db

        db.upgrade(url)
        storage = Path(tmp) / "storage"
        server = h.Server.start("memfit", "api.app:create_app", h.memfit_env(url, storage), Path(tmp))
        engine = create_engine(db.normalize_url(url))
        results = []
        try:
            key, ((ref_id, ref_token), (long_id, long_token)) = claim_two(url, storage, server.url)
            with httpx.Client(base_url=server.url, timeout=600) as http:
                ingest(http, ref_id, ref_token, 1, REFERENCE_STEPS + 1, ranks=args.ranks, total=REFERENCE_STEPS,
                       batch=args.batch)
                done = 1
                for point in points:
                    t = time.monotonic()
                    n = ingest(http, long_id, long_token, done, point + 1, ranks=args.ranks, total=args.steps,
                               batch=args.batch)
                    rate = n / (time.monotonic() - t)
                    done = point + 1
                    m = measure(http, key, {"reference": ref_id, "long": long_id}, args.rounds)
                    row = {"steps": point, "rate": rate, "stored": stored(engine)}
                    for kind in ("memory", "page"):
                        long_s, ref_s = m["long"][kind], m["reference"][kind]
                        row[kind] = (statistics.median(long_s), statistics.median(ref_s), min(long_s), max(long_s))
                    row["memory_bytes"] = len(http.get(f"/v1/fine_tuning/jobs/{long_id}/memory",
                                                       headers={"Authorization": f"Bearer {key}"}).content)
                    row["page_bytes"] = len(http.get(f"/ui/jobs/{long_id}", headers={"Authorization": f"Bearer {key}"}).content)
                    results.append(row)
                    print(f"{point:>7} steps × {args.ranks} ranks: ingest {rate:,.0f} records/s; "
                          f"GET …/memory {row['memory'][0] * 1e3:.1f} ms (reference {row['memory'][1] * 1e3:.1f} ms, "
                          f"{row['memory_bytes'] / 1024:.0f} KiB), page {row['page'][0] * 1e3:.1f} ms "
                          f"(reference {row['page'][1] * 1e3:.1f} ms, {row['page_bytes'] / 1024:.0f} KiB)", flush=True)
                    for t_name, (rows, size) in row["stored"].items():
                        print(f"          {t_name:<15} {rows:>10,} rows {size / 2**20:>9.1f} MiB")
        finally:
            engine.dispose()
            server.stop()
    print(f"\n{args.ranks} ranks, batches of {args.batch} records, {args.rounds} rounds per point, "
          f"{time.monotonic() - t_start:.0f} s in all. Times: median (min–max) of the long job; ratio = "
          "long job's median / the 1 000-step reference job's median, measured alternately in the same rounds.")
    print(f"{'steps':>8} {'ingest rec/s':>13} {'memory ms':>22} {'ratio':>6} {'page ms':>22} {'ratio':>6}")
    ok = True
    first = results[0]
    for r in results:
        mem_ratio, page_ratio = r["memory"][0] / r["memory"][1], r["page"][0] / r["page"][1]
        ok &= mem_ratio <= LIMIT and page_ratio <= LIMIT
        print(f"{r['steps']:>8} {r['rate']:>13,.0f} "
              f"{h.spread([r['memory'][0] * 1e3, r['memory'][2] * 1e3, r['memory'][3] * 1e3], '{:.1f}'):>22} {mem_ratio:>6.2f} "
              f"{h.spread([r['page'][0] * 1e3, r['page'][2] * 1e3, r['page'][3] * 1e3], '{:.1f}'):>22} {page_ratio:>6.2f}")
    for r in results[1:]:
        print(f"{r['steps']:,} steps over {first['steps']:,}: GET …/memory "
              f"{r['memory'][0] / first['memory'][0]:.2f}×, page {r['page'][0] / first['page'][0]:.2f}× "
              f"(the long job against itself at {first['steps']:,}, not alternated)")
    print(("PASS" if ok else "FAIL") + f": the long job's GET …/memory and page within {LIMIT:.0f}× of the "
          "1 000-step job's at every point")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
