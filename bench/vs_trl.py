"""Trained (non-padding) tokens per second: a memfit job's training loop against TRL's SFTTrainer — the
trainer Axolotl and LLaMA-Factory users run — on the same model, data, hyperparameters and cores, with and
without packing, in one command. Prints each round's figures, the ratio memfit / TRL per round and its
median, min and max.

    .venv/bin/python bench/vs_trl.py                       # small-llama, examples/data/chat.jsonl, 3 rounds
    .venv/bin/python bench/vs_trl.py --quick               # 1 round, fewer steps (make bench)

What each side runs, one process at a time, ``--threads`` torch threads each (default: every core):
- memfit: workers/local.py run_local — the very strategy function a Ray worker runs (DDP on one rank,
  fp32, AdamW, the job's default telemetry cadence), with training.hyperparameters.packing off or on
  (on: rows of max_seq_length, examples kept apart by position ids and a block-diagonal mask);
- TRL: SFTTrainer(SFTConfig(max_length, per_device_train_batch_size, learning_rate, max_steps, packing,
  use_cpu, gradient_checkpointing=False — TRL's default is True, memfit's job has it off)) on the same JSONL
  of chat rows (TRL's packing: its default "bfd" strategy, padding-free rows), its optimizer Trainer's
  default (fused AdamW), memfit's torch's AdamW.
Tokens per second = the non-padding tokens the steps after the first ``--warmup`` trained on, over those
steps' wall time (memfit: its per-step reports; TRL: a callback around each optimizer step, and
``num_input_tokens_seen`` counted without padding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def memfit_tokens_per_s(model: str, data: str, args, packing: bool) -> tuple[float, int]:
    from workers.args import TrainArgs
    from workers.local import run_local

    with tempfile.TemporaryDirectory() as out:
        train = TrainArgs(job_id="bench", output_dir=out, training_path=data, model=model, micro_batch_size=args.micro,
                          max_seq_length=args.seq, max_steps=args.steps, learning_rate=args.lr, packing=packing,
                          checkpoint_every_steps=10**6, eval_every_steps=10**6, seed=0)
        [rank0] = run_local(train)
    steps = [r for r in rank0["reports"] if r.get("kind") == "metrics"][args.warmup:]
    tokens = sum(round(r["tokens_per_s"] * r["step_time_s"]) for r in steps)
    return tokens / sum(r["step_time_s"] for r in steps), tokens


def trl_tokens_per_s(model_dir: str, data: str, args, packing: bool) -> tuple[float, int]:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from workers.models import load_tokenizer

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[float, int]] = []

        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, a, state, control, **kw):
            self.steps.append((time.perf_counter() - self.t0, state.num_input_tokens_seen - self.seen))

    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, max_length=args.seq, per_device_train_batch_size=args.micro,
                           gradient_accumulation_steps=1, learning_rate=args.lr, max_steps=args.steps, packing=packing,
                           use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**6, seed=0,
                           dataloader_num_workers=0, include_num_input_tokens_seen="non_padding", max_grad_norm=1.0,
                           lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
                           gradient_checkpointing=False)  # TRL's default is on; memfit's job is planned without
        trainer = SFTTrainer(model=model, args=config, train_dataset=load_dataset("json", data_files=data)["train"],
                             processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    steps = clock.steps[args.warmup:]
    tokens = sum(n for _, n in steps)
    return tokens / sum(t for t, _ in steps), tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="preset:small-llama")
    p.add_argument("--data", default=str(ROOT / "examples" / "data" / "chat.jsonl"))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="1 round of 6 steps")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 6, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from workers.models import build_preset

    torch.set_num_threads(args.threads)
    model_dir = str(build_preset(args.model)) if args.model.startswith("preset:") else args.model
    print(f"model {args.model}, data {Path(args.data).name}, max_seq_length {args.seq}, micro-batch {args.micro}, "
          f"{args.steps} steps ({args.warmup} warm-up not counted), {args.threads} thread(s), torch "
          f"{torch.__version__}", flush=True)
    rows = []
    for packing in (False, True):
        ratios = []
        for r in range(args.rounds):
            # alternate which side runs first, so a warming machine favours neither
            order = ("memfit", "trl") if r % 2 == 0 else ("trl", "memfit")
            got = {}
            for side in order:
                fn = memfit_tokens_per_s if side == "memfit" else trl_tokens_per_s
                got[side] = fn(args.model if side == "memfit" else model_dir, args.data, args, packing)
            ratio = got["memfit"][0] / got["trl"][0]
            ratios.append(ratio)
            rows.append({"packing": packing, "round": r + 1, "memfit_tokens_per_s": got["memfit"][0],
                         "trl_tokens_per_s": got["trl"][0], "memfit_tokens": got["memfit"][1],
                         "trl_tokens": got["trl"][1], "ratio": ratio})
            print(f"packing={packing!s:5} round {r + 1}: memfit {got['memfit'][0]:8.0f} tok/s ({got['memfit'][1]} tokens)"
                  f"  TRL {got['trl'][0]:8.0f} tok/s ({got['trl'][1]} tokens)  ratio {ratio:.2f}", flush=True)
        print(f"packing={packing!s:5} memfit / TRL: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} round(s))", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
