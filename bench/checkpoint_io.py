"""FSDP2 checkpoint save and load, the full-gather ``state.pt`` path against the sharded DCP path,
at 1, 2 and 4 gloo processes: time and peak host memory per rank.

    python bench/checkpoint_io.py [--ranks 1 2 4] [--rounds 2] [--hidden 512] [--layers 6] [--vocab 32000]

The model is a random-init Llama-style model (default ~52M parameters, untied embeddings: 210 MB of
fp32 weights, 630 MB with AdamW's two states), sharded with workers.strategies.fsdp.shard_fsdp2, one
optimizer step taken so the optimizer holds its states. Each round runs the four operations of
workers/checkpoint.py — ``save_full_state`` / ``load_full_state`` (the earlier format: gathered to
rank 0, every rank reads the whole file) and ``save_sharded_state`` / ``load_sharded_state`` (DCP:
each rank writes and reads its shard) — alternating which path goes first, every rank writing into
its own folder and the sharded folders merged before the load, as Ray Train merges them.

Memory: the kernel's high-water mark of resident memory, ``VmHWM`` in /proc/self/status, reset to
the current RSS before each operation (``echo 5 > /proc/self/clear_refs``), tensors included
(tracemalloc does not see them). Two figures per rank: *held* = the high-water mark minus the RSS of
the process before it built the model (Python, torch, transformers imported: the same at every
world size) — the rank's model and optimizer state plus whatever the operation added, the host
memory a rank needs for its checkpoint; *adds* = the high-water mark minus the RSS just before the
operation. glibc's mmap threshold is pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed
tensors leave the RSS instead of lingering in the heap. Per-rank figures are the largest over the
ranks; time is the slowest rank's (every operation ends in a barrier). Medians over rounds, with the
spread (max − min).

The sharded path passes when its per-rank *held* peak at N ranks is at most its peak at 1 rank / N
plus a fixed allowance, ``--fixed-mib`` (default 100 MiB): what a rank holds whatever its shard —
the process group's and FSDP's own buffers, DCP's plan and metadata, allocator slack — measured here
at 50–90 MiB per rank (the *overhead* column: held minus the rank's share of parameters and AdamW
states, 12 bytes a parameter).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from service.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

OPS = ("save", "load")
PATHS = ("full", "sharded")


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _build(hidden: int, layers: int, vocab: int, world: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from service.domain.training import regime
    from workers.steps import clip_and_step, make_optimizer, token_loss_sum, warmup_cosine
    from workers.strategies.fsdp import shard_fsdp2

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=vocab, tie_word_embeddings=False,
                      max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = shard_fsdp2(model, torch.device("cpu"), world, regime=regime("fsdp", "none", "fp32"),
                        reshard_after_forward=True, cpu_offload=False)
    optimizer = make_optimizer(model, 1e-4, 0.0)
    scheduler = warmup_cosine(optimizer, 1, 10)
    ids = torch.randint(0, vocab, (1, 32))
    token_loss_sum(model(input_ids=ids).logits, ids).backward()
    clip_and_step(model, optimizer, scheduler, 1.0)  # the optimizer now holds exp_avg and exp_avg_sq
    return model, optimizer, scheduler, n_params


def _worker(rank: int, world: int, port: int, opts: dict, base: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from workers import checkpoint as ckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint  # noqa: F401 - imported before the baseline, like transformers
        import transformers  # noqa: F401

        gc.collect()
        rss_base = _status_kib("VmRSS") * 1024
        model, optimizer, scheduler, n_params = _build(opts["hidden"], opts["layers"], opts["vocab"], world)
        save = {"full": ckpt.save_full_state, "sharded": ckpt.save_sharded_state}
        load = {"full": ckpt.load_full_state, "sharded": ckpt.load_sharded_state}
        rows = []  # (round, path, op, seconds, adds_bytes, held_bytes)
        for rnd in range(opts["rounds"]):
            order = PATHS if rnd % 2 == 0 else PATHS[::-1]
            for path in order:
                own = Path(base, f"r{rnd}-{path}", f"rank{rank}")
                own.mkdir(parents=True)
                for op in OPS:
                    if op == "load":  # the folder every rank reads: rank 0's for state.pt, the merge for DCP
                        d = Path(base, f"r{rnd}-{path}", "rank0" if path == "full" else "merged")
                    else:
                        d = own
                    gc.collect()
                    dist.barrier()
                    rss_before = _reset_peak()
                    t0 = time.perf_counter()
                    if op == "save":
                        save[path](str(d), model, optimizer, scheduler, rank=rank, trainable_only=False)
                    else:
                        load[path](str(d), model, optimizer, scheduler, trainable_only=False)
                    dist.barrier()
                    seconds = time.perf_counter() - t0
                    hwm = _status_kib("VmHWM") * 1024
                    rows.append((rnd, path, op, seconds, hwm - rss_before, hwm - rss_base))
                    if op == "save" and path == "sharded" and rank == 0:
                        for r in range(world):  # Ray Train: every rank's folder lands in one checkpoint
                            shutil.copytree(Path(base, f"r{rnd}-{path}", f"rank{r}"),
                                            Path(base, f"r{rnd}-{path}", "merged"), dirs_exist_ok=True,
                                            copy_function=os.link)
                    dist.barrier()
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(Path(base, f"r{rnd}-{path}"))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            torch.save({"rows": gathered, "n_params": n_params}, Path(out, f"world{world}.pt"))
    finally:
        dist.destroy_process_group()


def run_world(world: int, opts: dict) -> dict:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="memfit-ckpt-bench-") as base, tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), opts, base, out), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(Path(out, f"world{world}.pt"), weights_only=False)


def summarize(result: dict, world: int) -> dict:
    """{(path, op): {"s": (median, spread), "adds": ..., "held": ...}} over rounds; per round the
    slowest rank's time and the largest rank's memory."""
    per_round: dict = {}
    for rank_rows in result["rows"]:
        for rnd, path, op, seconds, adds, held in rank_rows:
            cur = per_round.setdefault((path, op, rnd), [0.0, 0, 0])
            cur[0], cur[1], cur[2] = max(cur[0], seconds), max(cur[1], adds), max(cur[2], held)
    out: dict = {}
    for (path, op, _), (s, adds, held) in per_round.items():
        d = out.setdefault((path, op), {"s": [], "adds": [], "held": []})
        d["s"].append(s)
        d["adds"].append(adds)
        d["held"].append(held)
    return {k: {m: (statistics.median(v), max(v) - min(v)) for m, v in d.items()} for k, d in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fixed-mib", type=float, default=100.0)
    a = p.parse_args(argv)
    # Fixed, not glibc's sliding threshold: a freed tensor is unmapped, not kept in the heap (the spawned
    # ranks inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    opts = {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "rounds": a.rounds}
    results, n_params = {}, None
    for world in a.ranks:
        t0 = time.perf_counter()
        r = run_world(world, opts)
        n_params = r["n_params"]
        results[world] = summarize(r, world)
        print(f"# world {world}: {time.perf_counter() - t0:.0f} s", flush=True)
    mib = 1 << 20
    print(f"\nmodel: {n_params / 1e6:.1f}M parameters, fp32 weights {n_params * 4 / mib:.0f} MiB, "
          f"weights + AdamW states {n_params * 12 / mib:.0f} MiB; {a.rounds} rounds, median (spread)")
    print("| ranks | path | save s | load s | save held MiB/rank | load held MiB/rank | save adds MiB | "
          "load adds MiB | save overhead MiB | save held vs 1 rank | load held vs 1 rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    base = a.ranks[0]
    for world in a.ranks:
        for path in PATHS:
            r = results[world]
            cells = [f"{r[(path, op)]['s'][0]:.2f} ({r[(path, op)]['s'][1]:.2f})" for op in OPS]
            cells += [f"{r[(path, op)][m][0] / mib:.0f} ({r[(path, op)][m][1] / mib:.0f})"
                      for m in ("held", "adds") for op in OPS]
            cells.append(f"{(r[(path, 'save')]['held'][0] - n_params * 12 / world) / mib:.0f}")
            for op in OPS:
                ratio = r[(path, op)]["held"][0] / max(results[base][(path, op)]["held"][0], 1)
                verdict = ""
                if path == "sharded" and world != base:
                    held_base = results[base][(path, op)]["held"][0]
                    limit = (held_base * base / world + a.fixed_mib * mib) / held_base
                    passed = ratio <= limit
                    ok &= passed
                    verdict = f" {'PASS' if passed else 'FAIL'} (≤ {limit:.2f})"
                cells.append(f"{ratio:.2f}{verdict}")
            print(f"| {world} | {path} | " + " | ".join(cells) + " |")
    print(f"\nsharded per-rank held peak ≤ (peak at {base} rank) × {base}/N + {a.fixed_mib:.0f} MiB: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
