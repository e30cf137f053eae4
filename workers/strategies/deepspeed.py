"""DeepSpeed ZeRO 0-3: optimizer states (1), gradients (2) and parameters (3) partitioned over the
ranks by DeepSpeed's engine, optionally offloaded to host memory."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from service.domain.training import DeepSpeedBuckets, Regime, deepspeed_buckets
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import step_batches
from workers.models import hidden_size
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    accumulate_gradients,
    make_telemetry,
    warmup_cosine,
    write_failure,
)
from workers.strategies.common import (
    barrier,
    build_model,
    evaluate,
    finish_step,
    prepare,
    report_result,
    training_regime,
)


def deepspeed_config(*, stage: int, micro_batch_size: int, accumulation: int, world_size: int, lr: float,
                     weight_decay: float, max_grad_norm: float | None, regime: Regime, offload_optimizer: str,
                     offload_param: str, buckets: DeepSpeedBuckets, on_cpu: bool) -> dict:
    """DeepSpeed's JSON config, its buffers and 16-bit mode the ones the planner counts
    (service/domain/training.py)."""
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
    if on_cpu and offload_optimizer == "cpu":
        config["zero_force_ds_cpu_optimizer"] = False  # let the torch AdamW run on the offloaded states
    return config


def skip_shm_build() -> None:
    """On CPU DeepSpeed builds a shared-memory comm op (C++, 30–60 s) when its torch backend starts.
    Gloo does the job; replace the builder in the module object (``import deepspeed.comm.torch as x``
    would bind the torch package, not this module)."""
    import deepspeed  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def train_deepspeed(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    model = build_model(args, s.model_dir)
    on_cpu = env.device.type == "cpu"
    if on_cpu:
        skip_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    config = deepspeed_config(
        stage=args.ds_stage, micro_batch_size=args.micro_batch_size, accumulation=args.accumulation,
        world_size=env.world_size, lr=args.learning_rate, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, regime=training_regime(args), offload_optimizer=args.ds_offload_optimizer,
        offload_param=args.ds_offload_param, buckets=deepspeed_buckets(hidden_size(model), args.ds_reduce_bucket_elements),
        on_cpu=on_cpu)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config,
        lr_scheduler=lambda opt: warmup_cosine(opt, args.warmup_steps, s.total_steps))
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [])
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            engine.load_checkpoint(str(Path(d) / "deepspeed"), tag=ckpt.DS_TAG)
            ckpt.load_rng(d, env.rank)
            meta = ckpt.read_meta(d)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        engine.save_checkpoint(str(Path(d) / "deepspeed"), tag=ckpt.DS_TAG, save_latest=False)
        ckpt.save_rng(d, env.rank)
        ckpt.write_meta(d, step, "deepspeed", progress.trained_tokens, env.rank)

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
    engine.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = step_batches(s.train, s.sampler, step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            loss, _, input_tokens = accumulate_gradients(
                engine, batches, device=env.device, world_size=env.world_size, tel=tel,
                backward=ds_backward, where=where,
                offload_activations=args.activation_offload)
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
                    eval_fn=lambda: evaluate(engine, s.val, args, env))
    if args.ds_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # collective; the full dict on rank 0
    else:
        state = engine.module.state_dict() if env.rank == 0 else None
    artifacts = {}
    if env.rank == 0:
        state = {k: v.detach().float().cpu() for k, v in state.items()}
        artifacts = ckpt.export_artifacts(args, state, s.model_dir, s.tokenizer)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts
