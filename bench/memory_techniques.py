"""Peak tensor memory per rank for each memory technique, measured on the real training functions.

    python bench/memory_techniques.py [--hidden 512] [--layers 8] [--seq 512] [--batch 2] [--only ddp-fp32,zero3]

One random-init Llama-style model (hidden 512, 8 layers, vocab 8000 by default), one batch shape,
three optimizer steps per technique. Each run is workers.strategies.train (the function the Ray
workers run) in plain processes — 2-rank cases under torch.multiprocessing with gloo, not Ray, to
skip Ray's start-up cost. The figure is the telemetry's traced step 3 (workers/telemetry.py):
the peak of live tensor bytes from the profiler's memory events, split into parameters, gradients,
optimizer states (device + host), activations and temporaries. "vs fp32" is against full fp32 AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
MiB = 1024 * 1024

# name -> (world size, TrainArgs overrides)
TECHNIQUES = {
    "ddp-fp32": (1, {}),
    "bf16": (1, {"precision": "bf16"}),
    "bf16+checkpointing": (1, {"precision": "bf16", "gradient_checkpointing": True}),
    "lora-r8": (1, {"peft_method": "lora"}),
    "qlora-r8": (1, {"peft_method": "qlora"}),  # LoRA on a 4-bit NF4 base (bitsandbytes' CPU backend)
    "qlora-r8+bf16": (1, {"peft_method": "qlora", "precision": "bf16"}),
    "chunked-loss-256": (1, {"loss_chunk_tokens": 256}),  # training.loss_chunk_tokens (workers/chunked_loss.py)
    "fsdp2x2": (2, {"strategy": "fsdp"}),
    "qlora-r8+fsdp2x2": (2, {"strategy": "fsdp", "peft_method": "qlora"}),  # the packed codes sharded
    "zero2x2": (2, {"strategy": "deepspeed", "ds_stage": 2}),
    "zero3x2": (2, {"strategy": "deepspeed", "ds_stage": 3}),
    "zero3+offloadx2": (2, {"strategy": "deepspeed", "ds_stage": 3, "ds_offload_optimizer": "cpu",
                            "ds_offload_param": "cpu"}),
    # training.strategy pipeline: 2 stages (workers/strategies/pipeline.py), the micro-batch in 2 chunks
    "pipeline-1f1bx2": (2, {"strategy": "pipeline", "pipeline_stages": 2, "pipeline_schedule": "1f1b",
                            "pipeline_microbatches": 2}),
    "pipeline-gpipex2": (2, {"strategy": "pipeline", "pipeline_stages": 2, "pipeline_schedule": "gpipe",
                             "pipeline_microbatches": 2}),
    "tp2": (2, {"strategy": "tensor"}),  # workers/strategies/tensor.py: half of every block's heads and MLP columns
}


def build_model(dir_: Path, hidden: int, layers: int, seq: int) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.models import train_tokenizer

    if (dir_ / "config.json").exists():
        return str(dir_)
    cfg = dict(model_type="llama", hidden_size=hidden, intermediate_size=int(hidden * 8 / 3 // 16 * 16),
               num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
               vocab_size=8000, max_position_embeddings=max(2048, seq), tie_word_embeddings=False)
    tok = train_tokenizer(8000, max(2048, seq))
    config = AutoConfig.for_model(**cfg)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dir_)
    tok.save_pretrained(dir_)
    return str(dir_)


def write_dataset(path: Path, rows: int, words: int) -> None:
    rng = random.Random(0)
    vocab = "the of memory train token model shard gradient optimizer layer rank batch".split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")


def measure(name: str, world: int, overrides: dict, base: dict) -> dict:
    from workers.args import TrainArgs
    from workers.local import run_local

    args = TrainArgs(**{**base, "output_dir": str(Path(base["output_dir"]) / name), **overrides})
    t0 = time.perf_counter()
    results = run_local(args, world)
    per_rank = []
    for res in results:
        traced = [m for r in res["reports"] if r.get("kind") == "metrics" for m in r.get("memory", [])
                  if m.get("step") == 3 and m.get("phase") == "step" and m.get("peak_bytes")]
        per_rank.append(traced[0] if traced else {})
    worst = max(per_rank, key=lambda m: m.get("peak_bytes") or 0)
    # Throughput: the job's input tokens per second of wall time over steps 2 and 3 (step 1 warms up):
    # the sum of the ranks' own rates (workers/steps.py: a rank's micro-batch tokens over its step time;
    # in a pipeline only the first stage counts its rows, as for the job's trained_tokens).
    rates = []
    for res in results:
        steps = [r["tokens_per_s"] for r in res["reports"]
                 if r.get("kind") == "metrics" and r.get("step", 0) >= 2 and r.get("tokens_per_s") is not None]
        rates.append(sum(steps) / len(steps) if steps else None)
    tokens_per_s = sum(rates) if rates and None not in rates else None
    return {"name": name, "world": world, "seconds": time.perf_counter() - t0, "tokens_per_s": tokens_per_s, **worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated technique names")
    opts = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="memfit-membench-"))
    model_dir = build_model(tmp / "model", opts.hidden, opts.layers, opts.seq)
    data = tmp / "train.jsonl"
    write_dataset(data, rows=opts.batch * 2 * 4, words=opts.seq)
    base = dict(job_id="membench", output_dir=str(tmp / "out"), training_path=str(data), model="bench",
                model_path=model_dir, micro_batch_size=opts.batch, max_seq_length=opts.seq, max_steps=3,
                learning_rate=1e-4, checkpoint_every_steps=10**6, telemetry_every_steps=1,
                memory_trace_every_steps=10**6)
    names = [n for n in TECHNIQUES if not opts.only or n in opts.only.split(",")]
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    print(f"model: llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; "
          f"batch {opts.batch} x seq {opts.seq}; AdamW; peak live tensor bytes per rank at step 3 (profiler)")
    rows = []
    for name in names:
        world, overrides = TECHNIQUES[name]
        rows.append(measure(name, world, overrides, base))
        r = rows[-1]
        print(f"  measured {name} in {r['seconds']:.0f} s", flush=True)
    baseline = next((r["peak_bytes"] for r in rows if r["name"] == "ddp-fp32" and r.get("peak_bytes")), None)
    head = f"{'technique':<20}{'ranks':>6}{'peak MiB':>10}{'vs fp32':>9}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'temp':>9}{'tok/s':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        def mib(*keys):
            return sum((r.get(k) or 0) for k in keys) / MiB

        peak = (r.get("peak_bytes") or 0) / MiB
        rel = f"{(r['peak_bytes'] / baseline - 1) * 100:+.0f}%" if baseline and r.get("peak_bytes") else "n/a"
        print(f"{r['name']:<20}{r['world']:>6}{peak:>10.1f}{rel:>9}"
              f"{mib('parameters_bytes', 'host_parameters_bytes'):>9.1f}{mib('gradients_bytes', 'host_gradients_bytes'):>9.1f}"
              f"{mib('optimizer_bytes', 'host_optimizer_bytes'):>9.1f}{mib('activations_bytes'):>9.1f}{mib('temporary_bytes'):>9.1f}"
              f"{r['tokens_per_s'] or 0:>9.0f}")
    print("params/grads/optim include host-resident (offloaded) bytes; on a CPU machine host and device are the same RAM.")
    print("tok/s: the job's input tokens per wall-clock second over steps 2-3 (all ranks); a ratio between rows is only as good as "
          "the machine was quiet (every row shares its cores).")


if __name__ == "__main__":
    main()
