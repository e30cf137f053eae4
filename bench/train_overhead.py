"""memfit's training step against a plain hand-written PyTorch loop: same model, data, batch, process.

    python bench/train_overhead.py [--model preset:small-llama] [--steps 20] [--seq 256] [--batch 4]
                                   [--rounds 7] [--threads N] [--device cpu|cuda] [--clock wall|cpu]

The memfit side is the real worker loop (workers.strategies.train_ddp in a plain process, world
size 1) in two telemetry modes:

- *default cadence*: a memory sample and a metrics report every step, a profiler trace every 10
  steps (the spec's defaults);
- *counters only*: the same per-step sample and report, no profiler trace.

The two sides run in **lockstep**, one step each in turn, in the same process: each time memfit
reports a step, the plain loop runs its own step of the same batch inside that report call. memfit's
time for a step is from the end of the plain step before it to the start of the next one (so its
collation, telemetry, profiler traces, the report and the host syncs are all inside), the plain
loop's is its own step. A shared 2-core machine drifts by 10% and more between runs a few seconds
apart; steps a quarter of a second apart see the same machine, so the drift cancels in each round's
ratio (the earlier design, whole runs one after the other, had paired ratios spread over 0.84–1.07).

Steps 1-3 warm up untimed on both sides (step 3 is memfit's one-off first-steady-state trace), then
``--steps`` steps are timed (with the default 20 steps, memfit traces steps 10 and 20: the steady 1
in 10), then one last untimed step, where memfit writes its final checkpoint. The plain side is
model(**batch).loss (Hugging Face's loss), backward, clip_grad_norm_, AdamW step with torch's
default implementation (the for-loop on CPU, foreach on CUDA) and the job's hyperparameters,
schedule step, zero_grad, on batches collated (and moved to the device) beforehand, which favours
it. Each round builds both sides afresh and runs each telemetry mode once, in an order that
alternates between rounds; every round is printed, and the summary gives the median tokens/s of
each side and the median of the per-round ratios with their min-max, against the targets 0.98
(default cadence) and 0.99 (counters only). ``--clock cpu`` times CPU seconds of this process
instead of wall seconds (CPU device only).
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


class PlainLoop:
    """The textbook loop, one step per call."""

    def __init__(self, model_dir: str, batches: list[dict], args, device):
        import torch

        from workers.models import load_model

        torch.manual_seed(0)
        self.model = load_model(model_dir).to(device)
        self.model.config.use_cache = False
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.batches, self.max_grad_norm, self.device = batches, args.max_grad_norm, device

    def step(self, step: int) -> None:
        import torch

        batch = self.batches[step - 1]
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)


def lockstep(args, model_dir: str, batches: list[dict], device) -> tuple[float, float]:
    """(memfit, plain) tokens per second over the timed steps, the two loops taking turns."""
    from workers.steps import WorkerEnv
    from workers.strategies import train

    plain = PlainLoop(model_dir, batches, args, device)
    first, last = WARMUP_STEPS, args.max_steps - 1  # timed: steps first+1 … last
    spans: dict[str, float] = {"memfit": 0.0, "plain": 0.0}
    resumed_at = [0.0]  # when memfit got the machine back after the last plain step

    class LockstepEnv(WorkerEnv):
        def report(self, metrics, checkpoint_dir=None):
            super().report(metrics, checkpoint_dir)
            if metrics.get("kind") != "metrics":
                return
            step = metrics["step"]
            sync(device)
            handed_over = clock()
            if first < step <= last:
                spans["memfit"] += handed_over - resumed_at[0]
            plain.step(step)
            resumed_at[0] = clock()
            if first < step <= last:
                spans["plain"] += resumed_at[0] - handed_over

    env = LockstepEnv(rank=0, world_size=1, device=device)
    train(args, env)
    tokens = sum(b["n_tokens"] for b in batches[first:last])
    return tokens / spans["memfit"], tokens / spans["plain"]


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.0f} tokens/s  (min {min(values):.0f}, max {max(values):.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:small-llama")
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: tokens per second; cpu: tokens per CPU-second of this process (CPU device only)")
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

    def job_args(mode: str, r: int) -> TrainArgs:
        return TrainArgs(job_id="bench", output_dir=str(tmp / f"out-{mode}-{r}"), training_path=str(data_path),
                         model=opts.model, model_path=model_dir, micro_batch_size=opts.batch,
                         max_seq_length=opts.seq, learning_rate=1e-4, max_steps=total_steps,
                         checkpoint_every_steps=10**6, telemetry_every_steps=1,
                         memory_trace_every_steps=MODES[mode])

    print(f"model {opts.model}, batch {opts.batch} x seq {opts.seq}, {opts.steps} timed steps "
          f"(+{WARMUP_STEPS} warm-up, +1 final checkpoint), {opts.rounds} rounds, device {device}, "
          f"torch threads {torch.get_num_threads()}, {opts.clock} clock, memfit and plain in lockstep", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"default": [], "counters": []}
    for r in range(opts.rounds):
        order = ["default", "counters"] if r % 2 == 0 else ["counters", "default"]
        for mode in order:
            results[mode].append(lockstep(job_args(mode, r), model_dir, batches, device))
        print(f"round {r + 1}: " + ", ".join(
            f"{mode}: memfit {results[mode][-1][0]:.0f} / plain {results[mode][-1][1]:.0f} = "
            f"{results[mode][-1][0] / results[mode][-1][1]:.3f}" for mode in order) + " tokens/s", flush=True)
    print(f"plain PyTorch loop (all rounds)  : {summary([pl for m in results.values() for _, pl in m])}")
    for mode, label in (("default", "telemetry default cadence"), ("counters", "telemetry counters only")):
        ratios = [m / pl for m, pl in results[mode]]
        med = statistics.median(ratios)
        print(f"memfit, {label:25}: {summary([m for m, _ in results[mode]])}")
        print(f"  ratio memfit/plain per round    : median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
              f"  target ≥ {TARGETS[mode]:.2f}: {'PASS' if med >= TARGETS[mode] else 'FAIL'}")


if __name__ == "__main__":
    main()
