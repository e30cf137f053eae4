"""Predicted vs measured memory per rank, over the matrix of issue 5, on this machine's CPUs.

    .venv/bin/python bench/memory_accuracy.py --quick            # a 6-config slice (~1 min)
    .venv/bin/python bench/memory_accuracy.py                    # the full 192-config matrix (~36 min)
    .venv/bin/python bench/memory_accuracy.py --save m.json      # keep the measurements
    .venv/bin/python bench/memory_accuracy.py --load m.json      # re-predict without re-measuring
    .venv/bin/python bench/memory_accuracy.py --chunked          # the chunked cross-entropy configs (10)
    .venv/bin/python bench/memory_accuracy.py --qlora            # QLoRA on a 4-bit base under DDP and FSDP2 (12)
    .venv/bin/python bench/memory_accuracy.py --filter tp2       # tensor parallel over 2 ranks (32 configs)
    .venv/bin/python bench/memory_accuracy.py --mesh             # dp2tp2: FSDP2 × TP on 4 ranks (4 configs)

Each config trains a random-init preset (small-llama, small-qwen2: hidden 256, 4 layers, vocab
8000) for 3 optimizer steps with the workers' own setup code (workers/strategies/: build_model,
shard_fsdp2, deepspeed_config; workers/steps.py: accumulate_gradients, clip_and_step, the AdamW),
2-rank cases as 2 gloo processes under torch.multiprocessing. workers/telemetry.py measures each
rank on step 3, the first steady-state step (optimizer states exist from step 2 on; FSDP2 cases run
5 steps and keep the highest of steps 3-5, since their peak varies from step to step), from the
profiler's memory events (exact live-tensor peak). The planner (service/memory/planner.py) predicts the same quantity from the spec and the config
alone. DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` and accelerate's
``calculate_maximum_sizes`` (×4 for Adam training, as ``accelerate estimate-memory`` does) are
printed beside it for the same configs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from service.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20
STRATEGIES = ("ddp1", "fsdp2", "zero2", "zero3", "zero3_offload", "pp2", "pp2i", "tp2")
PIPELINES = ("pp2", "pp2i")  # pp2i: interleaved 1F1B, two model stages per rank (blocks 0, 2 | 1, 3)
CATS = ("parameters", "gradients", "optimizer_states", "activations", "temporary")
STATES = ("parameters", "gradients", "optimizer_states")
# FSDP2 over gloo frees some unit buffers on gloo's threads, so a step's peak varies by up to a
# unit's buffers: its configs trace steps 3..5 and report the highest, the peak a job would hit.
FSDP2_STEPS = 5


@dataclass(frozen=True)
class Case:
    family: str = "small-llama"
    seq: int = 512
    peft: str = "none"  # none | lora
    precision: str = "fp32"  # fp32 | bf16
    ckpt: bool = False
    strategy: str = "ddp1"  # one of STRATEGIES
    micro_batch: int = 4
    steps: int = 3
    loss_chunk: int | None = None  # training.loss_chunk_tokens (workers/chunked_loss.py)

    @property
    def world(self) -> int:
        if self.strategy == "dp2tp2":  # two replicas (FSDP2) of a two-way tensor-parallel split
            return 4
        return 1 if self.strategy == "ddp1" else 2  # pp2, pp2i: two pipeline ranks; tp2: two tensor-parallel ranks

    @property
    def name(self) -> str:
        return (f"{self.family.split('-')[1]:5s} s{self.seq:<4d} {self.peft:4s} {self.precision} "
                f"{'ckpt' if self.ckpt else '    '} {self.strategy}"
                + (f" chunk{self.loss_chunk}" if self.loss_chunk else ""))

    def spec_body(self) -> dict:
        """The job spec a user would submit for this case."""
        strategy = _STRATEGY.get(self.strategy, "deepspeed")
        training: dict = {
            "strategy": strategy,
            "precision": self.precision,
            "gradient_checkpointing": self.ckpt,
            "hyperparameters": {"micro_batch_size": self.micro_batch, "max_seq_length": self.seq},
            "resources": {"num_workers": self.world},
        }
        if self.loss_chunk:
            training["loss_chunk_tokens"] = self.loss_chunk
        if self.peft in ("lora", "qlora"):
            training["peft"] = {"method": self.peft, "r": 8}
        if strategy == "pipeline":
            training["pipeline"] = ({"stages": 2, "schedule": "1f1b"} if self.strategy == "pp2" else
                                    {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2})
        if strategy == "tensor":
            training["tensor_parallel"] = {"size": 2}
        if strategy == "deepspeed":
            ds = {"zero_stage": 2 if self.strategy == "zero2" else 3}
            if self.strategy == "zero3_offload":
                ds.update(offload_optimizer="cpu", offload_param="cpu")
            training["deepspeed"] = ds
        return {"model": f"preset:{self.family}", "training_file": "file-bench", "training": training}


FAMILIES = ("small-llama", "small-qwen2")
_STRATEGY = {"ddp1": "ddp", "fsdp2": "fsdp", "pp2": "pipeline", "pp2i": "pipeline", "tp2": "tensor",
             "dp2tp2": "tensor"}  # the bench's names → the spec's


def chunked_matrix(families: tuple[str, ...] = FAMILIES) -> list[Case]:
    """training.loss_chunk_tokens: both families at seq 512 (2048 tokens a micro-batch, in chunks of 512),
    over the regimes the chunked head meets (fp32, autocast, LoRA + bf16, pure bf16 under FSDP2/ZeRO-3)."""
    return [Case(f, 512, p, pr, c, st, steps=FSDP2_STEPS if st == "fsdp2" else 3, loss_chunk=512)
            for f in families
            for p, pr, c, st in (("none", "fp32", False, "ddp1"), ("none", "bf16", False, "ddp1"),
                                 ("lora", "bf16", True, "ddp1"), ("none", "bf16", False, "fsdp2"),
                                 ("lora", "fp32", False, "zero3"))]


def qlora_matrix(families: tuple[str, ...] = FAMILIES) -> list[Case]:
    """QLoRA (a 4-bit NF4 base, bitsandbytes' CPU backend) under DDP and FSDP2, the strategies it runs with:
    both families, fp32 and bf16 (autocast under DDP, pure bf16 under FSDP2), with and without checkpointing."""
    ddp = [Case(f, s, "qlora", pr, c, "ddp1") for f in families
           for s, pr, c in ((512, "fp32", False), (512, "bf16", False), (512, "bf16", True), (128, "fp32", True))]
    return ddp + [Case(f, s, "qlora", pr, c, "fsdp2", steps=FSDP2_STEPS) for f in families
                  for s, pr, c in ((512, "fp32", False), (256, "bf16", True))]


def mesh_matrix(families: tuple[str, ...] = FAMILIES) -> list[Case]:
    """dp2tp2 (4 ranks: FSDP2 over two replicas of a two-way tensor-parallel split) at seq 128, full
    fine-tune and LoRA in fp32, the peaks of steps 3-5 as for FSDP2."""
    return [Case(f, 128, p, "fp32", False, "dp2tp2", steps=FSDP2_STEPS) for f in families for p in ("none", "lora")]


def matrix(quick: bool, families: tuple[str, ...] = FAMILIES) -> list[Case]:
    if quick:
        return [
            Case("small-llama", 512, "none", "fp32", False, "ddp1"),
            Case("small-llama", 512, "lora", "bf16", True, "ddp1"),
            Case("small-qwen2", 128, "none", "bf16", False, "fsdp2", steps=FSDP2_STEPS),
            Case("small-llama", 128, "none", "bf16", False, "zero2"),
            Case("small-qwen2", 128, "lora", "fp32", True, "zero3"),
            Case("small-llama", 128, "none", "bf16", False, "zero3_offload"),
        ]
    return [
        Case(f, s, p, pr, c, st, steps=FSDP2_STEPS if st == "fsdp2" else 3)
        for f, s, p, pr, c, st in itertools.product(
            families, (128, 512), ("none", "lora"), ("fp32", "bf16"), (False, True), STRATEGIES
        )
    ]


# --- measuring one case ---------------------------------------------------------------------------


def _train_args(case: Case, out_dir: str):
    from workers.args import TrainArgs

    ds_stage = {"zero2": 2, "zero3": 3, "zero3_offload": 3}.get(case.strategy, 2)
    off = "cpu" if case.strategy == "zero3_offload" else "none"
    return TrainArgs(
        job_id="bench", output_dir=out_dir, training_path="-", model=f"preset:{case.family}",
        strategy=_STRATEGY.get(case.strategy, "deepspeed"), pipeline_stages=2, pipeline_microbatches=case.micro_batch,
        precision=case.precision, gradient_checkpointing=case.ckpt, micro_batch_size=case.micro_batch,
        max_seq_length=case.seq, peft_method=case.peft, ds_stage=ds_stage, ds_offload_optimizer=off,
        ds_offload_param=off, telemetry_every_steps=1, memory_trace_every_steps=1 if case.steps > 3 else 10_000, max_steps=case.steps,
        loss_chunk_tokens=case.loss_chunk,
    )


def _batches(case: Case, vocab: int, step: int, rank: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (case.micro_batch, case.seq), generator=g)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]


def run_rank(rank: int, case: Case, port: int, model_dir: str, out: dict) -> list[dict]:
    """One rank of one case: the worker's setup, 4 steps, telemetry on every step. Returns records."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(case.world), LOCAL_WORLD_SIZE=str(case.world))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // case.world))
    from service.domain.training import deepspeed_buckets
    from workers import steps as W
    from workers import strategies as S
    from workers.models import hidden_size
    from workers.strategies.common import autocast_dtype, training_regime
    from workers.strategies.deepspeed import skip_shm_build

    args = _train_args(case, out["dir"])
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = S.build_model(args, model_dir)
    vocab = model.config.vocab_size
    engine = pp = None
    if case.strategy in PIPELINES:
        from workers.strategies.pipeline import Mesh, make_pipeline, split_model

        dist.init_process_group("gloo", rank=rank, world_size=case.world)
        mesh = Mesh(case.world, rank, 2)
        model = split_model(model, mesh.stage, 2, autocast_dtype(training_regime(args)),
                            local=2 if case.strategy == "pp2i" else 1).to(device)
        optimizer = W.make_optimizer(model, args.learning_rate, args.weight_decay)
        pp = make_pipeline(model, mesh, "1f1b", args.pipeline_microbatches, device)
        offload = {"optimizer": "none", "param": "none"}
        tel_model = model
    elif case.strategy in ("tp2", "dp2tp2"):  # workers/strategies/tensor.py's setup
        from workers.strategies.tensor import make_mesh, parallelize

        dist.init_process_group("gloo", rank=rank, world_size=case.world)
        amp = autocast_dtype(training_regime(args))
        model = parallelize(model, make_mesh(case.world, rank, 2, device), device, amp is not None)
        optimizer = W.make_optimizer(model, args.learning_rate, args.weight_decay)
        offload = {"optimizer": "none", "param": "none"}
        tel_model = model
    elif case.strategy == "ddp1":
        model = model.to(device)
        optimizer = W.make_optimizer(model, args.learning_rate, args.weight_decay)
        amp = autocast_dtype(training_regime(args))
        offload = {"optimizer": "none", "param": "none"}
        tel_model = model
    elif case.strategy == "fsdp2":
        dist.init_process_group("gloo", rank=rank, world_size=case.world)
        model = S.shard_fsdp2(model, device, case.world, regime=training_regime(args),
                              reshard_after_forward=args.fsdp_reshard_after_forward, cpu_offload=False)
        optimizer = W.make_optimizer(model, args.learning_rate, args.weight_decay)
        amp = None
        offload = {"optimizer": "none", "param": "none"}
        tel_model = model
    else:
        skip_shm_build()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = S.deepspeed_config(
            stage=args.ds_stage, micro_batch_size=args.micro_batch_size, accumulation=1, world_size=case.world,
            lr=args.learning_rate, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
            regime=training_regime(args), offload_optimizer=args.ds_offload_optimizer, offload_param=args.ds_offload_param,
            buckets=deepspeed_buckets(hidden_size(model)), on_cpu=True)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
        amp = None
        offload = {"optimizer": args.ds_offload_optimizer == "cpu", "param": args.ds_offload_param == "cpu"}
        tel_model = engine.module
    tel = W.make_telemetry(args, W.WorkerEnv(rank, case.world, device), tel_model, optimizer,
                           _STRATEGY.get(case.strategy, "deepspeed"),
                           {k: (v if isinstance(v, bool) else v == "cpu") for k, v in offload.items()})
    if pp is not None:  # the worker's loop does the same (workers/strategies/pipeline.py: train_pipeline)
        from workers.strategies.pipeline import recv_buffers

        tel.held_buffers = lambda: recv_buffers(pp)
    scheduler = None if engine is not None else W.warmup_cosine(optimizer, 0, case.steps)
    (engine or model).train()  # the worker's loop does this; HF checkpointing is off in eval mode
    records: list[dict] = []
    times = []
    for step in range(1, case.steps + 1):
        t0 = time.perf_counter()
        tel.begin_step(step)
        if pp is not None:  # every stage reads the same rows
            from workers.strategies.pipeline import pipeline_step

            pipeline_step(pp, _batches(case, vocab, step, 0), optimizer, scheduler, args.max_grad_norm, device, tel)
        elif case.strategy in ("tp2", "dp2tp2"):  # a replica's two ranks read the same rows
            from workers.strategies.tensor import clip_and_step, loss_context

            with loss_context(model, 2):  # cross-entropy on the vocabulary-sharded logits, as the worker's loop
                W.accumulate_gradients(model, _batches(case, vocab, step, rank // 2), device=device,
                                       world_size=case.world, amp_dtype=amp, tel=tel)
            clip_and_step(model, optimizer, scheduler, args.max_grad_norm)
        elif engine is None:
            W.accumulate_gradients(model, _batches(case, vocab, step, rank), device=device, world_size=case.world,
                                   amp_dtype=amp, tel=tel)
            W.clip_and_step(model, optimizer, scheduler, args.max_grad_norm)
        else:
            W.accumulate_gradients(engine, _batches(case, vocab, step, rank), device=device, world_size=case.world,
                                   tel=tel, backward=lambda loss: engine.backward(loss, scale_wrt_gas=False))
            engine.step()
        tel.mark("optimizer")
        recs = tel.end_step(step)
        times.append(time.perf_counter() - t0)
        if step >= 3:
            records.extend(recs)
    if dist.is_initialized():
        dist.barrier()
    return records


def _rank_main(rank: int, case: Case, port: int, model_dir: str, tmp: str, q) -> None:
    try:
        recs = run_rank(rank, case, port, model_dir, {"dir": tmp})
        q.put((rank, recs, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the case
        import traceback

        q.put((rank, [], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


def measure(case: Case, model_dir: str, timeout_s: float = 600) -> dict:
    """Run one case in fresh processes; per rank the steady-state step record (max peak over steps ≥ 3)."""
    import tempfile

    from workers.local import forkserver_context, with_environ

    ctx = forkserver_context()  # ranks forked from a server that has imported torch, transformers and peft once
    q = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        procs = [ctx.Process(target=with_environ, args=(r, _rank_main, environ, os.getcwd(), case, port, model_dir, tmp, q))
                 for r in range(case.world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.time() + timeout_s
        try:
            while len(results) < case.world:
                try:
                    rank, recs, err = q.get(timeout=2.0)
                except Exception:  # noqa: BLE001 - queue.Empty: check the ranks are still alive
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.time() > deadline:
                        raise RuntimeError(f"{case.name}: a rank died (exit {dead}) or timed out") from None
                    continue
                if err:
                    raise RuntimeError(f"{case.name} rank {rank}: {err}")
                results[rank] = recs
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    ranks = []
    for rank in sorted(results):
        steps = [r for r in results[rank] if r["phase"] == "step" and r.get("peak_bytes") is not None]
        best = max(steps, key=lambda r: r["peak_bytes"])
        phases = {r["phase"]: r["peak_bytes"] for r in results[rank] if r["phase"] != "step" and r["step"] == best["step"]}
        ranks.append({**best, "phase_peaks": phases, "step_peaks": [r["peak_bytes"] for r in steps]})
    return {"case": asdict(case), "ranks": ranks}


# --- predicting ----------------------------------------------------------------------------------


def predict(case: Case, rank: int | None = None) -> dict:
    """The plan of ``case``; for a pipeline (pp2) the plan of the stage ``rank`` runs (None: the fullest)."""
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    spec = JobSpec.model_validate(case.spec_body())
    p = plan(spec, shape_for_model(resolve_model(spec.model, ())), None,
             stage=rank if case.strategy in PIPELINES else None)
    return p.model_dump(mode="json")


def measured_categories(rank: dict) -> dict[str, int]:
    """Telemetry's categories in the planner's names, device and host together (one RAM on CPU)."""
    g = lambda k: int(rank.get(k) or 0)  # noqa: E731
    return {
        "parameters": g("parameters_bytes") + g("host_parameters_bytes"),
        "gradients": g("gradients_bytes") + g("host_gradients_bytes"),
        "optimizer_states": g("optimizer_bytes") + g("host_optimizer_bytes"),
        "activations": g("activations_bytes"),
        "temporary": g("temporary_bytes") + g("other_bytes"),
        "total": g("peak_bytes"),
    }


def fullest_rank_states(ranks: list[dict]) -> dict[str, int]:
    """Each model-state category on the rank that holds the most of it: what the planner predicts
    (ranks differ only where ZeRO-2's gradient buffer keeps whole tensors across partition boundaries)."""
    per_rank = [measured_categories(rk) for rk in ranks]
    return {c: max(m[c] for m in per_rank) for c in STATES}


def predicted_categories(p: dict) -> dict[str, int]:
    """Model states at their full size (what telemetry counts), activations/temporaries at the peak."""
    d, h, st = p["per_rank"]["device"], p["per_rank"]["host"], p["model_states"]
    out = {c: st["device"][c] + st["host"][c] for c in ("parameters", "gradients", "optimizer_states")}
    out["activations"] = d["activations"] + h["activations"]
    out["total"] = p["peak_bytes"]
    out["temporary"] = out["total"] - sum(out[c] for c in ("parameters", "gradients", "optimizer_states", "activations"))
    return out


def baselines(case: Case) -> dict[str, float]:
    """DeepSpeed's and accelerate's estimates for the same case, per rank, in bytes."""
    import contextlib
    import io

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from service.domain.presets import preset_config

    cfg = {k: v for k, v in preset_config(f"preset:{case.family}").items() if k != "architectures"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    out: dict[str, float] = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import (
            estimate_zero2_model_states_mem_needs,
        )

        n = case.world
        if case.strategy in ("zero3", "zero3_offload"):
            off = case.strategy == "zero3_offload"
            gpu, cpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=n,
                                                                 cpu_offload=off, cpu_offload_params=off,
                                                                 zero_init=True)
        else:
            gpu, cpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=n, cpu_offload=False)
        out["deepspeed"] = float(gpu + (cpu / n if case.strategy == "zero3_offload" else 0))
        from accelerate.utils import calculate_maximum_sizes

        size, _ = calculate_maximum_sizes(model)
        # accelerate estimate-memory: Adam training ≈ 4 × model size (fp32: 16 B/param; 16-bit: 8).
        out["accelerate"] = float(size * 4 / (2 if case.precision == "bf16" else 1))
    return out


# --- the table -------------------------------------------------------------------------------------


def _pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas if meas else 0.0


def report(results: list[dict], out=sys.stdout, markdown: str | None = None) -> dict:
    rows = []
    w = out.write
    w(f"{'config':42s} {'rank':>4s} {'measured':>9s} {'planner':>9s} {'err%':>6s} | "
      f"{'params':>6s} {'grads':>6s} {'optim':>6s} {'activ':>6s} {'temp':>6s} | {'DeepSpeed':>9s} {'err%':>6s} "
      f"{'accel':>7s} {'err%':>6s}\n")
    for res in results:
        case = Case(**res["case"])
        fullest = fullest_rank_states(res["ranks"])
        for rk in res["ranks"]:
            meas = measured_categories(rk)
            stage_plan = res.get("stage_plans", {}).get(str(rk["rank"]))
            pred = predicted_categories(stage_plan or res["plan"])
            if stage_plan:
                fullest = {c: meas[c] for c in STATES}
            err = {c: _pct(pred[c], meas[c]) for c in (*CATS, "total")}
            err.update({c: _pct(pred[c], fullest[c]) for c in STATES})
            cat_err = {c: (100.0 * (pred[c] - meas[c]) / max(meas["total"], 1)) for c in CATS}
            ds, acc = res["baselines"]["deepspeed"], res["baselines"]["accelerate"]
            rows.append({"case": case.name, "rank": rk["rank"], "err": err, "cat_err": cat_err,
                         "ds_err": _pct(ds, meas["total"]), "acc_err": _pct(acc, meas["total"]),
                         "measured": meas, "predicted": pred, "ds": ds, "acc": acc, "strategy": case.strategy})
            w(f"{case.name:42s} {rk['rank']:4d} {meas['total'] / MiB:9.1f} {pred['total'] / MiB:9.1f} "
              f"{err['total']:+6.1f} | "
              + " ".join(f"{err[c]:+6.1f}" if c in ("parameters", "gradients", "optimizer_states") else f"{cat_err[c]:+6.1f}"
                         for c in CATS)
              + f" | {ds / MiB:9.1f} {_pct(ds, meas['total']):+6.1f} {acc / MiB:7.1f} {_pct(acc, meas['total']):+6.1f}\n")
    tot = [abs(r["err"]["total"]) for r in rows]
    summary = {
        "configs": len(results),
        "rank_samples": len(rows),
        "max_abs_total_error_pct": max(tot),
        "median_abs_total_error_pct": statistics.median(tot),
        "under_predicted_fraction": sum(r["err"]["total"] < 0 for r in rows) / len(rows),
        "max_abs_model_state_error_pct": max(
            abs(r["err"][c]) for r in rows for c in ("parameters", "gradients", "optimizer_states")
            if r["measured"][c] > 0
        ),
        "deepspeed_median_error_pct": statistics.median(r["ds_err"] for r in rows),
        "accelerate_median_error_pct": statistics.median(r["acc_err"] for r in rows),
        "configs_within_5pct": len({r["case"] for r in rows} - {r["case"] for r in rows if abs(r["err"]["total"]) > 5}),
    }
    w("\n(params/grads/optim: signed % error of that category against the rank holding the most of it, which is what "
      "the planner predicts; activ/temp: signed error as % of the measured total)\n")
    w(f"configs {summary['configs']}, rank samples {summary['rank_samples']}: "
      f"max |error| {summary['max_abs_total_error_pct']:.2f}%, median |error| {summary['median_abs_total_error_pct']:.2f}%, "
      f"under-predicted {100 * summary['under_predicted_fraction']:.0f}%, "
      f"max params/grads/optimizer error {summary['max_abs_model_state_error_pct']:.2f}%, "
      f"configs with every rank within 5%: {summary['configs_within_5pct']}\n")
    w(f"DeepSpeed estimator median error {summary['deepspeed_median_error_pct']:+.1f}%, "
      f"accelerate median error {summary['accelerate_median_error_pct']:+.1f}%\n")
    if markdown:
        Path(markdown).write_text(markdown_table(rows))
        w(f"markdown table written to {markdown}\n")
    return summary


def markdown_table(rows: list[dict]) -> str:
    """Per strategy a summary, then one line per config (its rank with the largest |error|)."""
    worst: dict[str, dict] = {}
    for r in rows:
        if r["case"] not in worst or abs(r["err"]["total"]) > abs(worst[r["case"]]["err"]["total"]):
            worst[r["case"]] = r
    out = ["| strategy | configs | planner max abs error | planner median abs error | within 5% | "
           "DeepSpeed median error | accelerate median error |", "|---|---|---|---|---|---|---|"]
    for st in STRATEGIES:
        group = [r for r in worst.values() if r["strategy"] == st]
        if not group:
            continue
        errs = [abs(r["err"]["total"]) for r in group]
        out.append(f"| {st} | {len(group)} | {max(errs):.2f}% | {statistics.median(errs):.2f}% | "
                   f"{sum(e <= 5 for e in errs)} | {statistics.median(r['ds_err'] for r in group):+.1f}% | "
                   f"{statistics.median(r['acc_err'] for r in group):+.1f}% |")
    out += ["", "| config | measured MiB | planner MiB | error | params | grads | optim | DeepSpeed MiB (error) | "
            "accelerate MiB (error) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in worst.items():
        m, p = r["measured"], r["predicted"]
        out.append(f"| `{' '.join(name.split())}` | {m['total'] / MiB:.1f} | {p['total'] / MiB:.1f} | "
                   f"{r['err']['total']:+.2f}% | {r['err']['parameters']:+.2f}% | {r['err']['gradients']:+.2f}% | "
                   f"{r['err']['optimizer_states']:+.2f}% | {r['ds'] / MiB:.1f} ({r['ds_err']:+.1f}%) | "
                   f"{r['acc'] / MiB:.1f} ({r['acc_err']:+.1f}%) |")
    return "\n".join(out) + "\n"


def run(cases: list[Case], *, load: str | None = None, save: str | None = None, log=sys.stderr) -> list[dict]:
    measured: dict[str, dict] = {}
    if load:
        for path in load.split(","):
            for m in json.loads(Path(path).read_text()):
                measured[json.dumps(asdict(Case(**m["case"])), sort_keys=True)] = m
    from workers.models import build_preset

    dirs: dict[str, str] = {}
    results = []
    t_start = time.time()
    n_new = 0
    for i, case in enumerate(cases):
        key = json.dumps(asdict(case), sort_keys=True)
        if key not in measured:
            if case.family not in dirs:
                dirs[case.family] = str(build_preset(f"preset:{case.family}"))
            t0 = time.time()
            measured[key] = measure(case, dirs[case.family])
            n_new += 1
            log.write(f"[{i + 1}/{len(cases)}] {case.name}: {time.time() - t0:.1f} s\n")
            log.flush()
            if save:
                Path(save).write_text(json.dumps(list(measured.values())))
        res = dict(measured[key])
        res["plan"] = predict(case)
        if case.strategy in PIPELINES:  # stages differ: each rank against its own stage's plan
            res["stage_plans"] = {str(rk["rank"]): predict(case, rk["rank"]) for rk in res["ranks"]}
        res["baselines"] = baselines(case)
        results.append(res)
    log.write(f"{len(cases)} configs ({n_new} measured now) in {time.time() - t_start:.0f} s\n")
    return results


def overhead(steps: int = 100, case: Case | None = None, trace_every: int = 10, out=sys.stdout) -> dict:
    """Step time with telemetry at a cadence (a counters sample every step, the profiler trace every
    ``trace_every`` steps) against no telemetry, in one process, alternating blocks of 10 steps so
    that machine load hits both alike. Also the cost of one traced step, which sets the cadence."""
    import torch

    from workers import steps as W
    from workers.models import build_preset
    from workers.strategies import build_model
    from workers.telemetry import StepTelemetry

    case = case or Case("small-llama", 512, "none", "fp32", False, "ddp1")
    args = _train_args(case, "/tmp")
    model = build_model(args, str(build_preset(f"preset:{case.family}")))
    opt = W.make_optimizer(model, 1e-4, 0.0)
    sched = W.warmup_cosine(opt, 0, 10**6)
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=trace_every)
    model.train()
    times: dict[str, list[float]] = {"off": [], "on": [], "traced": [], "sampled": []}
    step = 0

    def one(use) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        if use:
            use.begin_step(step)
        W.accumulate_gradients(model, _batches(case, model.config.vocab_size, step, 0),
                               device=torch.device("cpu"), world_size=1, tel=use)
        W.clip_and_step(model, opt, sched, 1.0)
        if use:
            use.mark("optimizer")
            use.end_step(step)
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: the optimizer's states appear on step 1, allocator pools fill
        one(None)
    for block in range(max(1, steps // 10)):
        for mode in ("off", "on") if block % 2 == 0 else ("on", "off"):
            for _ in range(10):
                dt = one(tel if mode == "on" else None)
                times[mode].append(dt)
                if mode == "on":
                    times["traced" if tel.is_traced(step) else "sampled"].append(dt)
    off, on = statistics.mean(times["off"]), statistics.mean(times["on"])
    traced = statistics.mean(times["traced"]) if times["traced"] else float("nan")
    sampled = statistics.mean(times["sampled"])
    res = {"steps_each": len(times["on"]), "trace_every": trace_every, "step_s_without": off, "step_s_with": on,
           "overhead_pct": 100 * (on - off) / off, "traced_step_s": traced, "sampled_step_s": sampled,
           "traced_step_cost_pct": 100 * (traced - off) / off, "sampled_step_cost_pct": 100 * (sampled - off) / off}
    out.write(f"telemetry overhead ({case.name}, {res['steps_each']} steps each, trace every {trace_every}): "
              f"{off * 1e3:.1f} ms -> {on * 1e3:.1f} ms per step, {res['overhead_pct']:+.1f}%\n"
              f"  a counters-only step {sampled * 1e3:.1f} ms ({res['sampled_step_cost_pct']:+.1f}%), "
              f"a traced step {traced * 1e3:.1f} ms ({res['traced_step_cost_pct']:+.1f}%, "
              f"{len(times['traced'])} traced)\n")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 6-config slice instead of the full 192-config matrix")
    ap.add_argument("--save", help="write the measurements to this JSON file (appended as they finish)")
    ap.add_argument("--load", help="reuse measurements from this JSON file; measure only what is missing")
    ap.add_argument("--filter", help="only configs whose name contains this text")
    ap.add_argument("--overhead", action="store_true", help="measure telemetry's step-time overhead instead")
    ap.add_argument("--overhead-steps", type=int, default=100, help="with --overhead: steps with and without")
    ap.add_argument("--trace-every", type=int, default=10, help="with --overhead: the trace cadence to measure")
    ap.add_argument("--loaded-only", action="store_true", help="with --load: report exactly the loaded configs")
    ap.add_argument("--markdown", help="also write the per-config table as Markdown to this file")
    ap.add_argument("--chunked", action="store_true",
                    help="the chunked cross-entropy configs (training.loss_chunk_tokens) instead of the matrix")
    ap.add_argument("--qlora", action="store_true", help="the QLoRA configs (12) instead of the matrix")
    ap.add_argument("--mesh", action="store_true", help="the dp2tp2 configs (4 ranks) instead of the matrix")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="comma-separated presets for the matrix (small-gpt2 and small-gemma exist too)")
    a = ap.parse_args(argv)
    if a.overhead:
        overhead(a.overhead_steps, trace_every=a.trace_every)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    families = tuple(a.families.split(","))
    cases = (chunked_matrix(families) if a.chunked else qlora_matrix(families) if a.qlora
             else mesh_matrix(families) if a.mesh else matrix(a.quick, families))
    if a.load and a.loaded_only:
        cases = []
        for path in a.load.split(","):
            cases += [Case(**m["case"]) for m in json.loads(Path(path).read_text())]
    if a.filter:
        cases = [c for c in cases if all(f in c.name for f in a.filter.split(","))]
    results = run(cases, load=a.load, save=a.save)
    summary = report(results, markdown=a.markdown)
    return 0 if summary["max_abs_total_error_pct"] <= 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
