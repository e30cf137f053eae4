"""Serving overhead: tokens/s and time to first token of a model served on Ray Serve (workers/serving.py,
through Serve's HTTP proxy, streamed) against ``transformers``' ``generate`` on the same model and adapter
in this process; and, on the served model, several adapters mixed in one batch against one adapter.

    .venv/bin/python bench/serving.py [--preset small-llama] [--rounds 5] [--tokens 64] [--adapters 4] [--concurrency 4]

It starts a local Ray head of its own (stopped at the end), deploys the base's application as memfit does
(service/scheduler/serve_apps.py) with random LoRA adapters written to a temporary folder, and prints per
round, then the median and the spread (min–max) of each figure and the ratios:

- single request: time to first token (ms) and decode tokens/s, served vs in-process ``generate``
  (greedy, ``--tokens`` new tokens, end-of-sequence ignored so both produce exactly that many);
- ``--concurrency`` requests at once, each on its own adapter (one batch mixing them) vs all on one
  adapter: aggregate tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = [{"role": "user", "content": "Tell me about the weather in the mountains."}]


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def write_adapters(base: str, folder: Path, n: int) -> list[str]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                    peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.save_pretrained(folder / f"adapter-{i}")
        out.append(str(folder / f"adapter-{i}"))
    return out


def in_process(base: str, adapter: str, tokens: int, rounds: int, threads: int) -> tuple[list[float], list[float]]:
    """(time to first token in ms, decode tokens/s) per round, transformers' generate with the adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from workers.models import load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = {"do_sample": False, "pad_token_id": tok.pad_token_id}
    ttft, tps = [], []
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=4, **kw)  # warm
        for _ in range(rounds):
            t = time.perf_counter()
            model.generate(**ids, max_new_tokens=1, **kw)
            first = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
            total = time.perf_counter() - t
            new = out.shape[1] - ids["input_ids"].shape[1]
            ttft.append(first * 1000)
            tps.append((new - 1) / max(1e-9, total - first))
    return ttft, tps


async def served_once(http: httpx.AsyncClient, url: str, model_id: str, adapter: str, tokens: int) -> tuple[float, float, int]:
    """(ms to the first token, seconds in all, tokens) of one streamed request to the served application."""
    import json

    body = {"kind": "chat", "messages": QUESTION, "n": 1, "adapter_path": adapter,
            "sampling": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    t = time.perf_counter()
    first = None
    count = 0
    async with http.stream("POST", url, json=body, headers={"serve_multiplexed_model_id": model_id}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            if event["event"] == "delta" and first is None:
                first = time.perf_counter() - t
            if event["event"] == "end":
                count = event["completion_tokens"]
            if event["event"] == "error":
                raise RuntimeError(event)
    return (first or 0) * 1000, time.perf_counter() - t, count


async def served(url: str, adapters: list[str], tokens: int, rounds: int, concurrency: int):
    async with httpx.AsyncClient(timeout=300) as http:
        for i, a in enumerate(adapters):  # load every adapter once (first-request loads are not measured)
            await served_once(http, url, f"bench-{i}", a, 2)
        ttft, tps = [], []
        for _ in range(rounds):
            first, total, n = await served_once(http, url, "bench-0", adapters[0], tokens)
            ttft.append(first)
            tps.append((n - 1) / max(1e-9, total - first / 1000))
        mixed, single = [], []
        for _ in range(rounds):
            for which, sink in (("mixed", mixed), ("single", single)):
                picks = [i % len(adapters) if which == "mixed" else 0 for i in range(concurrency)]
                t = time.perf_counter()
                results = await asyncio.gather(*(served_once(http, url, f"bench-{i}", adapters[i], tokens) for i in picks))
                sink.append(sum(r[2] for r in results) / (time.perf_counter() - t))
        stats = (await http.get(url)).json()
    return ttft, tps, mixed, single, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in this process and in the replica")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = Path(tempfile.mkdtemp(prefix="memfit-bench-serving-"))
    os.environ.setdefault("MEMFIT_PRESET_CACHE", str(tmp / "presets"))
    from service.scheduler.local_head import LocalRayHead
    from service.scheduler.ray_jobs import RayJobs
    from service.scheduler.serve_apps import AppSpec, ServeApps, ServeOptions
    from workers.models import build_preset

    model = f"preset:{args.preset}"
    base = str(build_preset(model))
    adapters = write_adapters(base, tmp, args.adapters)
    ttft_local, tps_local = in_process(base, adapters[0], args.tokens, args.rounds, args.threads)

    head = LocalRayHead(num_cpus=4, log_path=tmp / "head.log").start()
    try:
        jobs = RayJobs(head.dashboard_url)
        options = ServeOptions(min_replicas=1, max_batch=max(8, args.concurrency), max_adapters=max(8, args.adapters),
                               threads=args.threads, replica_cpus=1)
        apps = ServeApps(head.dashboard_url, options, py_modules=jobs.code_packages)

        async def run():
            try:
                t = time.perf_counter()
                url = await apps.ensure(AppSpec(model=model))
                started = time.perf_counter() - t
                return started, await served(url, adapters, args.tokens, args.rounds, args.concurrency)
            finally:
                await apps.close()

        started, (ttft_srv, tps_srv, mixed, single, stats) = asyncio.run(run())
    finally:
        head.stop()

    print(f"model {model} ({stats['weights_bytes'] / 2**20:.1f} MiB of fp32 weights), {args.tokens} new tokens, "
          f"{args.rounds} rounds, {args.threads} torch threads; application start {started:.1f} s")
    print(f"time to first token, ms: served {spread(ttft_srv)}  in-process generate {spread(ttft_local)}  "
          f"ratio {statistics.median(ttft_srv) / statistics.median(ttft_local):.2f}")
    print(f"decode tokens/s:         served {spread(tps_srv)}  in-process generate {spread(tps_local)}  "
          f"ratio {statistics.median(tps_srv) / statistics.median(tps_local):.2f}")
    print(f"{args.concurrency} requests at once, aggregate tokens/s: {args.adapters} adapters mixed {spread(mixed)}  "
          f"one adapter {spread(single)}  ratio {statistics.median(mixed) / statistics.median(single):.2f}")
    print(f"replica: {stats['batches']} batches, largest {stats['max_rows']} rows mixing {stats['max_adapters_in_batch']} "
          f"adapters; RSS {stats['rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
