"""`memfit serve` start-up: process start → first ``/healthz`` 200, → first ``/readyz`` 200 (its local
Ray head up and reached by the scheduler), over a few rounds, each a fresh SQLite home.

    .venv/bin/python bench/serve_start.py [--rounds 3] [--reference /work/main/.venv/bin/memfit]

Prints each round, then the median and the spread (min–max). Target: /healthz within 3 s. With
``--reference``, that `memfit` (another checkout's) runs in alternating rounds, as a reference on the
same machine load (a serve without the Ray check in /readyz is "ready" when it answers at all).
Each round's `memfit serve` is stopped with SIGTERM, which ends the head it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from service.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
MEMFIT = Path(sys.executable).with_name("memfit")


def serve_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMFIT_", "RAY_ADDRESS"))}
    env.update({"MEMFIT_DATABASE_URL": f"sqlite:///{home / 'memfit.db'}", "MEMFIT_STORAGE_DIR": str(home / "storage"),
                "MEMFIT_PRESET_CACHE": str(home / "presets"), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    return env


def one_round(home: Path, memfit: Path = MEMFIT, deadline_s: float = 240) -> tuple[float, float, list[str]]:
    """Seconds from Popen to the first /healthz 200 and to the first /readyz 200; /readyz answers seen before."""
    port = free_port()
    log = open(home / "serve.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(memfit), "serve", "--port", str(port)], cwd=home, env=serve_env(home),
                            stdout=log, stderr=subprocess.STDOUT)
    healthy = ready = None
    early: list[str] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2) as http:
            while ready is None and time.monotonic() - t0 < deadline_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"memfit serve exited {proc.returncode}: {(home / 'serve.log').read_text()[-2000:]}")
                try:
                    if healthy is None and http.get("/healthz").status_code == 200:
                        healthy = time.monotonic() - t0
                    if healthy is not None:
                        r = http.get("/readyz")
                        if r.status_code == 200:
                            ready = time.monotonic() - t0
                        elif len(early) < 3:
                            early.append(f"{r.status_code} {r.json().get('ray')}")
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    if healthy is None or ready is None:
        raise RuntimeError(f"not ready within {deadline_s:.0f} s: {(home / 'serve.log').read_text()[-2000:]}")
    return healthy, ready, early


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference", type=Path, default=None, help="another `memfit` to alternate with")
    args = ap.parse_args()
    runs = {"this": (MEMFIT, [], [])}
    if args.reference:
        runs["reference"] = (args.reference, [], [])
    for n in range(1, args.rounds + 1):
        order = list(runs) if n % 2 else list(reversed(runs))
        for name in order:
            memfit, health, ready = runs[name]
            home = Path(tempfile.mkdtemp(prefix="memfit-serve-"))
            h, r, early = one_round(home, memfit)
            health.append(h)
            ready.append(r)
            print(f"round {n} {name:9}: /healthz {h:5.2f} s   /readyz {r:5.2f} s   (/readyz before: {early[:1]})",
                  flush=True)
    med = statistics.median
    print(f"\nmemfit serve over {args.rounds} rounds (median, min–max):")
    for name, (memfit, health, ready) in runs.items():
        print(f"  {name:9} ({memfit}):")
        print(f"    start → /healthz 200 : {med(health):5.2f} s ({min(health):.2f}–{max(health):.2f})")
        print(f"    start → /readyz 200  : {med(ready):5.2f} s ({min(ready):.2f}–{max(ready):.2f})")
    health = runs["this"][1]
    print(f"  target /healthz ≤ 3 s: {'PASS' if med(health) <= 3 else 'FAIL'} ({med(health):.2f} s)")
    if args.reference:
        print(f"  /healthz ratio this/reference: {med(health) / med(runs['reference'][1]):.2f}")


if __name__ == "__main__":
    main()
