"""DDP: every rank holds the whole model; gradients are all-reduced in buckets during backward."""

from __future__ import annotations

import time

import torch

from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import step_batches
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    accumulate_gradients,
    clip_and_step,
    distributed,
    make_grad_scaler,
    make_optimizer,
    make_telemetry,
    warmup_cosine,
    write_failure,
)
from workers.strategies.common import (
    autocast_dtype,
    barrier,
    build_model,
    evaluate,
    finish_step,
    prepare,
    report_result,
    training_regime,
)
from workers.strategies.qat import qat_export


def train_ddp(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    model = build_model(args, s.model_dir)
    if env.in_ray:
        import ray.train.torch

        model = ray.train.torch.prepare_model(model)  # to the device, DDP when world size > 1
    else:
        model = model.to(env.device)
        if distributed():
            model = torch.nn.parallel.DistributedDataParallel(model)
    no_sync = model.no_sync if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    amp_dtype = autocast_dtype(training_regime(args))  # DDP keeps fp32 weights; autocast casts per op
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    scaler = make_grad_scaler(args.precision, env.device)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [])
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = ckpt.load_torch_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        ckpt.save_torch_state(d, model, optimizer, scheduler, step=step, strategy="ddp",
                              trained_tokens=progress.trained_tokens, rank=env.rank, trainable_only=args.is_peft)

    tel = make_telemetry(args, env, model, optimizer, "ddp", {"optimizer": "none", "param": "none"})
    model.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = step_batches(s.train, s.sampler, step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            loss, _, input_tokens = accumulate_gradients(
                model, batches, device=env.device, world_size=env.world_size, amp_dtype=amp_dtype,
                scaler=scaler, tel=tel, no_sync=no_sync, where=where,
                offload_activations=args.activation_offload)
            where["phase"] = "optimizer"
            lr = optimizer.param_groups[0]["lr"]
            grad_norm = clip_and_step(model, optimizer, scheduler, args.max_grad_norm, scaler)
            tel.mark("optimizer")
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step)
        finish_step(progress, step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                    input_tokens=input_tokens, memory=memory,
                    save_state=lambda d, step=step: save_state(d, step),
                    eval_fn=lambda: evaluate(model, s.val, args, env, amp_dtype))
    state = ckpt.full_model_state(model, trainable_only=args.is_peft)
    if args.qat_enabled and env.rank == 0:
        qat_export(ckpt.unwrap(model), args.qat_scheme, args.qat_group_size)  # the quantised weights
        state = ckpt.full_model_state(model, trainable_only=False)
    artifacts = ckpt.export_artifacts(args, state, s.model_dir, s.tokenizer) if env.rank == 0 else {}
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts
