"""The README's main command, as a user runs it: `memfit run examples/tiny-lora.yaml` in a fresh
directory, on a cold cache (no preset built, no Hugging Face or Ray cache), starts the embedded service
(SQLite, its own local Ray head, API, scheduler), trains, prints where the model was saved, and shuts
down everything it started."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


def test_memfit_run_tiny_lora(tmp_path, artifacts_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMFIT_", "RAY_ADDRESS"))}
    cold = tmp_path / "cold-cache"  # what a machine that never ran memfit has: nothing
    env.update({"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "COLUMNS": "120",
                "MEMFIT_PRESET_CACHE": str(cold / "presets"), "HF_HOME": str(cold / "hf"),
                "XDG_CACHE_HOME": str(cold / "xdg"), "RAY_TMPDIR": str(cold / "ray")})
    (cold / "ray").mkdir(parents=True)
    memfit = Path(sys.executable).with_name("memfit")
    t0 = time.monotonic()
    proc = subprocess.run([str(memfit), "run", str(ROOT / "examples" / "tiny-lora.yaml")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=840)
    elapsed = time.monotonic() - t0
    (artifacts_dir / "memfit-run.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    print(f"memfit run took {elapsed:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = re.search(r"^Model saved to (\S+)$", proc.stdout, re.M)
    assert saved, proc.stdout[-3000:]
    model_dir = Path(saved.group(1))
    assert model_dir.is_dir() and (model_dir / "adapter_config.json").is_file()
    assert model_dir.is_relative_to(tmp_path / ".memfit")  # the embedded default keeps data in ./.memfit
    assert "succeeded" in proc.stdout
    # It really started cold: the preset it trained was built into the empty cache by this run.
    (built,) = [p for p in (cold / "presets").iterdir() if p.name.startswith("tiny-llama-")]
    assert (built / ".memfit-seal.json").is_file()
    # Everything it started is gone: no Ray process uses its temp dir any more.
    import psutil

    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert leftovers == []
