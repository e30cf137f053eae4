"""What memfit adds around a training run: POST → first training step, last step → succeeded.

On one warm local Ray head, the same tiny job is run in alternating rounds (the order swaps each
round, so a drift in the machine's load falls on both alike)
  (a) through memfit: POST /v1/fine_tuning/jobs over HTTP → scheduler (claim, validate, submit via
      the Jobs API) → Ray job → metrics posted back → ``succeeded`` written by ingest;
  (b) directly: the identical entrypoint (``python -m workers.run REQUEST.json``, same env_vars,
      ``service/`` and ``workers/`` as ``py_modules`` folders, same spec and files, metrics to JSON
      lines only) submitted with the Ray Jobs client, as ``ray job submit --py-modules`` does.
Timestamps: a step's time is the one the Ray Train controller stamped on its record (same host
clock); memfit's end is the job's ``finished_at``; the direct run's end is Ray's job ``end_time``.
Each run starts on an idle cluster: no Ray job running and no actor left but Ray's autoscaling
coordinator (memfit marks a job succeeded before its Ray driver has exited, so without the wait the
next run would start beside that teardown). Each side's start is also split at Ray's own
submission time (the job's ``start_time``): POST → submitted is memfit's own part; submitted →
first step is Ray's, the same entrypoint on both sides.

    .venv/bin/python bench/job_latency.py [--runs 3] [--steps 5]

Prints each round, the median and spread (min–max) of each, memfit's added seconds, each round's ratio
(memfit / direct within the round) and their median, PASS/FAIL of that median against 1.02, the same
split at Ray's submission (memfit's own part, and Ray's part of each side with its paired ratio), the
seconds each run waited for an idle cluster, and where memfit's start went in the first measured round
(its job events, relative to the POST).

It also prints the CPU seconds each side spent, POST/submit to the end of the run: this process's own
(on memfit's side the API, the scheduler and the ingest of the run's reports, which all run here, plus
the polling client; on the direct side the Jobs client polling Ray) and the whole machine's. Ray Train's
start-up varies by seconds from run to run on 2 cores, so the time ratio moves by ±10% between runs of
the bench; what memfit itself costs is the difference in CPU, which that variance does not hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from service.scheduler.local_head import LocalRayHead  # noqa: E402

DATA = ROOT / "examples" / "data"


def job_body(train_id: str, steps: int) -> dict:
    return {
        "model": "preset:tiny-llama",
        "training_file": train_id,
        "training": {
            "strategy": "ddp",
            "peft": {"method": "lora", "r": 8},
            "hyperparameters": {"max_steps": steps, "micro_batch_size": 2, "max_seq_length": 48},
            "resources": {"num_workers": 2},
            "checkpoint_every_steps": steps,
        },
    }


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this process (all its threads) and by the whole machine."""
    me, machine = psutil.Process().cpu_times(), psutil.cpu_times()
    return me.user + me.system, machine.user + machine.system + machine.nice


def run_memfit(http: httpx.Client, ray, train_id: str, steps: int) -> tuple[float, float, float, str, list[tuple[float, str]]]:
    """POST → first step, Ray's submission → first step, last step → succeeded (seconds), the job id and
    where its start went (its events)."""
    t_post = time.time()
    job = http.post("/v1/fine_tuning/jobs", json=job_body(train_id, steps)).json()
    job_id = job["id"]
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)
        job = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    if job["status"] != "succeeded":
        raise RuntimeError(f"memfit job {job_id} ended {job['status']}: {job.get('error')}")
    events = http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    times = sorted(e["data"]["time"] for e in events if e["type"] == "metrics" and e["data"].get("rank") == 0)
    # finished_at is whole seconds in the public job; take the exact value from the success event.
    done = next(e for e in events if e["message"] == "The job has successfully completed")
    finished = _exact_finish(http, job_id) or float(done["created_at"])
    phases = _event_times(http, job_id, t_post)
    phases.append((times[0] - t_post, "first training step (rank 0)"))
    from service.scheduler.paths import submission_id

    ray_start = times[0] - ray.client.get_job_info(submission_id(job_id, 1)).start_time / 1000.0
    return times[0] - t_post, ray_start, finished - times[-1], job_id, sorted(phases)


def _exact_finish(http: httpx.Client, job_id: str) -> float | None:
    from sqlalchemy import select

    from service.store.models import Job

    with http.app_sessions() as s:  # type: ignore[attr-defined]
        finished = s.scalar(select(Job.finished_at).where(Job.id == job_id))
    return finished.timestamp() if finished else None


def _event_times(http: httpx.Client, job_id: str, t_post: float) -> list[tuple[float, str]]:
    """The job's message events, at their exact times from the database (the public ones are whole seconds)."""
    from datetime import timezone

    from sqlalchemy import select

    from service.store.models import JobEvent

    with http.app_sessions() as s:  # type: ignore[attr-defined]
        rows = s.execute(select(JobEvent.created_at, JobEvent.message)
                         .where(JobEvent.job_id == job_id, JobEvent.type == "message")).all()
    return [((at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp() - t_post, message)
            for at, message in rows]


# The direct runs ship a copy of the code taken at the start (memfit's scheduler hashes it once at its
# first submission): an edit to the checkout while the bench runs changes neither side's package.
CODE_SNAPSHOT: list[Path] = []


def snapshot_code(work: Path) -> None:
    import shutil

    from service.scheduler.ray_jobs import _code_dirs

    for src in _code_dirs():
        dst = work / "code" / src.name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        CODE_SNAPSHOT.append(dst)


def wait_idle(ray, timeout_s: float = 90.0) -> float:
    """Wait until the cluster is as a new run would find it: every Ray job ended (memfit marks a job
    succeeded when its result arrives, before its Ray driver has exited) and no actor left but Ray's
    own coordinator. Returns the seconds waited."""
    from ray.util.state import list_actors

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        jobs_running = [j for j in ray.client.list_jobs() if not j.status.is_terminal()]
        alive = list_actors(address=ray.address, filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
        actors = [a for a in alive if a.class_name != "_AutoscalingCoordinatorActor"]
        if not jobs_running and not actors:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"the cluster is still busy after {timeout_s:.0f} s: jobs {jobs_running}, actors {actors}")


def run_direct(ray, request: dict, work: Path, n: int) -> tuple[float, float, float]:
    """The same entrypoint and runtime_env, submitted straight to the Jobs API."""
    out = work / f"direct-{n}"
    out.mkdir(parents=True)
    req = dict(request, job_id=f"direct-{n}-{int(time.time())}", attempt=1, output_dir=str(out),
               ingest_url=None, ingest_token=None, metrics_path=str(out / "metrics.jsonl"))
    path = out / "request.json"
    path.write_text(json.dumps(req))
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "RAY_AUTH_MODE": ray.auth_mode, "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    sid = f"direct-{n}-{int(time.time() * 1000)}"
    from service.scheduler.ray_jobs import CODE_EXCLUDES

    runtime_env = {"env_vars": env, "py_modules": [str(p) for p in CODE_SNAPSHOT], "excludes": CODE_EXCLUDES}
    t_submit = time.time()
    ray.client.submit_job(entrypoint=f"{ray.python} -m workers.run {path}", submission_id=sid,
                          runtime_env=runtime_env, entrypoint_num_cpus=ray.entrypoint_num_cpus)
    while True:
        st = ray.status(sid)
        if st and st.status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(0.1)
    if st.status != "SUCCEEDED":
        raise RuntimeError(f"direct run {sid} ended {st.status}: {st.message}\n" + "\n".join(ray.log_tail(sid)))
    info = ray.client.get_job_info(sid)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["time"] for r in records if r.get("kind") == "metrics" and r.get("rank") == 0)
    return times[0] - t_submit, times[0] - info.start_time / 1000.0, info.end_time / 1000.0 - times[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    from service.cli.embedded import EmbeddedService, quiet_logging
    from service.settings import Settings
    from service.store.auth import create_key
    from service.store.db import session_scope

    work = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    snapshot_code(work)
    quiet_logging(work / "bench.log")
    t0 = time.time()
    head = LocalRayHead(num_cpus=8, log_path=work / "ray-head.log").start()
    print(f"local Ray head up in {time.time() - t0:.1f} s ({head.dashboard_url})", flush=True)
    settings = Settings(database_url=f"sqlite:///{work}/memfit.db", storage_dir=work / "storage",
                        ray_address=head.dashboard_url, poll_seconds=0.2)
    service = EmbeddedService(settings).start()
    try:
        with session_scope(service.app.state.sessions) as s:
            key = create_key(s, "bench").key
        http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        http.app_sessions = service.app.state.sessions  # type: ignore[attr-defined]
        with (DATA / "chat.jsonl").open("rb") as f:
            train_id = http.post("/v1/files", files={"file": ("chat.jsonl", f)}, data={"purpose": "fine-tune"}).json()["id"]

        print("warm-up run (not measured) …", flush=True)
        ray = service.scheduler.ray
        _, _, _, warm_id, _ = run_memfit(http, ray, train_id, args.steps)
        from service.scheduler.paths import request_path

        request = json.loads(request_path(settings, warm_id, 1).read_text())
        wait_idle(ray)
        run_direct(ray, request, work, 0)

        memfit_start, memfit_end, direct_start, direct_end = [], [], [], []
        memfit_ray, direct_ray, waited = [], [], []
        memfit_cpu: list[tuple[float, float]] = []
        direct_cpu: list[tuple[float, float]] = []
        first_phases = None
        for n in range(1, args.runs + 1):
            def memfit_run():
                waited.append(wait_idle(ray))
                before = cpu_seconds()
                s, rs, e, _, phases = run_memfit(http, ray, train_id, args.steps)
                memfit_ray.append(rs)
                memfit_cpu.append(tuple(b - a for a, b in zip(before, cpu_seconds())))
                memfit_start.append(s)
                memfit_end.append(e)
                return phases

            def direct_run():
                waited.append(wait_idle(ray))
                before = cpu_seconds()
                ds, drs, de = run_direct(ray, request, work, n)
                direct_ray.append(drs)
                direct_cpu.append(tuple(b - a for a, b in zip(before, cpu_seconds())))
                direct_start.append(ds)
                direct_end.append(de)

            if n % 2:
                phases = memfit_run()
                direct_run()
            else:
                direct_run()
                phases = memfit_run()
            first_phases = first_phases or phases
            print(f"round {n} ({'memfit first' if n % 2 else 'direct first'}): memfit start {memfit_start[-1]:6.2f} s "
                  f"(Ray {memfit_ray[-1]:5.2f}) "
                  f"end {memfit_end[-1]:5.2f} s | direct start {direct_start[-1]:6.2f} s (Ray {direct_ray[-1]:5.2f}) end {direct_end[-1]:5.2f} s | "
                  f"CPU s (this process / machine): memfit {memfit_cpu[-1][0]:.2f} / {memfit_cpu[-1][1]:.1f}, "
                  f"direct {direct_cpu[-1][0]:.2f} / {direct_cpu[-1][1]:.1f}", flush=True)

        med = statistics.median

        def spread(xs):
            return f"{min(xs):.2f}–{max(xs):.2f}"

        ms, me, ds, de = med(memfit_start), med(memfit_end), med(direct_start), med(direct_end)
        # each round's two runs follow one another (the order alternating), so a ratio within a round cancels
        # what drifts between rounds (the machine's load, Ray's caches); the median of those is the figure
        paired = [m / d for m, d in zip(memfit_start, direct_start)]
        ratio = med(paired)
        print()
        print(f"median (min–max) over {args.runs} alternating rounds ({args.steps} steps, tiny-llama LoRA, "
              f"ddp × 2 CPU workers):")
        print(f"  POST/submit → first training step : memfit {ms:6.2f} s ({spread(memfit_start)})   direct Jobs API "
              f"{ds:6.2f} s ({spread(direct_start)})   memfit adds {ms - ds:+.2f} s (ratio of medians {ms / ds:.3f})")
        print(f"  paired ratio per round (memfit / direct, same round): median {ratio:.3f} ({spread(paired)}); "
              f"rounds {', '.join(f'{r:.3f}' for r in paired)}")
        ray_paired = [m / d for m, d in zip(memfit_ray, direct_ray)]
        own = [t - r for t, r in zip(memfit_start, memfit_ray)]
        print(f"  Ray's submission → first step     : memfit {med(memfit_ray):6.2f} s ({spread(memfit_ray)})   direct "
              f"{med(direct_ray):6.2f} s ({spread(direct_ray)}); paired ratio median {med(ray_paired):.3f} "
              f"({spread(ray_paired)})")
        print(f"  POST → Ray's submission (memfit's own part): median {med(own):.2f} s ({spread(own)}); "
              f"before each run the cluster was idle after {med(waited):.1f} s ({spread(waited)})")
        print(f"  last step → succeeded             : memfit {me:6.2f} s ({spread(memfit_end)})   direct Jobs API "
              f"{de:6.2f} s ({spread(direct_end)})   memfit adds {me - de:+.2f} s")
        print(f"  job start target ≤ 1.02 × direct: {'PASS' if ratio <= 1.02 else 'FAIL'} (median paired ratio {ratio:.3f})")
        own_m, own_d = [c[0] for c in memfit_cpu], [c[0] for c in direct_cpu]
        all_m, all_d = [c[1] for c in memfit_cpu], [c[1] for c in direct_cpu]
        print(f"  CPU s, this process (memfit: API + scheduler + ingest + client; direct: Jobs client): memfit "
              f"{med(own_m):.2f} ({spread(own_m)})   direct {med(own_d):.2f} ({spread(own_d)})   "
              f"memfit adds {med(own_m) - med(own_d):+.2f} s")
        print(f"  CPU s, whole machine, POST/submit → end of run: memfit {med(all_m):.1f} ({spread(all_m)})   "
              f"direct {med(all_d):.1f} ({spread(all_d)})   memfit adds {med(all_m) - med(all_d):+.1f} s")
        print("\nwhere memfit's start went (round 1, seconds after the POST):")
        for at, what in first_phases:
            print(f"  {at:7.2f}  {what}")
    finally:
        service.stop()
        head.stop(timeout_s=10)


if __name__ == "__main__":
    main()
