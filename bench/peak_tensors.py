"""Which tensors are live at a traced step's peak, and which op allocated each: the tool behind the planner's terms.

    .venv/bin/python bench/peak_tensors.py --family small-llama --seq 128 --strategy fsdp2 --ckpt
    .venv/bin/python bench/peak_tensors.py --strategy pp2i --seq 512 --peft lora --precision bf16 --top 30

Runs one bench/memory_accuracy.py case (the workers' own setup and step code, real gloo ranks) and profiles
step ``--step`` with ``torch.profiler.profile(profile_memory=True, record_shapes=True)``, with the same pause
after each collective's wait that memfit's traces take (workers/telemetry.py: _CollectiveWaits). The
allocation events of the profiler's event tree are replayed by address: at the instant the step's live bytes
peak, every allocation made in the step and not yet freed is listed with its size, shape-free op chain (the
allocating op and its enclosing ranges, innermost first) and the memfit phase mark that follows it. Bytes that
were live before the step began (parameters, optimizer states, gradients kept across steps) are not in the
trace; the telemetry's categories count them. Prints one table per rank; ``--json`` keeps the raw rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20


def _chain(node, depth: int = 6) -> str:
    names = []
    p = node.parent
    while p is not None and len(names) < depth:
        names.append(p.name)
        p = p.parent
    return " < ".join(names) or "(top level)"


def live_at_peak(tree_roots) -> dict:
    """Replay every allocation node of a profiler event tree; the live set at the highest running total."""
    from torch._C._profiler import _EventType

    allocs = []
    stack = list(tree_roots)
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.tag == _EventType.Allocation:
            f = n.extra_fields
            if f.device.type == "cpu":
                allocs.append((n.start_time_ns, f.ptr, f.alloc_size, n))
    marks = []
    stack = list(tree_roots)
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.name.startswith("memfit.mark."):
            marks.append((n.start_time_ns, n.name[len("memfit.mark."):]))
    marks.sort()
    allocs.sort(key=lambda a: a[0])
    live: dict[int, tuple[int, object]] = {}
    total = peak = 0
    peak_t = None
    snapshot: dict[int, tuple[int, object]] = {}
    for t, ptr, size, node in allocs:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
        total += size
        if total > peak:
            peak, peak_t, snapshot = total, t, dict(live)
    phase = next((name for mt, name in marks if peak_t is not None and mt >= peak_t), "optimizer")
    rows = sorted(((size, node.start_tid, _chain(node)) for size, node in snapshot.values()), reverse=True)
    return {"peak_delta_bytes": peak, "phase": phase, "live": rows, "unfreed_at_end": total}


def _rank(rank: int, case, port: int, model_dir: str, step: int, q) -> None:
    try:
        import torch

        from bench import memory_accuracy as B
        from workers import telemetry as T

        captured: dict = {}
        counter = {"n": 0}

        class FullTrace(T.MemoryTrace):
            def start(self):  # noqa: D102 - the same trace, with every operator recorded for the event tree
                counter["n"] += 1
                self._full = counter["n"] == step
                if not self._full:
                    return super().start()
                if self._pause:
                    T._WAITS.install()
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True, record_shapes=True)
                self._prof.__enter__()

            def stop(self):  # noqa: D102
                if not self._full:
                    return super().stop()
                if self._pause:
                    T._WAITS.remove()
                self._prof.__exit__(None, None, None)
                res = self._prof.profiler.kineto_results
                captured.update(live_at_peak(res.experimental_event_tree()))
                return res.events()

        T.MemoryTrace = FullTrace
        records = B.run_rank(rank, case, port, model_dir, {"dir": f"/tmp/memfit-peak-{os.getpid()}"})
        tel_step = [r for r in records if r["phase"] == "step" and r["step"] == step]
        captured["telemetry_peak"] = tel_step[0]["peak_bytes"] if tel_step else None
        q.put((rank, captured, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="small-llama")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--peft", default="none", choices=("none", "lora", "qlora"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--strategy", default="fsdp2")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--loss-chunk", type=int, default=None)
    ap.add_argument("--step", type=int, default=4, help="the step to profile (>= 3: optimizer states exist)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch.multiprocessing as mp

    from bench import memory_accuracy as B
    from workers.models import build_preset

    case = B.Case(a.family, a.seq, a.peft, a.precision, a.ckpt, a.strategy, micro_batch=a.micro_batch,
                  steps=max(a.step, 3), loss_chunk=a.loss_chunk)
    model_dir = str(build_preset(f"preset:{a.family}"))
    plan = B.predict(case)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = B._free_port()
    procs = [ctx.Process(target=_rank, args=(r, case, port, model_dir, a.step, q)) for r in range(case.world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    deadline = time.time() + 900
    while len(out) < case.world and time.time() < deadline:
        try:
            rank, res, err = q.get(timeout=2.0)
        except Exception:  # noqa: BLE001 - queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                print("a rank died", [p.exitcode for p in procs])
                return 1
            continue
        if err:
            print(f"rank {rank}: {err}")
            return 1
        out[rank] = res
    for p in procs:
        p.join(timeout=30)
    print(f"{case.name}: plan {plan['peak_bytes'] / MiB:.2f} MiB at {plan.get('peak_phase')}")
    for rank in sorted(out):
        r = out[rank]
        tel = r.get("telemetry_peak")
        print(f"rank {rank}: telemetry peak {tel / MiB if tel else float('nan'):.2f} MiB; in-step peak "
              f"+{r['peak_delta_bytes'] / MiB:.2f} MiB before mark '{r['phase']}'; "
              f"{len(r['live'])} allocations live there")
        groups: dict[str, list[int]] = defaultdict(list)
        for size, tid, chain in r["live"]:
            groups[f"[tid {tid}] {chain}"].append(size)
        for chain, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[: a.top]:
            print(f"  {sum(sizes) / MiB:8.3f} MiB  x{len(sizes):<3d} {chain}")
    if a.json:
        Path(a.json).write_text(json.dumps({str(k): v for k, v in out.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
