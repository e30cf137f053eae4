"""FSDP2: parameters, gradients and optimizer states sharded over the ranks, one unit per decoder
layer gathered just before it runs."""

from __future__ import annotations

import time

import torch

from service.domain.training import Regime
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    clip_and_step,
    make_grad_scaler,
    make_optimizer,
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
    torch_dtype,
    training_regime,
)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks (LlamaDecoderLayer, GPT2Block …) named by the model's _no_split_modules."""
    from transformers import PreTrainedModel

    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and getattr(m, "_no_split_modules", None):
            names = set(m._no_split_modules)
            break
    return [m for m in model.modules() if type(m).__name__ in names]


def mixed_precision_policy(rg: Regime):
    """FSDP2 gathers each unit in the regime's compute dtype and reduces gradients in its gradient
    dtype; the shards (and so the optimizer) stay in the trained weights' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if rg.compute_dtype == rg.trainable_dtype:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(rg.compute_dtype), reduce_dtype=torch_dtype(rg.grad_dtype))


def shard_fsdp2(model, device: torch.device, world_size: int, *, regime: Regime, reshard_after_forward: bool,
                cpu_offload: bool):
    """FSDP2: each decoder layer is one unit (gathered just before it runs), the root holds the rest.
    FSDP1 refuses CPU devices; FSDP2 runs there, offload included when memory is not pinned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from workers.weights import is_meta

    mesh = init_device_mesh(device.type, (world_size,))
    mp = mixed_precision_policy(regime)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    if not cpu_offload and not any(is_meta(p) for p in model.parameters()):
        model = model.to(device)  # a model built on the meta device gets its room after sharding (materialize)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    return model


def train_fsdp(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    # Built on the meta device and sharded there; each rank then reads only its shard of every weight, in the
    # dtype it holds it in (a PEFT base in 16 bits), never the whole model (workers/weights.py).
    meter = load_phase(env)
    with meter.measure("load", 0) as info:
        model = build_model(args, s.model_dir, on_meta=True)
        model = shard_fsdp2(model, env.device, env.world_size, regime=training_regime(args),
                            reshard_after_forward=args.fsdp_reshard_after_forward, cpu_offload=args.fsdp_cpu_offload)
        materialize(model, s.model_dir, torch.device("cpu") if args.fsdp_cpu_offload else env.device)
        load_report(info, model)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    scaler = make_grad_scaler(args.precision, env.device)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [],
                        phases=meter)
    fns = step_fns(args, env, s, model, shard=lambda m: shard_fsdp2(  # DPO's frozen copy: sharded like the policy
        m, env.device, env.world_size, regime=training_regime(args), reshard_after_forward=True, cpu_offload=False))
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = ckpt.load_torch_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        ckpt.save_torch_state(d, model, optimizer, scheduler, step=step, strategy="fsdp",
                              trained_tokens=progress.trained_tokens, rank=env.rank, trainable_only=args.is_peft)
        fns.save(d, env.rank)

    off = "cpu" if args.fsdp_cpu_offload else "none"
    tel = make_telemetry(args, env, model, optimizer, "fsdp", {"optimizer": off, "param": off})
    tel.held_parameters = fns.held_parameters  # DPO's frozen reference copy
    model.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = fns.batches(step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            stats: dict = {}
            # The MixedPrecisionPolicy already computes in 16 bits: no autocast on top (it would re-cast).
            loss, _, input_tokens = fns.accumulate(
                model, batches, device=env.device, world_size=env.world_size, scaler=scaler, tel=tel, where=where,
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
    with meter.measure("export", s.total_steps):
        if args.is_peft:  # the adapter is small: gather it whole; the merge streams from the base's files
            state = ckpt.full_model_state(model, trainable_only=True)  # collective: every rank takes part
            artifacts = ckpt.export_artifacts(args, state, s.model_dir, s.tokenizer) if env.rank == 0 else {}
        else:  # the full model: gathered one tensor at a time and streamed to safetensors files by rank 0
            artifacts = ckpt.export_model_streamed(args, model, s.model_dir, s.tokenizer, env.rank)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts
