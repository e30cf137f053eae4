"""What one Ray Jobs submission costs the scheduler: the Jobs client given the code folders as paths
(it zips and hashes ``service/`` and ``workers/`` on every call) against memfit's package-once URIs
(hashed once per process; one existence check per package per submission).

    .venv/bin/python bench/submit_cost.py [--rounds 10]

Alternating rounds on one local head; the entrypoint is ``true`` so only the submission is timed.
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

from service.scheduler.local_head import LocalRayHead  # noqa: E402
from service.scheduler.ray_jobs import CODE_EXCLUDES, RayJobs, _code_dirs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memfit-submit-"))
    head = LocalRayHead(num_cpus=2, log_path=work / "ray-head.log").start()
    try:
        ray = RayJobs(head.dashboard_url)
        paths_env = {"py_modules": [str(p) for p in _code_dirs()], "excludes": CODE_EXCLUDES, "env_vars": {}}
        t0 = time.perf_counter()
        ray.submit("warm-uri", "true", {}, {})  # the first call hashes and uploads
        first = time.perf_counter() - t0
        ray.client.submit_job(entrypoint="true", submission_id="warm-paths", runtime_env=paths_env,
                              entrypoint_num_cpus=0.1)
        by_paths, by_uri = [], []
        for n in range(args.rounds):
            t0 = time.perf_counter()
            ray.client.submit_job(entrypoint="true", submission_id=f"paths-{n}", runtime_env=paths_env,
                                  entrypoint_num_cpus=0.1)
            by_paths.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.submit(f"uri-{n}", "true", {}, {})
            by_uri.append(time.perf_counter() - t0)
        med = statistics.median
        print(f"first memfit submission (hash + upload): {first * 1000:.0f} ms")
        print(f"submit_job over {args.rounds} alternating rounds (median, min–max):")
        print(f"  code as paths (Jobs client zips+hashes each time): {med(by_paths) * 1000:6.1f} ms "
              f"({min(by_paths) * 1000:.0f}–{max(by_paths) * 1000:.0f})")
        print(f"  memfit package-once URIs                         : {med(by_uri) * 1000:6.1f} ms "
              f"({min(by_uri) * 1000:.0f}–{max(by_uri) * 1000:.0f})")
        print(f"  ratio {med(by_uri) / med(by_paths):.2f}")
    finally:
        head.stop(timeout_s=10)


if __name__ == "__main__":
    main()
