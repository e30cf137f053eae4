"""memfit's training step against a plain hand-written PyTorch loop: same model, data, batch, process.

    python bench/train_overhead.py [--model preset:small-llama] [--steps 20] [--seq 256] [--batch 4]
                                   [--rounds 5] [--threads N] [--device cpu|cuda]

The memfit side is the real worker loop (workers.strategies.train_ddp in a plain process, world
size 1) in two telemetry modes:

- *default cadence*: a memory sample and a metrics report every step, a profiler trace every 10
  steps (the spec's defaults);
- *counters only*: the same per-step sample and report, no profiler trace.

Both sides run the same number of steps and time the same ones: steps 1-3 warm up untimed (step 3
is memfit's one-off first-steady-state trace), then ``--steps`` steps are timed (on memfit from the
report of step 3 to the report of step 3 + steps, so collation, telemetry, the report and the
host syncs are all inside; with the default 20 steps, steps 10 and 20 are traced: the steady 1 in
10), then one last untimed step, where memfit writes its final checkpoint. The plain side is
model(**batch).loss (Hugging Face's loss), backward, clip_grad_norm_, AdamW step with torch's
default implementation (the for-loop on CPU, foreach on CUDA) and the job's hyperparameters,
schedule step, zero_grad, on batches collated (and moved to the device) beforehand, which
favours it.

Each round runs the plain loop and both memfit modes, in an order that alternates between rounds
(plain first, then last) to spread the drift of a shared machine (``--clock cpu`` times CPU
seconds of this process instead of wall seconds: on a machine shared with other jobs, waiting
for a core then costs nothing, with ``--threads 1`` the two are the same on a quiet machine); every round is printed, and the
summary gives the median tokens/s of each side and the median of the per-round (paired) ratios
with their min-max, against the targets 0.98 (default cadence) and 0.99 (counters only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WARMUP_STEPS = 3  # untimed on both sides; memfit always traces step 3
TARGETS = {"default": 0.98, "counters": 0.99}
MODES = {"default": 10, "counters": 0}  # memory_trace_every_steps (0: no trace at all)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # --clock sets it


def write_dataset(path: Path, rows: int, words: int) -> None:
    import json
    import random

    rng = random.Random(0)
    vocab = "the of memory train token model shard gradient optimizer layer rank batch".split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(model_dir: str, batches: list[dict], args, device) -> float:
    """Tokens per second of the textbook loop over the timed steps."""
    import torch

    from workers.models import load_model

    torch.manual_seed(0)
    model = load_model(model_dir).to(device)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tokens = 0
    start = 0.0
    for i, batch in enumerate(batches[:-1]):  # memfit's last step is its untimed final checkpoint
        if i == WARMUP_STEPS:
            sync(device)
            start = clock()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP_STEPS:
            tokens += batch["n_tokens"]
    sync(device)
    return tokens / (clock() - start)


def memfit_loop(args, device) -> float:
    """Tokens per second of workers.strategies.train_ddp, timed between its reports."""
    from workers.steps import WorkerEnv
    from workers.strategies import train

    class TimedEnv(WorkerEnv):
        def report(self, metrics, checkpoint_dir=None):
            metrics["_t"] = clock()
            super().report(metrics, checkpoint_dir)

    env = TimedEnv(rank=0, world_size=1, device=device)
    train(args, env)
    m = {r["step"]: r for r in env.reports if r.get("kind") == "metrics"}
    first, last = m[WARMUP_STEPS], m[args.max_steps - 1]
    return (last["trained_tokens"] - first["trained_tokens"]) / (last["_t"] - first["_t"])


def summary(name: str, values: list[float]) -> str:
    return f"{statistics.median(values):8.0f} tokens/s  (min {min(values):.0f}, max {max(values):.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:small-llama")
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: tokens per second; cpu: tokens per CPU-second of this process (CPU device only), "
                        "which a machine shared with other jobs disturbs far less")
    opts = p.parse_args()
    global clock
    clock = CLOCKS[opts.clock]

    import torch

    from workers.args import TrainArgs
    from workers.data import StepSampler, load_dataset, step_batches
    from workers.models import load_tokenizer, resolve_model_dir

    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device("cuda" if opts.device == "auto" and torch.cuda.is_available() else
                          "cpu" if opts.device == "auto" else opts.device)
    if opts.clock == "cpu" and device.type != "cpu":
        p.error("--clock cpu measures host CPU time: use it with --device cpu")
    total_steps = WARMUP_STEPS + opts.steps + 1
    model_dir = resolve_model_dir(opts.model)
    tmp = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    data_path = tmp / "train.jsonl"
    write_dataset(data_path, rows=opts.batch * total_steps, words=opts.seq)
    tok = load_tokenizer(model_dir)
    data = load_dataset(str(data_path), tok, opts.seq)
    sampler = StepSampler(len(data), opts.batch, 1, 1, seed=42)  # TrainArgs' seed: the same batches
    batches = []
    for s in range(total_steps):
        b = step_batches(data, sampler, s, 0)[0]
        batches.append({**{k: v.to(device) for k, v in b.items()}, "n_tokens": int(b["attention_mask"].sum())})

    def job_args(mode: str) -> TrainArgs:
        return TrainArgs(job_id="bench", output_dir=str(tmp / f"out-{mode}"), training_path=str(data_path),
                         model=opts.model, model_path=model_dir, micro_batch_size=opts.batch,
                         max_seq_length=opts.seq, learning_rate=1e-4, max_steps=total_steps,
                         checkpoint_every_steps=10**6, telemetry_every_steps=1,
                         memory_trace_every_steps=MODES[mode])

    plain_args = job_args("default")
    print(f"model {opts.model}, batch {opts.batch} x seq {opts.seq}, {opts.steps} timed steps "
          f"(+{WARMUP_STEPS} warm-up, +1 final checkpoint), {opts.rounds} rounds, device {device}, "
          f"torch threads {torch.get_num_threads()}, {opts.clock} clock", flush=True)
    results: dict[str, list[float]] = {"plain": [], "default": [], "counters": []}
    for r in range(opts.rounds):
        order = ["plain", "default", "counters"] if r % 2 == 0 else ["counters", "default", "plain"]
        for side in order:
            if side == "plain":
                results[side].append(plain_loop(model_dir, batches, plain_args, device))
            else:
                results[side].append(memfit_loop(job_args(side), device))
        pl = results["plain"][-1]
        print(f"round {r + 1} ({' → '.join(order)}): plain {pl:.0f}, "
              f"memfit default {results['default'][-1]:.0f} ({results['default'][-1] / pl:.3f}), "
              f"counters only {results['counters'][-1]:.0f} ({results['counters'][-1] / pl:.3f}) tokens/s", flush=True)
    print(f"plain PyTorch loop          : {summary('plain', results['plain'])}")
    for mode, label in (("default", "telemetry default cadence"), ("counters", "telemetry counters only")):
        ratios = [m / pl for m, pl in zip(results[mode], results["plain"])]
        med = statistics.median(ratios)
        print(f"memfit, {label:20}: {summary(mode, results[mode])}")
        print(f"  paired ratio memfit/plain : median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
              f"  target ≥ {TARGETS[mode]:.2f}: {'PASS' if med >= TARGETS[mode] else 'FAIL'}")


if __name__ == "__main__":
    main()
