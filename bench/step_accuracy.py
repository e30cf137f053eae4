"""Every measured step of every rank against the plan of its own micro-batches, over HTTP, on real jobs.

    .venv/bin/python bench/step_accuracy.py                  # every config of CONFIGS × both runs (~20 min)
    .venv/bin/python bench/step_accuracy.py --only ddp2      # the configs whose name contains it
    .venv/bin/python bench/step_accuracy.py --save out.json  # keep every job's memory view

One API + scheduler (tests/stack.py: Stack) on a throwaway Postgres database, submitting to a local Ray head
of its own; each config runs twice, every step traced (``memory_trace_every_steps: 1``):

- **short**: the example chat data (examples/data/chat.jsonl), ``max_steps`` 4 — shorter than one epoch;
- **long**: a file of widely varied lengths (:func:`varied_rows`: text rows of 4 to 460 words, made here with a
  fixed seed), 2 epochs.

For each job it reads GET /v1/fine_tuning/jobs/{id}/memory and prints, per rank, the steps compared and the
worst error (predicted − measured) / measured of a step against the plan of that step's own micro-batches
(service/memory/step_compare.py), whether every step is within the bound (+3%, −1%), the run's predicted peak
step (the plan's ``steps.peak``, made before the run, and per rank the steps whose own plan is the rank's
highest) against the measured peak steps (the steps with the highest measured peak; with ties, all of them),
and the referee's per-phase disagreement with the trace (worst, as a fraction of the step's peak) and the
range of held unattributed bytes (steady steps, from step 3).

CONFIGS was written (and committed) before any of these jobs ran; it is not tuned to their errors.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20

# (name, model, training fields): written down before any was measured (see the module docstring)
CONFIGS: list[tuple[str, str, dict]] = [
    ("ddp2 full fp32", "preset:small-llama",
     {"strategy": "ddp", "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}}),
    ("zero1 full bf16 acc2", "preset:small-llama",
     {"strategy": "deepspeed", "deepspeed": {"zero_stage": 1}, "precision": "bf16", "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 2, "gradient_accumulation_steps": 2}}),
    ("zero2 full fp32 acc3 qwen2", "preset:small-qwen2",
     {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}, "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}}),
    ("zero3 lora fp32 ckpt", "preset:small-llama",
     {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}, "peft": {"method": "lora", "r": 8},
      "gradient_checkpointing": True, "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 4}}),
    ("fsdp2 full bf16 qwen2", "preset:small-qwen2",
     {"strategy": "fsdp", "precision": "bf16", "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}}),
    ("ddp2 lora bf16 acc2 gpt2", "preset:small-gpt2",
     {"strategy": "ddp", "precision": "bf16", "peft": {"method": "lora", "r": 16}, "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 4, "gradient_accumulation_steps": 2}}),
    ("pp2 1f1b lora fp32", "preset:small-llama",
     {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "1f1b"}, "peft": {"method": "lora", "r": 8},
      "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}}),
    ("tp2 full bf16", "preset:small-llama",
     {"strategy": "tensor", "precision": "bf16", "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}}),
]
MAX_SEQ = 512
SHORT_STEPS = 4
LONG_EPOCHS = 2
VARIED_ROWS = 24


def varied_rows(n: int = VARIED_ROWS, seed: int = 35) -> list[dict]:
    """Text rows of widely varied lengths: 4 to 460 words of a small vocabulary, lengths spread log-uniformly."""
    rnd = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    out = []
    for _ in range(n):
        length = int(round(4 * (460 / 4) ** rnd.random()))
        out.append({"text": " ".join(rnd.choice(words) + str(rnd.randint(0, 99)) for _ in range(length))})
    return out


def _training(fields: dict, run: str) -> dict:
    t = json.loads(json.dumps(fields))
    hp = {"max_seq_length": MAX_SEQ, "learning_rate": 1e-4, **t.pop("hyperparameters", {})}
    if run == "short":
        hp["max_steps"] = SHORT_STEPS
    t["hyperparameters"] = hp
    t.update(memory_trace_every_steps=1, telemetry_every_steps=1, checkpoint_every_steps=1000,
             memory_policy="ignore")
    return t


def summarize(view: dict) -> dict:
    """What the bench prints of one job's memory view."""
    out = {"ranks": {}}
    for rank, r in (view.get("steps") or {}).get("by_rank", {}).items():
        # steady steps, as the comparison (service/memory/step_compare.py): step 1 has no optimizer state, step 2 is
        # when DDP rebuilds its buckets (the trace, which never saw the old ones allocated, misses their free)
        entries = [e for e in view["samples"][rank] if e["phase"] == "step" and e.get("peak_bytes") and e["step"] >= 3]
        top = max(e["peak_bytes"] for e in entries)
        referee = [e["device"].get("referee") or {} for e in view["samples"][rank] if e["phase"] == "step" and e["step"] >= 3]
        phase_gap = max((abs(p["unattributed_bytes"]) / e["peak_bytes"]
                         for e in entries for p in ((e["device"].get("referee") or {}).get("phases") or {}).values()),
                        default=None)
        out["ranks"][rank] = {
            "steps": r["steps_compared"], "worst_error": r["worst"]["error"], "worst_step": r["worst"]["step"],
            "max_error": r["max_error"], "min_error": r["min_error"], "within_bound": r["within_bound"],
            "measured_peak_steps": sorted(e["step"] for e in entries if e["peak_bytes"] == top),
            # the steps the plan of each step's own micro-batches puts at the rank's peak (ties: all of them)
            "predicted_peak_steps": sorted(e["step"] for e in entries if e.get("predicted_bytes") ==
                                           max(x.get("predicted_bytes") or 0 for x in entries)),
            "referee_phase_gap": phase_gap,
            "held_unattributed_bytes": [min((x.get("unattributed_bytes") or 0 for x in referee), default=None),
                                        max((x.get("unattributed_bytes") or 0 for x in referee), default=None)],
        }
    run = view.get("predicted_run") or {}
    out["predicted_peak"] = ({k: run["peak"][k] for k in ("step", "rank", "row_tokens", "width", "padded")}
                             if run.get("peak") else None)
    out["steps_at_peak"] = run.get("steps_at_peak")
    out["total_steps"] = run.get("total_steps")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="configs whose name contains this")
    ap.add_argument("--runs", default="short,long")
    ap.add_argument("--save", help="write every job's summary and memory view here")
    args = ap.parse_args(argv)
    from service.scheduler.local_head import LocalRayHead
    from service.store import db
    from tests import pgserver
    from tests.factories import create_job, upload
    from tests.stack import Stack

    configs = [c for c in CONFIGS if not args.only or args.only in c[0]]
    results = []
    with tempfile.TemporaryDirectory(prefix="memfit-step-accuracy-") as tmp:
        head = LocalRayHead(num_cpus=4, log_path=Path(tmp) / "head.log").start()
        try:
            with pgserver.database(pgserver.admin_url()) as url:
                db.upgrade(url)
                stack = Stack(url, Path(tmp) / "storage", head)
                stack.start_scheduler()
                try:
                    files = {"short": stack.train_file, "long": upload(stack.http, stack.key, varied_rows(),
                                                                     name="varied.jsonl")}
                    for name, model, fields in configs:
                        for run in args.runs.split(","):
                            t0 = time.perf_counter()
                            extra = {"hyperparameters": {"n_epochs": LONG_EPOCHS}} if run == "long" else {}
                            job = create_job(stack.http, stack.key, files[run], _training(fields, run), model=model,
                                             seed=7, **extra)
                            done = stack.wait(job["id"], ("succeeded",), timeout=1800)
                            view = stack.http.get(f"/v1/fine_tuning/jobs/{done['id']}/memory", headers=stack.auth).json()
                            s = summarize(view)
                            s.update(config=name, run=run, seconds=round(time.perf_counter() - t0, 1))
                            results.append({**s, "view": view} if args.save else s)
                            print(json.dumps(s), flush=True)
                finally:
                    stack.close()
        finally:
            head.stop()
    if args.save:
        Path(args.save).write_text(json.dumps(results))
    bad = [r for r in results if not all(x["within_bound"] for x in r["ranks"].values())]
    print(f"{len(results)} jobs; {len(bad)} with a step outside +3%/-1%")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
