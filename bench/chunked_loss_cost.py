"""What the chunked cross-entropy (training.loss_chunk_tokens) costs in step time: one forward + backward
of the same micro-batch through workers/steps.py forward_loss_sum, plain and chunked, alternating, on
one process; the median of the per-round ratios chunked / plain with their min–max.

    .venv/bin/python bench/chunked_loss_cost.py [--model preset:small-llama] [--seq 512] [--batch 4] [--chunk 512]

The expected cost is the LM head's forward run twice: 2·T·h·V more flops in a step of about 6·T·P,
i.e. h·V / (3·P) — printed beside the measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="preset:small-llama")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per round and variant")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from workers import steps as W
    from workers.args import TrainArgs
    from workers.models import build_preset
    from workers.strategies.common import build_model

    model_dir = str(build_preset(a.model))
    models = {}
    for name, chunk in (("plain", None), ("chunked", a.chunk)):
        args = TrainArgs(job_id="cost", output_dir="/tmp/unused", training_path="-", model=a.model,
                         loss_chunk_tokens=chunk)
        torch.manual_seed(0)
        models[name] = build_model(args, model_dir).train()
    ids = torch.randint(0, models["plain"].config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    cpu = torch.device("cpu")

    def timed(model) -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            W.forward_loss_sum(model, batch, cpu, None).backward()
            model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / a.steps

    for m in models.values():  # warm-up
        timed(m)
    ratios, plain_s, chunked_s = [], [], []
    for r in range(a.rounds):
        order = ("plain", "chunked") if r % 2 == 0 else ("chunked", "plain")
        t = {name: timed(models[name]) for name in order}
        plain_s.append(t["plain"])
        chunked_s.append(t["chunked"])
        ratios.append(t["chunked"] / t["plain"])
    cfg = models["plain"].config
    P = sum(p.numel() for p in models["plain"].parameters())
    expected = cfg.hidden_size * cfg.vocab_size / (3 * P)
    print(f"{a.model}: batch {a.batch} x seq {a.seq}, chunks of {a.chunk} tokens, fp32, {torch.get_num_threads()} threads, "
          f"{a.rounds} rounds of {a.steps} steps")
    print(f"  plain {statistics.median(plain_s) * 1e3:.0f} ms, chunked {statistics.median(chunked_s) * 1e3:.0f} ms per "
          f"forward+backward; chunked / plain {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}–{max(ratios):.3f}); expected from flops 1 + h·V/(3·P) = {1 + expected:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
