"""bench/gpu_check.py's dry run: every config of the GPU check through the same code on a tiny Llama on
CPU — the workers' setup and step, the service's plan, the telemetry, the OOM record completed by
service/memory/oom.py — so that what can break without a GPU breaks here. (No GPU was lent to check the
CUDA half; the README says so.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # trains on gloo processes: not in `make test-fast`
ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MEMFIT_PRESET_CACHE": str(tmp_path / "presets")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--steps", "3",
                           "--json", str(out), "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    from bench.gpu_check import CONFIGS

    assert set(rows) == set(CONFIGS) and not any(r.get("crash") for r in rows.values())
    assert "needs CUDA" in rows["fp16"]["skipped"] and not rows["qlora"].get("skipped")  # QLoRA runs on CPU
    trained = [r for n, r in rows.items() if not r.get("skipped") and n not in ("oom", "steps")]
    # every config that does not need CUDA trained, the scale configs among them (on the tiny Llama here)
    assert sorted(r["config"] for r in trained) == sorted(
        n for n, (_, cuda) in CONFIGS.items() if not cuda and n not in ("oom", "steps"))
    assert {"scale-8b-2l", "scale-70b-1l"} <= {r["config"] for r in trained}
    # every step against the plan of its own micro-batch (rows of other lengths, padded and masked)
    steps = rows["steps"]["steps"]
    assert len(steps) >= 6 and len({tuple(s["rows"]) for s in steps}) >= 5
    assert all(abs(s["error"]) < 0.01 for s in steps), steps
    for r in trained:  # the exact live-tensor peak against the plan, on a model too small to be precise
        assert r["allocated_bytes"] > 0 and r["predicted_live_bytes"] > 0
        assert abs(r["predicted_live_bytes"] / r["allocated_bytes"] - 1) < 0.15, r
    assert rows["chunked-loss"]["allocated_bytes"] < rows["full-bf16"]["allocated_bytes"]
    oom = rows["oom"]["oom"]  # the worker's record, completed as a job's (service/memory/oom.py)
    assert oom["code"] == "out_of_memory" and oom["dominant_category"] and oom["suggestions"]
    assert Path(oom["record"]).name == "failure-rank0.json"
    assert "| config" not in proc.stdout and "pred live" in proc.stdout  # the printed table
