"""DDP: every rank holds the whole model; gradients are all-reduced in buckets during backward."""

from __future__ import annotations

import time

import torch

from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
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
    finish_step,
    load_phase,
    load_report,
    prepare,
    report_result,
    step_fns,
    training_regime,
)
from workers.strategies.qat import qat_export


def reducer_bucket_bytes(model) -> int:
    """What DDP's reducer holds for the gradients' all-reduce, which no tensor reachable from Python shows: one
    flat bucket per group of trainable parameters (torch/nn/parallel/distributed.py builds ``dist.Reducer`` when the
    model is wrapped; its C++ side allocates each bucket as one tensor of its parameters' total size), kept for the
    model's lifetime (rebuilt once, in the second step's forward, in the order backward produced the gradients).
    With ``gradient_as_bucket_view`` the gradients are views into the buckets ("the saved memory size will be equal
    to the total gradients size", the same file's docstring): memfit leaves it off, as torch and Ray Train do, so
    the buckets are a second copy of every trainable gradient."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.module.parameters() if p.requires_grad)


def train_ddp(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    meter = load_phase(env)
    with meter.measure("load", 0) as info:
        model = build_model(args, s.model_dir, device=env.device)  # the whole model, read straight onto the device
        load_report(info, model)
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
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [],
                        phases=meter)
    # supervised, DPO with its reference (workers/dpo.py), or RL, whose sampling the meter measures (workers/rl.py)
    fns = step_fns(args, env, s, model, amp_dtype, meter=meter)
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = ckpt.load_torch_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        ckpt.save_torch_state(d, model, optimizer, scheduler, step=step, strategy="ddp",
                              trained_tokens=progress.trained_tokens, rank=env.rank, trainable_only=args.is_peft)
        fns.save(d, env.rank)

    tel = make_telemetry(args, env, model, optimizer, "ddp", {"optimizer": "none", "param": "none"})
    tel.held_parameters = fns.held_parameters  # DPO's frozen reference copy
    tel.held_bytes = lambda: reducer_bucket_bytes(model)
    model.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = fns.batches(step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            stats: dict = {}
            loss, _, input_tokens = fns.accumulate(
                model, batches, device=env.device, world_size=env.world_size, amp_dtype=amp_dtype,
                scaler=scaler, tel=tel, no_sync=no_sync, where=where,
                offload_activations=args.activation_offload, stats=stats)
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
                    eval_fn=fns.evaluate, stats=stats)
    artifacts = {}
    if env.rank == 0:  # every replica holds the same weights: rank 0 streams them, one tensor at a time
        with meter.measure("export", s.total_steps):
            if args.is_peft:  # the adapter; the merge is streamed from the base's files (workers/export.py)
                artifacts = ckpt.export_artifacts(args, ckpt.full_model_state(model, trainable_only=True),
                                                  s.model_dir, s.tokenizer)
            else:
                if args.qat_enabled:
                    qat_export(ckpt.unwrap(model), args.qat_scheme, args.qat_group_size)  # the quantised weights
                artifacts = ckpt.export_model(args, model, s.model_dir, s.tokenizer, env.rank)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts
