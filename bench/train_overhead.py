"""memfit's training step against a plain hand-written PyTorch loop: same model, data, batch, process.

    python bench/train_overhead.py [--model preset:small-llama] [--steps 20] [--seq 256] [--batch 4]

The memfit side is the real worker loop (workers.strategies.train_ddp in a plain process, world
size 1) with telemetry at its default cadence (a memory sample every step, a profiler trace every
10 steps and at step 3) and the per-step report; it is timed from its first to its last report, so
data collation, telemetry and reporting are all inside. The plain side is model(**batch).loss,
backward, clip, AdamW step, schedule step on batches collated beforehand (favouring it). Rounds
alternate to spread the noise of a shared CPU; the best round of each is compared.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_dataset(path: Path, rows: int, words: int) -> None:
    import json
    import random

    rng = random.Random(0)
    vocab = "the of memory train token model shard gradient optimizer layer rank batch".split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")


def plain_loop(model_dir: str, batches: list[dict], lr: float) -> float:
    """Tokens per second of the textbook loop."""
    import torch

    from workers.models import load_model

    torch.manual_seed(0)
    model = load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tokens = 0
    start = None
    for i, batch in enumerate(batches):
        if i == 1:  # the first step warms up allocations; time the rest (as for memfit)
            start = time.perf_counter()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i >= 1:
            tokens += int(batch["attention_mask"].sum())
    return tokens / (time.perf_counter() - start)


def memfit_loop(args, steps: int) -> float:
    """Tokens per second of workers.strategies.train_ddp, timed between its reports."""
    from workers.steps import WorkerEnv
    from workers.strategies import train

    class TimedEnv(WorkerEnv):
        def report(self, metrics, checkpoint_dir=None):
            metrics["_t"] = time.perf_counter()
            super().report(metrics, checkpoint_dir)

    env = TimedEnv(rank=0, world_size=1, device=__import__("torch").device("cpu"))
    args.max_steps = steps
    train(args, env)
    m = [r for r in env.reports if r.get("kind") == "metrics"]
    tokens = sum(r["trained_tokens"] for r in m[-1:]) - m[0]["trained_tokens"]
    return tokens / (m[-1]["_t"] - m[0]["_t"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:small-llama")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    opts = p.parse_args()

    import torch

    from workers.args import TrainArgs
    from workers.data import StepSampler, load_dataset, step_batches
    from workers.models import load_tokenizer, resolve_model_dir

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = resolve_model_dir(opts.model)
    tmp = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    data_path = tmp / "train.jsonl"
    write_dataset(data_path, rows=opts.batch * (opts.steps + 1), words=opts.seq)
    tok = load_tokenizer(model_dir)
    data = load_dataset(str(data_path), tok, opts.seq)
    sampler = StepSampler(len(data), opts.batch, 1, 1, seed=0)
    batches = [step_batches(data, sampler, s, 0)[0] for s in range(opts.steps)]
    args = TrainArgs(job_id="bench", output_dir=str(tmp / "out"), training_path=str(data_path), model=opts.model,
                     model_path=model_dir, micro_batch_size=opts.batch, max_seq_length=opts.seq, learning_rate=1e-4,
                     checkpoint_every_steps=10**6, telemetry_every_steps=1, memory_trace_every_steps=10)
    plain, ours = [], []
    for _ in range(opts.rounds):
        plain.append(plain_loop(model_dir, batches, 1e-4))
        ours.append(memfit_loop(args, opts.steps))
    print(f"model {opts.model}, batch {opts.batch} x seq {opts.seq}, {opts.steps} steps, {opts.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")
    print(f"plain PyTorch loop : {max(plain):10.0f} tokens/s   (rounds: {', '.join(f'{x:.0f}' for x in plain)})")
    print(f"memfit train_ddp   : {max(ours):10.0f} tokens/s   (rounds: {', '.join(f'{x:.0f}' for x in ours)})")
    print(f"ratio memfit/plain : {max(ours) / max(plain):.3f}   (telemetry every step, trace every 10 steps + step 3)")


if __name__ == "__main__":
    main()
