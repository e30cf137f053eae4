"""The planner at real sizes, on paper: Llama-3.1-8B, 70B and 405B on 8 to 512 H100s under FSDP2, FSDP2 × tensor
parallelism and a pipeline — each rank's device and host memory at the training step, and at loading the weights
and exporting the model — beside the peak memory per GPU torchtitan publishes for the same models where it
publishes one.

    .venv/bin/python bench/scale_plan.py             # the grid and the comparison (a few seconds, no GPU)
    .venv/bin/python bench/scale_plan.py --json out.json

No GPU is needed: it is service/memory/planner.py's arithmetic on the models' shapes (service/memory/shape.py
KNOWN_CONFIGS), for the catalogue's ``h100-80gb`` (service/memory/gpus.py), bf16 (FSDP2's MixedPrecisionPolicy:
fp32 shards, bf16 compute), AdamW, a full fine-tune, one micro-batch of ``--seq`` tokens per data-parallel rank,
activation checkpointing on every decoder block.

Published figures: torchtitan's docs/performance.md (github.com/pytorch/torchtitan, the version at commit
eaea6f6a), measured on H100s with 96 GB of HBM2e, "Memory (GiB)" the peak per GPU (torchtitan logs the CUDA
caching allocator's reserved peak), sequence length 8192 (its Llama 3.1 configs), bf16 with FSDP2's fp32 shards:

- Table 1: 8B, FSDP 8, local batch 2, selective activation checkpointing: 82.4 GiB; + torch.compile 77.0; + Float8 76.8;
- Table 3: 8B, FSDP 128, the same: 67.0; 62.0; 61.8;
- Table 4: 70B, FSDP 32 × TP 8 (256 GPUs), local batch 16, full checkpointing, torch.compile + Float8: 71.9;
  + AsyncTP 67.6;
- Table 5: 405B, FSDP 8 × TP 8 × PP 8 (512 GPUs), local batch 32, full checkpointing, compile + Float8 + AsyncTP:
  1F1B 82.5, interleaved 1F1B 72.7.
Each comparison row plans the same model, GPUs, batch and sequence in memfit's nearest configuration, and says what
differs (docs/scale-plan.md explains each difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2**30
MODELS = {"8B": "meta-llama/Llama-3.1-8B", "70B": "meta-llama/Llama-3.1-70B", "405B": "meta-llama/Llama-3.1-405B"}
GPU = "h100-80gb"
GPUS = (8, 64, 512)
TP = 8
STAGES = 8

# torchtitan docs/performance.md (commit eaea6f6a): (table, model, gpus, parallelism, local batch, AC, GiB by technique)
PUBLISHED = [
    ("Table 1", "8B", 8, "FSDP 8", 2, "selective", {"FSDP": 82.4, "+ compile": 77.0, "+ compile + Float8": 76.8}),
    ("Table 3", "8B", 128, "FSDP 128", 2, "selective", {"FSDP": 67.0, "+ compile": 62.0, "+ compile + Float8": 61.8}),
    ("Table 4", "70B", 256, "FSDP 32 × TP 8", 16, "full", {"compile + Float8": 71.9, "+ AsyncTP": 67.6}),
    ("Table 5", "405B", 512, "FSDP 8 × TP 8 × PP 8", 32, "full",
     {"1F1B, compile + Float8 + AsyncTP": 82.5, "interleaved 1F1B": 72.7}),
]


def training(strategy: str, gpus: int, micro: int, seq: int, checkpointing: bool = True, **extra) -> dict:
    t = {"strategy": strategy, "precision": "bf16", "gradient_checkpointing": checkpointing,
         "hyperparameters": {"micro_batch_size": micro, "max_seq_length": seq},
         "resources": {"num_workers": gpus, "gpus_per_worker": 1, "gpu_type": GPU}}
    t.update(extra)
    return t


def layouts(gpus: int, micro: int, seq: int) -> list[tuple[str, dict]]:
    out = [("FSDP2", training("fsdp", gpus, micro, seq)),
           (f"FSDP2 {gpus // TP} × TP {TP}", training("tensor", gpus, micro, seq, tensor_parallel={"size": TP}))]
    chunks = min(micro, STAGES) if micro >= 1 else 1
    out.append((f"pipeline {STAGES} stages × {gpus // STAGES} replicas, 1F1B",
                training("pipeline", gpus, micro, seq, pipeline={"stages": STAGES, "microbatches": chunks})))
    return out


def plan_row(model: str, label: str, body: dict) -> dict:
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    spec = JobSpec.model_validate({"model": MODELS[model], "training_file": "file-scale", "training": body})
    shape = shape_for_model(resolve_model(spec.model, ()))
    try:
        p = plan(spec, shape)
    except Exception as exc:  # noqa: BLE001 - a layout the spec refuses (e.g. heads not divisible): say so
        return {"model": model, "layout": label, "gpus": body["resources"]["num_workers"], "error": str(exc)[:160]}
    ph = p.job_phases.phases
    return {"model": model, "layout": label, "gpus": p.world_size, "micro": body["hyperparameters"]["micro_batch_size"],
            "seq": body["hyperparameters"]["max_seq_length"], "params": p.parameter_count,
            "device_bytes": p.peak_bytes, "live_bytes": p.peak_bytes - p.per_rank.device.overhead,
            "step_phase": p.peak_phase, "fits": p.fits, "usable_bytes": p.usable_bytes,
            "states_bytes": p.model_states.device.parameters + p.model_states.device.gradients
            + p.model_states.device.optimizer_states,
            "activations_bytes": p.activations_saved_bytes,
            "load_device_bytes": ph["load"].device_bytes, "load_host_bytes": ph["load"].host_bytes,
            "export_device_bytes": ph["export"].device_bytes, "export_host_bytes": ph["export"].host_bytes,
            "device_peak_phase": p.job_phases.device_peak_phase, "host_peak_phase": p.job_phases.host_peak_phase,
            "node_host_bytes": 8 * ph["step"].host_bytes}


def comparison_rows(seq: int) -> list[dict]:
    out = []
    for table, model, gpus, layout, micro, ac, published in PUBLISHED:
        if model == "405B":  # memfit has no FSDP × TP × PP: its pipeline (stages unsharded) is the nearest
            body = training("pipeline", gpus, micro, seq, pipeline={"stages": 8, "microbatches": 8})
            ours = f"pipeline 8 stages × {gpus // 8} replicas, 1F1B (no FSDP or TP within a stage)"
        elif "TP" in layout:
            body = training("tensor", gpus, micro, seq, tensor_parallel={"size": 8})
            ours = f"FSDP2 {gpus // 8} × TP 8"
        else:
            body = training("fsdp", gpus, micro, seq)
            ours = f"FSDP2 {gpus}"
        row = plan_row(model, ours, body)
        # the same without activation checkpointing: torchtitan's selective checkpointing keeps more than memfit's
        # full checkpointing (every block) and less than none, so the two bracket it
        free = plan_row(model, ours, {**body, "gradient_checkpointing": False})
        row.update(table=table, published_layout=layout, published_ac=ac, published=published,
                   no_ac_device_bytes=free.get("device_bytes"), no_ac_activations_bytes=free.get("activations_bytes"))
        out.append(row)
    return out


def gib(x) -> str:
    return f"{x / GiB:7.1f}" if isinstance(x, (int, float)) else "    n/a"


def print_grid(rows: list[dict]) -> None:
    head = (f"{'model':<5}{'GPUs':>5}  {'layout':<44}{'states':>8}{'acts':>8}{'step':>8}{'fits':>6}"
            f"{'load dev':>9}{'load host':>10}{'export host':>12}  peak phase (dev/host)")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<5}{r['gpus']:>5}  {r['layout']:<44}  refused: {r['error']}")
            continue
        print(f"{r['model']:<5}{r['gpus']:>5}  {r['layout']:<44}{gib(r['states_bytes'])} {gib(r['activations_bytes'])}"
              f" {gib(r['device_bytes'])}{'yes' if r['fits'] else 'NO':>6}{gib(r['load_device_bytes'])}  "
              f"{gib(r['load_host_bytes'])}   {gib(r['export_host_bytes'])}    "
              f"{r['device_peak_phase']}/{r['host_peak_phase']}")
    print("GiB per rank on an h100-80gb: states = parameters + gradients + AdamW states; acts = what forward saves; "
          "step = the step's predicted peak (overhead included); load/export: the job's phases (export: rank 0)")


def print_comparison(rows: list[dict]) -> None:
    print("\nBeside torchtitan's published peak memory per GPU (docs/performance.md, H100 96 GB, seq 8192):")
    for r in rows:
        pub = "; ".join(f"{k} {v:.1f}" for k, v in r["published"].items())
        if r.get("error"):
            ours = f"refused ({r['error']})"
        else:
            ours = (f"{r['device_bytes'] / GiB:.1f} GiB with full AC (states {r['states_bytes'] / GiB:.1f}, saved "
                    f"activations {r['activations_bytes'] / GiB:.1f}), {r['no_ac_device_bytes'] / GiB:.1f} GiB without "
                    f"(activations {r['no_ac_activations_bytes'] / GiB:.1f})")
        print(f"  {r['table']}: {r['model']} on {r['gpus']} GPUs, {r['published_layout']}, local batch "
              f"{r['micro'] if not r.get('error') else '?'}, {r['published_ac']} AC\n"
              f"    torchtitan: {pub} GiB\n    memfit ({r['layout']}): {ours}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=1, help="micro-batch per data-parallel rank in the grid")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = [plan_row(m, label, body) for m in MODELS for g in GPUS for label, body in layouts(g, a.micro, a.seq)]
    print_grid(rows)
    comparison = comparison_rows(a.seq)
    print_comparison(comparison)
    if a.json:
        Path(a.json).write_text(json.dumps({"grid": rows, "comparison": comparison}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
