"""Host memory while each rank loads its share of a model and while rank 0 exports it, for a Llama-shaped model
saved as bf16 safetensors, trained over HTTP through Ray on 2 ranks under FSDP2 + LoRA, DeepSpeed ZeRO-3 + LoRA
and a 2-stage pipeline + LoRA — measured from outside the worker processes and by memfit's own phase telemetry.

    .venv/bin/python bench/load_memory.py                      # 1.1B parameters (hidden 2048, 16 layers): ~10 min
    .venv/bin/python bench/load_memory.py --size small         # ~150M parameters: what tests/test_load_memory.py runs
    .venv/bin/python bench/load_memory.py --only fsdp --json out.json

The model: a LlamaConfig (untied embeddings, vocabulary 32 000, GQA 4:1) whose weights are written straight to
bf16 safetensors files tensor by tensor (random normal, std 0.02; the norms 1), with a byte-level BPE tokenizer
(workers/models.py train_tokenizer): never a whole model in memory here either. The service is memfit's own
(service/cli/embedded.py: the API, the scheduler, a local Ray head), the jobs posted over HTTP.

Measured, per rank, for the *load* phase (workers/telemetry.py PhaseMeter: from the start of the model's build to
the last weight read):

- *sampler*: the worker process's resident memory (``/proc/<pid>/status`` VmRSS) read from this process every
  10 ms — from outside, whatever the worker believes — its highest value inside the phase's window;
- *telemetry*: what the worker itself reported for the phase: the kernel's high-water mark of its resident memory
  (VmHWM, reset when the phase starts).
They agree when the sampler's value is at most the telemetry's (a sampler can only miss a peak) and within 5 % of
it, or within the loader's 64 MiB staging buffer; or, where the peak fell in the phase's last interval after the
sampler's last reading inside it, when its first reading after the phase (before the worker's next reset of VmHWM,
which carries that peak) is within as much above the telemetry's. The *bound* each must stay under is the
issue's: (checkpoint bytes ÷ ranks) + the largest block + 1 GiB, the largest block being the larger of the largest
tensor and the largest decoder layer, in the checkpoint's dtype.

For the *export* (rank 0; the merged model streamed from the base's files, workers/export.py): the peak above the
process's resident memory when the export started, against the largest block + 1 GiB; and the merged folder
loaded with ``from_pretrained`` gives the logits of the base with the trained adapter (peft), in fp32, within
bf16's rounding of the merged weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB, MiB = 2**30, 2**20
DATA = ROOT / "examples" / "data"

SIZES = {
    # 1.1B: Llama-3.2-1B's layer shapes (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 key/value heads), untied
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    # ~150M: the CI test's
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=8000),
}
STRATEGIES = {
    "fsdp": {"strategy": "fsdp"},
    "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "pipeline": {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "1f1b"}},
}


def llama_config(size: str) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=2048,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
                dtype="bfloat16", **SIZES[size])


def write_model(out: Path, size: str, seed: int = 0) -> dict:
    """A Llama of ``size`` saved as bf16 safetensors in ``out``, written a tensor at a time; returns its
    parameter count, checkpoint bytes and largest block."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from workers.export import ShardedWriter, TensorSpec
    from workers.models import train_tokenizer

    cfg = llama_config(size)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    config.architectures = ["LlamaForCausalLM"]
    tokenizer = train_tokenizer(cfg["vocab_size"], cfg["max_position_embeddings"])
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    specs = [TensorSpec(n, torch.bfloat16, tuple(t.shape)) for n, t in meta.state_dict().items()]
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    writer = ShardedWriter(out, specs)
    for s in specs:
        if "norm" in s.name:
            t = torch.ones(s.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(s.shape, generator=g) * 0.02).to(torch.bfloat16)
        writer.add(s.name, t)
        del t
    writer.close()
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model_facts(out)


def model_facts(model_dir: Path) -> dict:
    from workers.weights import Checkpoint

    with Checkpoint(model_dir) as ckpt:
        layer: dict[str, int] = {}
        for e in ckpt.entries.values():
            if ".layers." in e.name:
                key = e.name.split(".layers.")[1].split(".")[0]
                layer[key] = layer.get(key, 0) + e.nbytes
        largest_tensor = max(e.nbytes for e in ckpt.entries.values())
        return {"parameters": sum(e.numel for e in ckpt.entries.values()), "checkpoint_bytes": ckpt.total_bytes,
                "largest_tensor_bytes": largest_tensor, "largest_layer_bytes": max(layer.values(), default=0),
                "largest_block_bytes": max(largest_tensor, max(layer.values(), default=0))}


def load_bound(facts: dict, ranks: int) -> int:
    """The issue's bound on a rank's host memory while it loads: checkpoint ÷ ranks + largest block + 1 GiB."""
    return facts["checkpoint_bytes"] // ranks + facts["largest_block_bytes"] + GiB


def export_bound(facts: dict) -> int:
    """What a merged export may add to rank 0's resident memory: the largest block + 1 GiB."""
    return facts["largest_block_bytes"] + GiB


_SAMPLER = r"""
import os, sys, time
interval, match, out = float(sys.argv[1]), sys.argv[2].encode(), sys.argv[3]
try:  # ahead of the workers it watches: on a loaded machine a sampler that waits for a core misses short peaks
    os.setpriority(os.PRIO_PROCESS, 0, -10)
except OSError:
    pass  # not root: the default priority
def pids():
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if match in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found
def rss(pid):
    # (the resident memory now, the larger of it and the kernel's high-water mark since the worker last reset it (at a
    # phase's start): a peak shorter than the interval (a shard's fp32 staging copy lives a few ms) is kept by
    # the kernel until read, so the outside reading cannot miss it; before the reset it may carry an older peak,
    # which is why only samples inside the phase's window, or up to its next reset, count)
    try:
        got = {}
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"VmRSS:", b"VmHWM:")):
                    got[line[:5]] = int(line.split()[1]) * 1024
        return (got[b"VmRSS"], max(got.values())) if b"VmRSS" in got else None
    except OSError:
        return None
with open(out, "w", buffering=1) as f:
    found, at = [], 0.0
    while True:
        now = time.time()
        if now - at > 0.1:
            found, at = pids(), now
        for pid in found:
            t = time.time()  # before the read: a sample stamped inside a phase was read after its reset
            b = rss(pid)
            if b is not None:
                f.write(f"{pid} {t:.4f} {b[1]} {b[0]}\n")
        time.sleep(interval)
"""


class RssSampler:
    """The resident memory of Ray Train's worker processes, read from outside every ``interval_s`` by a process of
    its own (no thread of this one, whose GIL the service's threads share): per pid, a list of (time, the larger of
    VmRSS and VmHWM, VmRSS)."""

    def __init__(self, interval_s: float = 0.01, match: str = "RayTrainWorker"):
        import tempfile

        self.interval_s, self.match = interval_s, match
        self.path = tempfile.mktemp(prefix="memfit-rss-", suffix=".txt")
        self._proc = None

    def start(self) -> "RssSampler":
        import subprocess

        self._proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(self.interval_s), self.match, self.path])
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)

    @property
    def samples(self) -> dict[int, list[tuple[float, int, int]]]:
        out: dict[int, list[tuple[float, int, int]]] = {}
        try:
            with open(self.path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 4:
                        out.setdefault(int(parts[0]), []).append((float(parts[1]), int(parts[2]), int(parts[3])))
        except OSError:
            pass
        return out

    def peak(self, pid: int, start: float, end: float) -> int | None:
        vals = [b for t, b, _ in self.samples.get(pid, []) if start <= t <= end]
        return max(vals) if vals else None

    def first_after(self, pid: int, end: float, until: float) -> tuple[int, int] | None:
        """The first reading after ``end`` and before ``until`` (the worker's next reset of its high-water mark),
        as (high-water mark, resident now): the mark carries the phase's peak even when no reading fell between
        that peak and the phase's end, and whatever the process took since the end, which it still holds."""
        for t, b, now in self.samples.get(pid, []):
            if end < t < until:
                return b, now
        return None


def rss_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def phase_samples(view: dict, phase: str) -> dict[int, dict]:
    """Each rank's sample of ``phase`` from GET …/memory (the raw samples: a short job's are all there)."""
    out = {}
    for rank, entries in (view.get("samples") or {}).items():
        for e in entries:
            if e.get("phase") == phase:
                out[int(rank)] = e
    return out


def next_reset(view: dict, rank: int, after: float, default_s: float = 1.0) -> float:
    """When ``rank``'s worker next reset its high-water mark after ``after``: the start of its next measured
    phase (workers/telemetry.py PhaseMeter is the only reset), or ``default_s`` later where none followed."""
    starts = [e["device"]["started_at"] for e in (view.get("samples") or {}).get(str(rank), [])
              if isinstance(e.get("device"), dict) and e["device"].get("started_at", 0) > after]
    return min(starts) if starts else after + default_s


def job_body(model_dir: Path, strategy: dict, train_id: str, valid_id: str, steps: int) -> dict:
    return {"model": str(model_dir), "training_file": train_id, "validation_file": valid_id, "training": {
        **strategy, "precision": "bf16", "peft": {"method": "lora", "r": 8, "merge": True},
        "hyperparameters": {"max_steps": steps, "micro_batch_size": 2, "max_seq_length": 32,
                            "learning_rate": 1e-3},
        "resources": {"num_workers": 2}, "checkpoint_every_steps": steps, "telemetry_every_steps": 1,
        "memory_trace_every_steps": 1000}}


def measure_job(http, sampler: RssSampler, facts: dict, body: dict, timeout_s: float = 1800) -> dict:
    """Post one job, wait for it, and compare its load and export phases with the sampler and the bounds."""
    r = http.post("/v1/fine_tuning/jobs", json=body)
    r.raise_for_status()
    job_id = r.json()["id"]
    deadline = time.time() + timeout_s
    while True:
        job = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        if time.time() > deadline:
            raise TimeoutError(f"{job_id} still {job['status']} after {timeout_s:.0f} s")
        time.sleep(1.0)
    if job["status"] != "succeeded":
        raise RuntimeError(f"{job_id} {job['status']}: {job.get('error')}")
    view = http.get(f"/v1/fine_tuning/jobs/{job_id}/memory").json()
    ranks = body["training"]["resources"]["num_workers"]
    bound = load_bound(facts, ranks)
    rows = []
    for rank, s in sorted(phase_samples(view, "load").items()):
        d = s["device"]
        outside = sampler.peak(d["pid"], d["started_at"], d["ended_at"])
        after = sampler.first_after(d["pid"], d["ended_at"], next_reset(view, rank, d["ended_at"]))
        rows.append({"rank": rank, "telemetry_bytes": s["process_rss_bytes"], "sampler_bytes": outside,
                     "sampler_after_bytes": after[0] if after else None, "resident_after_bytes": after[1] if after else None,
                     "bound_bytes": bound, "bytes_read": d.get("bytes_read"), "bytes_held": d.get("bytes_held"),
                     "seconds": d["ended_at"] - d["started_at"], "pid": d["pid"]})
    export = phase_samples(view, "export").get(0)
    exp = None
    if export is not None:
        d = export["device"]
        outside = sampler.peak(d["pid"], d["started_at"], d["ended_at"])
        exp = {"idle_bytes": d["rss_start_bytes"], "telemetry_bytes": export["process_rss_bytes"],
               "sampler_bytes": outside, "added_bytes": export["process_rss_bytes"] - d["rss_start_bytes"],
               "bound_added_bytes": export_bound(facts), "seconds": d["ended_at"] - d["started_at"]}
    # memfit's results.json (the result file beside OpenAI's per-step CSV) names the artefacts' folders
    (summary,) = [f for f in job["result_files"] if http.get(f"/v1/files/{f}").json()["filename"] == "results.json"]
    files = http.get(f"/v1/files/{summary}/content").json()
    return {"job_id": job_id, "load": rows, "export": exp, "artifacts": files.get("artifacts", {}),
            "planned": (view.get("phases") or {}).get("planned"), "view_phases": view.get("phases")}


def agree(row: dict, tolerance: float = 0.05, transient_bytes: int = 64 * MiB) -> bool:
    """The readings inside the phase can only miss its peak, never exceed the kernel's high-water mark, and they
    miss little: a reading carries the high-water mark since the phase's start, so only a peak in the phase's last
    interval escapes them. Where one did (a loaded machine's sampler waits for a core), the first reading after the
    phase, before the worker's next reset, carries it: the telemetry then lies between the two readings, and the
    later one is the telemetry's within the tolerance, or what the process holds at that reading (it took that
    after the phase ended)."""
    s, t, a = row.get("sampler_bytes"), row.get("telemetry_bytes"), row.get("sampler_after_bytes")
    if not (s and t and s <= t * 1.001):
        return False
    slack = max(tolerance * t, transient_bytes)
    now = row.get("resident_after_bytes") or 0
    return (t - s) <= slack or (a is not None and t * 0.999 <= a <= max(t, now) + slack)


def logits_match(model_dir: Path, artifacts: dict) -> dict:
    """The merged folder's logits against the base + trained adapter (peft), both in fp32, one after the other."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, artifacts["adapter"]).eval()
        want = adapted(input_ids=ids).logits
        del adapted, base
        merged = AutoModelForCausalLM.from_pretrained(artifacts["merged"], dtype=torch.float32).eval()
        dtypes = {p.dtype for p in AutoModelForCausalLM.from_pretrained(artifacts["merged"]).parameters()}
        got = merged(input_ids=ids).logits
        del merged
    diff = float((got - want).abs().max())
    scale = float(want.abs().max())
    return {"max_abs_diff": diff, "logit_scale": scale, "relative": diff / scale,
            "merged_dtypes": sorted(str(d) for d in dtypes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--only", default="", help="comma-separated: " + ", ".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--model-dir", default=None, help="reuse a model folder this command wrote")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-logits", action="store_true", help="skip the merged export's logits check")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import httpx

    from service.cli.embedded import EmbeddedService, quiet_logging
    from service.settings import Settings
    from service.store.auth import create_key
    from service.store.db import session_scope

    work = Path(a.workdir or tempfile.mkdtemp(prefix="memfit-load-memory-"))
    models = work / "models"
    t0 = time.time()
    model_dir = Path(a.model_dir) if a.model_dir else models / f"llama-{a.size}"
    if (model_dir / "config.json").exists():
        facts = model_facts(model_dir)
    else:
        facts = write_model(model_dir, a.size)
    print(f"model: {facts['parameters'] / 1e9:.2f}B parameters, bf16 checkpoint {facts['checkpoint_bytes'] / GiB:.2f} "
          f"GiB, largest block {facts['largest_block_bytes'] / MiB:.0f} MiB ({model_dir}, written in "
          f"{time.time() - t0:.0f} s)", flush=True)
    quiet_logging(work / "service.log")
    settings = Settings(database_url=f"sqlite:///{work}/memfit.db", storage_dir=work / "storage",
                        model_dirs=[model_dir.parent], poll_seconds=0.3)
    service = EmbeddedService(settings, log_dir=work).start()
    sampler = RssSampler().start()
    results = {"facts": facts, "size": a.size, "jobs": {}}
    try:
        with session_scope(service.app.state.sessions) as s:
            key = create_key(s, "bench").key
        http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        ids = []
        for name in ("text.jsonl", "text.jsonl"):  # plain text: every token a label, at 32 tokens too
            with (DATA / name).open("rb") as f:
                ids.append(http.post("/v1/files", files={"file": (name, f)}, data={"purpose": "fine-tune"}).json()["id"])
        names = [n for n in STRATEGIES if not a.only or n in a.only.split(",")]
        for name in names:
            t1 = time.time()
            print(f"{name}: training over HTTP …", flush=True)
            res = measure_job(http, sampler, facts, job_body(model_dir, STRATEGIES[name], ids[0], ids[1], a.steps))
            if not a.no_logits and "merged" in res["artifacts"]:
                res["logits"] = logits_match(model_dir, res["artifacts"])
            res["seconds"] = time.time() - t1
            results["jobs"][name] = res
            print_job(name, res)
    finally:
        sampler.stop()
        service.stop()
    ok = all(all(r["telemetry_bytes"] <= r["bound_bytes"] and r["sampler_bytes"] and r["sampler_bytes"] <= r["bound_bytes"]
                 and agree(r) for r in j["load"])
             and (j["export"] is None or j["export"]["added_bytes"] <= j["export"]["bound_added_bytes"])
             for j in results["jobs"].values())
    results["pass"] = ok
    print(f"{'PASS' if ok else 'FAIL'}: every rank's load peak (sampler and telemetry) under checkpoint/ranks + "
          "largest block + 1 GiB, the two within 5 %; every export under largest block + 1 GiB above idle")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if ok else 1


def print_job(name: str, res: dict) -> None:
    m = lambda b: f"{b / MiB:8.0f}" if b is not None else "     n/a"  # noqa: E731
    print(f"  {name} ({res['job_id']}, {res['seconds']:.0f} s): load per rank, MiB")
    print("    rank   bound  sampler telemetry   agree  read/held (MiB)   s")
    for r in res["load"]:
        print(f"    {r['rank']:>4} {m(r['bound_bytes'])} {m(r['sampler_bytes'])} {m(r['telemetry_bytes'])}  "
              f"{'yes' if agree(r) else 'NO ':>6}  {m(r.get('bytes_read'))}/{m(r.get('bytes_held')).strip()}  "
              f"{r['seconds']:5.1f}")
    e = res.get("export")
    if e:
        print(f"    export (rank 0): idle {m(e['idle_bytes']).strip()}, peak {m(e['telemetry_bytes']).strip()} "
              f"(sampler {m(e['sampler_bytes']).strip()}), added {m(e['added_bytes']).strip()} ≤ bound "
              f"{m(e['bound_added_bytes']).strip()}: {'yes' if e['added_bytes'] <= e['bound_added_bytes'] else 'NO'}, "
              f"{e['seconds']:.0f} s")
    lg = res.get("logits")
    if lg:
        print(f"    merged export: dtypes {lg['merged_dtypes']}, logits vs base + adapter: max |Δ| "
              f"{lg['max_abs_diff']:.4g} of {lg['logit_scale']:.3g} ({lg['relative']:.2e})")


if __name__ == "__main__":
    sys.exit(main())
