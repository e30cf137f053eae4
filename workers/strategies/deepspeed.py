"""DeepSpeed ZeRO 0-3: optimizer states (1), gradients (2) and parameters (3) partitioned over the
ranks by DeepSpeed's engine, optionally offloaded to host memory."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from service.domain.training import (
    NVME_AIO,
    NVME_OPTIMIZER_BUFFERS,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP_ELEMENTS,
    DeepSpeedBuckets,
    Regime,
    deepspeed_buckets,
    nvme_param_buffer_elements,
)
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.models import config_hidden_size, hidden_size  # noqa: F401 - hidden_size for DPO's copy
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    make_telemetry,
    warmup_cosine,
    write_failure,
)
from workers.strategies.common import (
    barrier,
    build_model,
    finish_step,
    load_phase,
    load_report,
    materialize,
    prepare,
    report_result,
    step_fns,
    training_regime,
)


def deepspeed_config(*, stage: int, micro_batch_size: int, accumulation: int, world_size: int, lr: float,
                     weight_decay: float, max_grad_norm: float | None, regime: Regime, offload_optimizer: str,
                     offload_param: str, buckets: DeepSpeedBuckets, on_cpu: bool, nvme_path: str | None = None,
                     largest_param_numel: int = 0) -> dict:
    """DeepSpeed's JSON config, its buffers and 16-bit mode the ones the planner counts
    (service/domain/training.py). ``nvme``: ZeRO-Infinity's offload to files under ``nvme_path``, through the
    swap buffers and sub-groups the planner counts (service/memory/nvme.py)."""
    zero: dict = {"stage": stage, "reduce_bucket_size": buckets.reduce_elements,
                  "allgather_bucket_size": buckets.allgather_elements}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = buckets.prefetch_elements
        zero["stage3_param_persistence_threshold"] = buckets.persistence_threshold
        zero["stage3_max_reuse_distance"] = buckets.max_reuse_distance
    pin = not on_cpu
    if offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if offload_optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin,
                                     "buffer_count": NVME_OPTIMIZER_BUFFERS}
        zero["sub_group_size"] = NVME_SUB_GROUP_ELEMENTS
    if offload_param == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin,
                                 "buffer_count": NVME_PARAM_BUFFERS,
                                 "buffer_size": nvme_param_buffer_elements(largest_param_numel)}
    adam = {"lr": lr, "weight_decay": weight_decay, "betas": [0.9, 0.999], "eps": 1e-8}
    if on_cpu:
        # DeepSpeed's FusedAdam/CPUAdam JIT-compile C++ for minutes; torch's AdamW needs nothing.
        adam["torch_adam"] = True
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch_size * accumulation * world_size,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam},
        # the 16-bit mode converts the whole module (and its gradients); fp32 masters stay in the optimizer
        "bf16": {"enabled": regime.trainable_dtype == "bfloat16"},
        "fp16": {"enabled": regime.trainable_dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if on_cpu and offload_optimizer in ("cpu", "nvme"):
        config["zero_force_ds_cpu_optimizer"] = False  # let the torch AdamW run on the offloaded states
    if "nvme" in (offload_optimizer, offload_param):
        config["aio"] = dict(NVME_AIO)
    return config


def nvme_dir(root: str, job_id: str) -> str:
    """Where a job's ranks swap to: a folder of the job's under the spec's nvme_path, removed when it ends."""
    return str(Path(root) / "memfit" / job_id)


def check_async_io() -> None:
    """DeepSpeed's async_io op (ZeRO-Infinity's swap) must build here: say why not before anything runs."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise RuntimeError("training.deepspeed: offload to nvme needs DeepSpeed's async_io op, which cannot build on "
                           "this worker (libaio's library and headers — libaio-dev — and a C++ compiler are needed)")


def largest_param_numel(model_dir: str) -> int:
    """The largest tensor of the checkpoint (an nvme swap buffer must hold any parameter whole)."""
    from workers.weights import Checkpoint

    with Checkpoint(model_dir) as ckpt:
        return max((e.numel for e in ckpt.entries.values()), default=0)


def trained_state(module, rank: int, zero3: bool) -> dict[str, torch.Tensor]:
    """The trained (adapter) tensors whole on rank 0: under ZeRO-3 each gathered alone (a collective), else
    the module's own."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if zero3 and getattr(p, "ds_tensor", None) is not None:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if rank == 0:
                    out[name] = p.detach().to("cpu", copy=True)
        elif rank == 0:
            out[name] = p.detach().to("cpu", copy=True)
    return out


def export_deepspeed(args: TrainArgs, env: WorkerEnv, module, model_dir: str, tokenizer) -> dict:
    """PEFT: the adapter gathered (small) and exported by rank 0, its merge streamed from the base's files;
    a full fine-tune streamed tensor by tensor — under ZeRO-3 each parameter gathered alone (never
    ``_zero3_consolidated_16bit_state_dict``, which gathers the whole model on rank 0), under ZeRO-0/1/2 from
    rank 0's own module (workers/export.py)."""
    zero3 = args.ds_stage == 3
    if args.is_peft:
        state = trained_state(module, env.rank, zero3)
        return ckpt.export_artifacts(args, state, model_dir, tokenizer) if env.rank == 0 else {}
    if zero3:
        return ckpt.export_model(args, module, model_dir, tokenizer, env.rank, zero3=True)
    return ckpt.export_model(args, module, model_dir, tokenizer, env.rank) if env.rank == 0 else {}


def skip_shm_build() -> None:
    """On CPU DeepSpeed builds a shared-memory comm op (C++, 30–60 s) when its torch backend starts.
    Gloo does the job; replace the builder in the module object (``import deepspeed.comm.torch as x``
    would bind the torch package, not this module)."""
    import deepspeed  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def train_deepspeed(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    on_cpu = env.device.type == "cpu"
    if on_cpu:
        skip_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    nvme = "nvme" in (args.ds_offload_optimizer, args.ds_offload_param)
    if nvme:
        check_async_io()
    config = deepspeed_config(
        stage=args.ds_stage, micro_batch_size=args.micro_batch_size, accumulation=args.accumulation,
        world_size=env.world_size, lr=args.learning_rate, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, regime=training_regime(args), offload_optimizer=args.ds_offload_optimizer,
        offload_param=args.ds_offload_param,
        buckets=deepspeed_buckets(config_hidden_size(s.model_dir), args.ds_reduce_bucket_elements), on_cpu=on_cpu,
        nvme_path=nvme_dir(args.ds_nvme_path, args.job_id) if nvme else None,
        largest_param_numel=largest_param_numel(s.model_dir) if nvme else 0)
    # ZeRO-3: built under deepspeed.zero.Init, each parameter partitioned as it is made, then each rank reads
    # only its partitions (before deepspeed.initialize copies them into the fp32 masters). ZeRO-0/1/2: every
    # rank holds the whole module, read straight into place in the 16-bit dtype DeepSpeed trains it in.
    meter = load_phase(env)
    with meter.measure("load", 0) as info:
        model = build_model(args, s.model_dir, zero3_config=config if args.ds_stage == 3 else None, device=env.device)
        if args.ds_stage == 3:
            materialize(model, s.model_dir, env.device)
        load_report(info, model)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config,
        lr_scheduler=lambda opt: warmup_cosine(opt, args.warmup_steps, s.total_steps))
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [],
                        phases=meter)
    fns = step_fns(args, env, s, engine)  # supervised, or DPO with its reference (workers/dpo.py)
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            ckpt.load_deepspeed_safely(engine)  # weights_only=True for DeepSpeed's own reads too
            engine.load_checkpoint(str(Path(d) / "deepspeed"), tag=ckpt.DS_TAG)
            ckpt.load_rng(d, env.rank)
            meta = ckpt.read_meta(d)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        engine.save_checkpoint(str(Path(d) / "deepspeed"), tag=ckpt.DS_TAG, save_latest=False)
        ckpt.save_rng(d, env.rank)
        ckpt.write_meta(d, step, "deepspeed", progress.trained_tokens, env.rank)
        fns.save(d, env.rank)

    micro_calls = {"n": 0}

    def ds_backward(loss: torch.Tensor) -> None:
        # DeepSpeed counts micro-steps in engine.step(): call it after every backward but the last of
        # the window; the last one (the optimizer step) runs below, after the "backward" mark.
        # scale_wrt_gas=False: the loss is already divided by the window's token count.
        engine.backward(loss, scale_wrt_gas=False)
        micro_calls["n"] += 1
        if micro_calls["n"] % args.accumulation:
            engine.step()

    offload = {"optimizer": args.ds_offload_optimizer, "param": args.ds_offload_param}
    tel = make_telemetry(args, env, engine.module, optimizer, "deepspeed", offload)
    tel.held_parameters = fns.held_parameters  # DPO's frozen reference copy
    engine.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = fns.batches(step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            stats: dict = {}
            loss, _, input_tokens = fns.accumulate(
                engine, batches, device=env.device, world_size=env.world_size, tel=tel,
                backward=ds_backward, where=where,
                offload_activations=args.activation_offload, stats=stats)
            where["phase"] = "optimizer"
            lr = scheduler.get_last_lr()[0]
            engine.step()  # the accumulation boundary: clip, optimizer step, schedule, zero grads
            tel.mark("optimizer")
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step)
        finish_step(progress, step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                    input_tokens=input_tokens, memory=memory,
                    save_state=lambda d, step=step: save_state(d, step),
                    eval_fn=fns.evaluate, stats=stats)
    with meter.measure("export", s.total_steps):
        artifacts = export_deepspeed(args, env, engine.module, s.model_dir, s.tokenizer)
    barrier()
    if nvme:  # the swap files of this job's ranks on this node
        shutil.rmtree(nvme_dir(args.ds_nvme_path, args.job_id), ignore_errors=True)
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts
