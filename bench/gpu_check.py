"""The planner against a real GPU, in one command: predicted vs measured for a random-init ~1B Llama.

    .venv/bin/python bench/gpu_check.py                        # one CUDA GPU (H100 80 GB or H200): < 8 min
    .venv/bin/python bench/gpu_check.py --only lora,qlora      # some configs
    .venv/bin/python bench/gpu_check.py --json gpu.json        # also keep every row
    .venv/bin/python bench/gpu_check.py --dry-run              # the same code paths on CPU, a tiny Llama (~1 min)

NOT YET RUN ON A GPU: it was written where none was lent; only ``--dry-run`` has run (on CPU).

The model is Llama-3.2-1B's shape (hidden 2048, 16 layers, GQA 32:8, vocab 128,256, tied embeddings,
1.24B parameters) built from a LlamaConfig with random weights and saved once (no hub, no tokenizer:
batches are random token ids, every position a label), at seq 2048, micro-batch 1, AdamW. Each config
runs in a fresh process (so the allocator's peaks and caches are its own) through the workers' own setup
and step code — workers/strategies/common.py build_model (PEFT, QLoRA's 4-bit base via
workers/peft_setup.py, the chunked loss head), workers/strategies/deepspeed.py deepspeed_config,
workers/steps.py accumulate_gradients / clip_and_step / make_optimizer / make_grad_scaler, the
telemetry — for ``--steps`` steps; the last step is measured on its own:

- predicted: the plan service/memory/preflight.py gives the spec (plan_for_spec; the GPU from the catalogue):
  ``live`` is the peak of live tensors (the plan's peak phase, what max_memory_allocated counts),
  ``device`` adds the planner's overhead (CUDA context and the allocator's 5%);
- allocated / reserved: torch.cuda.max_memory_allocated / max_memory_reserved over the last step;
- device-used: total − free from torch.cuda.mem_get_info after it (context, reserved cache, all of it);
- telemetry: the worker's own per-step peak record (workers/telemetry.py) of the step before;
- err%: (predicted live − allocated) / allocated, and (predicted device − device-used) / device-used.

``steps`` trains micro-batches of two rows of other lengths at every step (STEP_ROWS: padded to the longer row,
the shorter masked) and compares each step's peak with the plan of its own micro-batch (service/memory/steps.py:
the per-step comparison of GET …/memory), printed step by step under the table.

``oom`` trains an oversized config (full fp32, micro-batch 16, no checkpointing) that must run out of
memory: the worker's failure record (workers/steps.py write_failure) is completed by the job-level
post-mortem (service/memory/oom.py oom_error) and its dominant category and suggestions are printed.
``fp16`` checks that the grad scaler steps (its scale is printed). The exit status is 1 when a config
crashed (an exception, or a child that died), 0 otherwise — errors of the prediction are reported, not
judged. On CPU (``--dry-run``) "allocated" is the telemetry's exact live-tensor peak (the profiler),
reserved and device-used are not measured, and the config that needs CUDA (fp16's grad scaler)
is shown as skipped with its prediction; QLoRA runs on bitsandbytes' CPU backend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
MiB = 2**20

# Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B config.json), random weights.
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=2048, max_position_embeddings=512)

SEQ, SEQ_TINY = 2048, 256
# ``steps``: each step's two rows, as fractions of the sequence length (padded to the longer, masked when shorter)
STEP_ROWS = ((1.0, 1.0), (0.25, 0.7), (0.5, 0.5), (0.9, 0.15), (0.6, 1.0), (0.3, 0.3))

# The scale plan's shapes (bench/scale_plan.py: Llama-3.1-8B and 70B), cut to the layers one GPU holds with a full
# fine-tune's AdamW states: real widths (hidden, MLP, vocabulary) checked on a GPU when one is lent.
LLAMA_31_8B_2L = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)
LLAMA_31_70B_1L = dict(LLAMA_31_8B_2L, hidden_size=8192, intermediate_size=28672, num_hidden_layers=1,
                       num_attention_heads=64)
SCALE_MODELS = {"scale-8b-2l": ("llama31-8b-2l", LLAMA_31_8B_2L, 8192), "scale-70b-1l": ("llama31-70b-1l", LLAMA_31_70B_1L, 4096)}

# name -> (TrainArgs overrides, needs CUDA on main). Every config is one worker (world size 1).
CONFIGS: dict[str, tuple[dict, bool]] = {
    # each step a micro-batch of 2 rows of other lengths, each compared with the plan of its own micro-batch. First:
    # on CPU every config shares the process, and DeepSpeed's ZeRO-3 leaves torch patched after it (the same step
    # then measures 0.45 MiB less: --dry-run --only zero3-offload,steps)
    "steps": ({"precision": "bf16", "micro_batch_size": 2}, False),
    "full-bf16": ({"precision": "bf16"}, False),
    "full-bf16-ckpt": ({"precision": "bf16", "gradient_checkpointing": True}, False),
    "lora": ({"precision": "bf16", "peft_method": "lora", "peft_r": 16}, False),
    "qlora": ({"precision": "bf16", "peft_method": "qlora", "peft_r": 16}, False),  # bitsandbytes' CPU backend
    "zero3-offload": ({"precision": "bf16", "strategy": "deepspeed", "ds_stage": 3, "ds_offload_optimizer": "cpu",
                       "ds_offload_param": "cpu"}, False),
    "chunked-loss": ({"precision": "bf16", "loss_chunk_tokens": 512}, False),
    "activation-offload": ({"precision": "bf16", "activation_offload": True}, False),
    "fp16": ({"precision": "fp16"}, True),
    "oom": ({"precision": "fp32", "micro_batch_size": 16}, False),
    # bench/scale_plan.py's configurations at their real widths (SCALE_MODELS): the full fine-tune with FSDP2's
    # regime on one GPU, checkpointing every block, one sequence of 8192 (70B: 4096) tokens
    "scale-8b-2l": ({"precision": "bf16", "strategy": "fsdp", "gradient_checkpointing": True}, False),
    "scale-70b-1l": ({"precision": "bf16", "strategy": "fsdp", "gradient_checkpointing": True}, False),
}
TINY_OVERRIDES = {"chunked-loss": {"loss_chunk_tokens": 128}, "oom": {"micro_batch_size": 2}}


# --- the spec and its plan --------------------------------------------------------------------------


def spec_body(args, on_gpu: bool, gpu: str | None) -> dict:
    """The job spec a user would submit for these TrainArgs."""
    training: dict = {
        "strategy": args.strategy, "precision": args.precision, "gradient_checkpointing": args.gradient_checkpointing,
        "hyperparameters": {"micro_batch_size": args.micro_batch_size, "max_seq_length": args.max_seq_length},
        "resources": {"num_workers": 1, **({"gpus_per_worker": 1, "gpu_type": gpu} if on_gpu else {})},
        "activation_offload": args.activation_offload,
    }
    if args.loss_chunk_tokens:
        training["loss_chunk_tokens"] = args.loss_chunk_tokens
    if args.peft_method != "none":
        training["peft"] = {"method": args.peft_method, "r": args.peft_r}
    if args.strategy == "deepspeed":
        training["deepspeed"] = {"zero_stage": args.ds_stage, "offload_optimizer": args.ds_offload_optimizer,
                                 "offload_param": args.ds_offload_param}
    if args.host_memory_budget_bytes:
        training["resources"]["host_memory_budget_bytes"] = args.host_memory_budget_bytes
    return {"model": args.model_path, "training_file": "file-gpu-check", "training": training}


def predict(args, on_gpu: bool, gpu: str | None):
    """The service's plan of this spec (preflight.plan_for_spec: what a job would store), unchecked by the
    spec's rules on purpose (a CPU dry run plans GPU-only knobs too)."""
    from service.domain.spec import JobSpec
    from service.memory.preflight import plan_for_spec
    from service.settings import Settings

    os.environ["MEMFIT_MODEL_DIRS"] = str(Path(args.model_path).parent)
    spec = JobSpec.model_validate(spec_body(args, on_gpu, gpu))
    settings = Settings()
    return spec, settings, plan_for_spec(spec, settings, gpu if on_gpu else None, model_path=args.model_path)


def gpu_name(device_name: str) -> str:
    """The catalogue's name of this GPU (service/memory/gpus.py)."""
    name = device_name.lower()
    if "h200" in name:
        return "h200-141gb"
    if "h100" in name:
        return "h100-80gb"
    if "a100" in name:
        return "a100-80gb" if "80" in name else "a100-40gb"
    raise SystemExit(f"no catalogue entry for {device_name!r}: pass --gpu NAME (service/memory/gpus.py)")


# --- one config, in its own process -------------------------------------------------------------------


def _batches(args, vocab: int, step: int, rows: tuple[int, ...] | None = None) -> list[dict]:
    """One micro-batch of random ids; ``rows``: each row's tokens (right-padded to the longest, as collate pads)."""
    import torch

    g = torch.Generator().manual_seed(step)
    if rows is None:
        ids = torch.randint(0, vocab, (args.micro_batch_size, args.max_seq_length), generator=g)
        return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    width = max(rows)
    ids = torch.randint(0, vocab, (len(rows), width), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(rows):
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids, "attention_mask": mask, "labels": labels}]


def step_rows(args, step: int) -> tuple[int, ...]:
    """``steps``' rows of a step (1-based), cycling through STEP_ROWS."""
    return tuple(max(8, int(f * args.max_seq_length)) for f in STEP_ROWS[(step - 1) % len(STEP_ROWS)])


def config_args(name: str, model_dir: str, on_gpu: bool, steps: int, tiny: bool, workdir: str):
    """The TrainArgs of config ``name``."""
    from workers.args import TrainArgs

    overrides = {**CONFIGS[name][0], **(TINY_OVERRIDES.get(name, {}) if tiny else {})}
    out_dir = str(Path(workdir) / "runs" / name)  # the worker's output_dir: an OOM record lands here
    seq = SEQ_TINY if tiny else (SCALE_MODELS[name][2] if name in SCALE_MODELS else SEQ)
    args = TrainArgs(**{**dict(job_id=f"gpu-check-{name}", output_dir=out_dir, training_path="-", model="gpu-check",
                               model_path=model_dir, micro_batch_size=1, max_seq_length=seq,
                               max_steps=steps, learning_rate=1e-5, telemetry_every_steps=1,
                               memory_trace_every_steps=0 if on_gpu else 1), **overrides})
    if name == "oom" and not on_gpu:  # a CPU worker runs out of its host budget instead (workers/telemetry.py)
        args.host_memory_budget_bytes = 64 * MiB
    return args


def predicted_row(name: str, args, on_gpu: bool, gpu: str | None, device_name: str):
    """(row with the prediction, spec, settings, plan)."""
    spec, settings, plan = predict(args, on_gpu, gpu)
    overhead = plan.per_rank.device.overhead
    row = {"config": name, "device": device_name, "predicted_live_bytes": plan.peak_bytes - overhead,
           "predicted_device_bytes": plan.peak_bytes, "predicted_host_bytes": plan.per_rank.host.total,
           "predicted_phase": plan.peak_phase, "fits": plan.fits}
    return row, spec, settings, plan


def run_config(name: str, model_dir: str, device_name: str, steps: int, tiny: bool, gpu: str | None,
               workdir: str) -> dict:
    """Train ``name`` for ``steps`` steps with the workers' own code; the last step measured alone."""
    import torch

    from workers import steps as W
    from workers.strategies.common import autocast_dtype, build_model, training_regime

    needs_cuda = CONFIGS[name][1]
    device = torch.device(device_name)
    on_gpu = device.type == "cuda"
    args = config_args(name, model_dir, on_gpu, steps, tiny, workdir)
    row, spec, settings, plan = predicted_row(name, args, on_gpu, gpu, device_name)
    if needs_cuda and not on_gpu:
        row["skipped"] = "needs CUDA (fp16's grad scaler: workers/steps.py make_grad_scaler)"
        return row
    t0 = time.perf_counter()
    torch.manual_seed(0)
    env = W.WorkerEnv(0, 1, device)
    if args.strategy == "fsdp":  # the scale plan's configs: FSDP2 as the workers build it, its weights read per rank
        import torch.distributed as dist

        from workers.local import _free_port
        from workers.strategies.common import materialize
        from workers.strategies.fsdp import shard_fsdp2
        from workers.telemetry import PhaseMeter

        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(k, v)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
        meter = PhaseMeter(0, device)
        with meter.measure("load", 0):
            model = build_model(args, model_dir, on_meta=True)
            model = shard_fsdp2(model, device, 1, regime=training_regime(args), reshard_after_forward=True,
                                cpu_offload=False)
            materialize(model, model_dir, device)
        load = meter.records()[0]
        row["load_host_bytes"] = load["process_rss_bytes"]
        row["load_device_bytes"] = load["device"].get("max_memory_allocated")
        row["predicted_load_device_bytes"] = plan.job_phases.phases["load"].device_bytes if plan.job_phases else None
    else:
        model = build_model(args, model_dir)
    engine = None
    if args.strategy == "deepspeed":
        from service.domain.training import deepspeed_buckets
        from workers.models import hidden_size
        from workers.strategies.deepspeed import deepspeed_config, skip_shm_build

        if not on_gpu:
            skip_shm_build()
        import deepspeed

        from workers.local import _free_port

        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            os.environ.setdefault(k, v)  # one process of one: DeepSpeed still wants a process group

        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        config = deepspeed_config(
            stage=args.ds_stage, micro_batch_size=args.micro_batch_size, accumulation=1, world_size=1,
            lr=args.learning_rate, weight_decay=0.0, max_grad_norm=args.max_grad_norm, regime=training_regime(args),
            offload_optimizer=args.ds_offload_optimizer, offload_param=args.ds_offload_param,
            buckets=deepspeed_buckets(hidden_size(model)), on_cpu=not on_gpu)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
        amp, scaler, tel_model = None, None, engine.module
        offload = {"optimizer": args.ds_offload_optimizer, "param": args.ds_offload_param}
    else:
        if args.peft_method != "qlora" and args.strategy != "fsdp":  # QLoRA's base is loaded onto the GPU by from_pretrained
            model = model.to(device)
        optimizer = W.make_optimizer(model, args.learning_rate, 0.0)
        scheduler = W.warmup_cosine(optimizer, 0, steps)
        scaler = W.make_grad_scaler(args.precision, device)
        amp = autocast_dtype(training_regime(args))
        tel_model = model
        offload = {"optimizer": "none", "param": "none"}
    tel = W.make_telemetry(args, env, tel_model, optimizer, args.strategy, offload)
    tel.plan = plan.model_dump(mode="json")
    vocab = model.config.vocab_size
    (engine or model).train()

    rows_of = (lambda step: step_rows(args, step)) if name == "steps" else (lambda step: None)

    def one_step(step: int, telemetry) -> None:
        where = {"phase": "forward"}
        try:
            if telemetry is not None:
                telemetry.begin_step(step)
            kw = dict(device=device, world_size=1, tel=telemetry, where=where,
                      offload_activations=args.activation_offload)
            if engine is not None:
                W.accumulate_gradients(engine, _batches(args, vocab, step), backward=lambda loss: engine.backward(
                    loss, scale_wrt_gas=False), **kw)
                where["phase"] = "optimizer"
                engine.step()
            else:
                W.accumulate_gradients(model, _batches(args, vocab, step, rows_of(step)), amp_dtype=amp, scaler=scaler,
                                       **kw)
                where["phase"] = "optimizer"
                W.clip_and_step(model, optimizer, scheduler, args.max_grad_norm, scaler)
            if telemetry is not None:
                telemetry.mark("optimizer")
        except W.OOM_ERRORS as exc:
            row["oom"] = _post_mortem(args, env, exc, step, where["phase"], telemetry or tel, spec, settings, plan)
            raise

    if name == "steps":  # every step measured, each against the plan of its own micro-batch
        row["steps"] = per_step(args, spec, plan, one_step, tel, device, max(steps, len(STEP_ROWS) + 2))
        row["seconds"] = time.perf_counter() - t0
        return row
    try:
        for step in range(1, steps):  # warm-up: optimizer states exist from step 1's end on
            one_step(step, tel)
            records = tel.end_step(step)
            if records and records[0].get("peak_bytes"):
                row["telemetry_peak_bytes"] = int(records[0]["peak_bytes"])
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            one_step(steps, None)
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
            row.update(allocated_bytes=torch.cuda.max_memory_allocated(device),
                       reserved_bytes=torch.cuda.max_memory_reserved(device), device_used_bytes=total - free)
        else:  # the telemetry's profiler gives the exact live peak on CPU
            one_step(steps, tel)
            records = tel.end_step(steps)
            row["allocated_bytes"] = int(records[0]["peak_bytes"])
    except W.OOM_ERRORS:
        row["seconds"] = time.perf_counter() - t0
        return row
    if scaler is not None:
        row["grad_scale"] = float(scaler.get_scale())
    from workers.telemetry import process_rss_bytes

    row.update(process_rss_bytes=process_rss_bytes(), seconds=time.perf_counter() - t0)
    return row


def per_step(args, spec, plan, one_step, tel, device, steps: int) -> list[dict]:
    """``steps``: from step 3 (the optimizer states exist), each step's peak — max_memory_allocated over the step on a
    GPU, the telemetry's traced peak on CPU — against service/memory/steps.py's plan of its own micro-batch."""
    import torch

    from service.memory.step_compare import shape_of
    from service.memory.steps import StepPlanner

    sp = StepPlanner(spec, shape_of(plan), plan.gpu, plan.safety_margin)
    out = []
    for step in range(1, steps + 1):
        on_gpu = device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        one_step(step, tel)
        records = tel.end_step(step)
        if step < 3:
            continue
        if on_gpu:
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device)
        else:
            measured = records[0].get("peak_bytes") if records else None
        rows = list(step_rows(args, step))
        predicted = sp.step_live([rows])
        out.append({"step": step, "rows": rows, "predicted_live_bytes": predicted, "measured_bytes": measured,
                    "error": (predicted - measured) / measured if measured else None})
    return out


def _post_mortem(args, env, exc, step, phase, tel, spec, settings, plan) -> dict:
    """The worker's failure record, completed as the scheduler completes a job's (service/memory/oom.py)."""
    from types import SimpleNamespace

    from service.memory.oom import oom_error
    from workers.steps import write_failure

    failure = write_failure(args, env, exc, step, phase, tel)
    job = SimpleNamespace(plan=plan.model_dump(mode="json"), spec=spec.model_dump(mode="json"))
    error = oom_error(job, {k: failure[k] for k in ("code", "message", "rank", "step", "phase", "details")}, settings)
    d = error["details"]
    return {"code": error["code"], "phase": error["phase"], "step": error["step"],
            "dominant_category": d.get("dominant_category"), "used_bytes": d.get("used_bytes"),
            "suggestions": [s.get("change") for s in d.get("suggestions", [])],
            "record": str(Path(args.output_dir) / f"failure-rank{env.rank}.json")}


# --- the command ------------------------------------------------------------------------------------


def build_model_dir(root: Path, cfg: dict, device: str, sub: str = "model") -> str:
    """A random-init Llama saved with save_pretrained (bf16 weights; the workers load them as their regime
    says). Built on the device when it is a GPU: 1.2B parameters initialise in seconds there."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = root / sub
    if (out / "config.json").exists():
        return str(out)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return str(out)


def _pct(pred, meas) -> str:
    return f"{100.0 * (pred - meas) / meas:+.1f}" if pred is not None and meas else "n/a"


def _mib(x) -> str:
    return f"{x / MiB:.1f}" if x is not None else "n/a"


def print_table(rows: list[dict], out=sys.stdout) -> None:
    head = (f"{'config':<20}{'pred live':>10}{'allocated':>10}{'err%':>7}{'pred dev':>10}{'reserved':>10}"
            f"{'dev-used':>10}{'err%':>7}{'telemetry':>10}{'host pred':>10}{'s':>6}  note")
    out.write(head + "\n" + "-" * len(head) + "\n")
    for r in rows:
        note = r.get("skipped") or r.get("crash", "")[:60]
        if r.get("oom"):
            o = r["oom"]
            note = (f"OOM in {o['phase']} step {o['step']}: dominant {o['dominant_category']}, "
                    f"suggestions {', '.join(o['suggestions'][:3]) or 'none'}")
        elif r["config"] == "oom" and not r.get("crash") and not r.get("skipped"):
            note = "did NOT run out of memory"
        if r.get("grad_scale") is not None:
            note = f"grad scale {r['grad_scale']:g}"
        out.write(f"{r['config']:<20}{_mib(r.get('predicted_live_bytes')):>10}{_mib(r.get('allocated_bytes')):>10}"
                  f"{_pct(r.get('predicted_live_bytes'), r.get('allocated_bytes')):>7}"
                  f"{_mib(r.get('predicted_device_bytes')):>10}{_mib(r.get('reserved_bytes')):>10}"
                  f"{_mib(r.get('device_used_bytes')):>10}"
                  f"{_pct(r.get('predicted_device_bytes'), r.get('device_used_bytes')):>7}"
                  f"{_mib(r.get('telemetry_peak_bytes')):>10}{_mib(r.get('predicted_host_bytes')):>10}"
                  f"{r.get('seconds', 0):>6.0f}  {note}\n")
    out.write("MiB; err% = (predicted − measured) / measured; live vs torch.cuda.max_memory_allocated, device vs "
              "mem_get_info's used memory (CUDA context and the allocator's cache included)\n")


def _child(a) -> int:
    """``--run-one``: one config; its row as one JSON line on stdout (after a marker)."""
    try:
        row = run_config(a.run_one, a.model_dir, a.device, a.steps, a.tiny, a.gpu, a.workdir)
    except Exception as exc:  # noqa: BLE001 - the parent reports it as the config's crash
        row = {"config": a.run_one, "crash": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    sys.stdout.write("\n@@ROW@@" + json.dumps(row, default=str) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="a tiny Llama on CPU, every config in this process")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama instead of the 1B (implied by --dry-run)")
    ap.add_argument("--only", default="", help="comma-separated config names: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per config; the last is measured")
    ap.add_argument("--gpu", default=None, help="catalogue name of the GPU (default: from the device's name)")
    ap.add_argument("--model-dir", default=None, help="reuse a model folder this command saved")
    ap.add_argument("--workdir", default=None, help="where the model and the runs' outputs go (default: a new temp folder)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--timeout-per-config", type=float, default=150.0, help="seconds before a config's process is killed")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the predictions for the 1B on --gpu (default h100-80gb) without training (no GPU needed)")
    ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if a.plan_only:
        return plan_only(a)
    if a.dry_run:
        a.device, a.tiny = a.device or "cpu", True
    a.device = a.device or ("cuda" if torch.cuda.is_available() else None)
    if a.device is None:
        ap.error("no CUDA device here: run with --dry-run (a tiny Llama on CPU) or --device cpu --tiny")
    if a.run_one:
        return _child(a)
    on_gpu = a.device.startswith("cuda")
    if on_gpu and a.gpu is None:
        a.gpu = gpu_name(torch.cuda.get_device_name(0))
    names = [n for n in CONFIGS if not a.only or n in a.only.split(",")]
    unknown = set(a.only.split(",")) - set(CONFIGS) - {""}
    if unknown:
        ap.error(f"unknown config(s) {', '.join(sorted(unknown))}; known: {', '.join(CONFIGS)}")
    t_start = time.perf_counter()
    root = Path(a.workdir or tempfile.mkdtemp(prefix="memfit-gpu-check-"))
    a.workdir = str(root)
    model_dir = a.model_dir or build_model_dir(root, TINY if a.tiny else LLAMA_1B, a.device)
    print(f"gpu_check: {'tiny Llama' if a.tiny else 'Llama-3.2-1B shape, random init'} ({model_dir}), "
          f"device {a.device}{' = ' + a.gpu if on_gpu else ''}, seq {SEQ_TINY if a.tiny else SEQ}, {a.steps} steps per "
          f"config; model saved in {time.perf_counter() - t_start:.0f} s", flush=True)
    rows = []
    dirs = {}
    for name in names:
        t0 = time.perf_counter()
        mdir = model_dir
        if name in SCALE_MODELS and not a.tiny:  # its own shape (built once, on the device)
            sub, cfg, _ = SCALE_MODELS[name]
            mdir = dirs.get(sub) or build_model_dir(root, cfg, a.device, sub)
            dirs[sub] = mdir
        if not on_gpu:  # CPU: in this process (the profiler's peaks are per step; no allocator cache to reset)
            try:
                row = run_config(name, mdir, a.device, a.steps, a.tiny, a.gpu, str(root))
            except Exception as exc:  # noqa: BLE001 - a crash is a row, and the exit status
                row = {"config": name, "crash": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
        else:
            row = _in_child(name, mdir, a)
        rows.append(row)
        status = "crashed" if row.get("crash") else ("skipped" if row.get("skipped") else "done")
        print(f"  {name}: {status} in {time.perf_counter() - t0:.0f} s", flush=True)
        if row.get("crash"):
            print(row.get("traceback", row["crash"]), file=sys.stderr)
    print_table(rows)
    for r in rows:
        for st in r.get("steps") or []:
            print(f"  steps: step {st['step']} rows {st['rows']}: predicted {_mib(st['predicted_live_bytes'])} MiB, "
                  f"measured {_mib(st['measured_bytes'])} MiB, {_pct(st['predicted_live_bytes'], st['measured_bytes'])}%")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 1 if any(r.get("crash") for r in rows) else 0


def plan_only(a) -> int:
    """The predicted columns of every config for the 1B (a config.json is all the planner reads)."""
    root = Path(a.workdir or tempfile.mkdtemp(prefix="memfit-gpu-check-"))
    model_dir = root / "model-config"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY if a.tiny else LLAMA_1B))
    gpu = a.gpu or "h100-80gb"
    rows = [predicted_row(n, config_args(n, str(model_dir), True, a.steps, a.tiny, str(root)), True, gpu, gpu)[0]
            for n in CONFIGS if not a.only or n in a.only.split(",")]
    for r in rows:
        r["skipped"] = f"plan only; peak phase {r['predicted_phase']}, {'fits' if r['fits'] else 'does NOT fit'}"
    print_table(rows)
    return 0


def _in_child(name: str, model_dir: str, a) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-one", name, "--model-dir", model_dir,
           "--workdir", a.workdir, "--device", a.device, "--steps", str(a.steps)] + (["--tiny"] if a.tiny else []) + \
          (["--gpu", a.gpu] if a.gpu else [])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_per_config, env=env)
    except subprocess.TimeoutExpired as exc:
        return {"config": name, "crash": f"timed out after {a.timeout_per_config:.0f} s",
                "traceback": (exc.stderr or b"")[-3000:] if isinstance(exc.stderr, str) else ""}
    for line in proc.stdout.splitlines():
        if line.startswith("@@ROW@@"):
            return json.loads(line[len("@@ROW@@"):])
    return {"config": name, "crash": f"the config's process exited {proc.returncode} without a row",
            "traceback": proc.stderr[-3000:]}


if __name__ == "__main__":
    sys.exit(main())
