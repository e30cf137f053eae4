"""One training function per strategy, the loop in plain sight in each. Shared pieces live in
workers/steps.py (loss, accumulation, reports), workers/checkpoint.py and workers/data.py.

Every function takes flat ``TrainArgs`` and a ``WorkerEnv`` (rank, device, report) and runs the same
on CPU/gloo and CUDA/nccl: the device comes from the environment, GPU-only pieces (fp16 grad
scaling, pinned memory, DeepSpeed's compiled optimizers) are switched on by the device type.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import (
    StepSampler,
    TokenizedData,
    eval_batches,
    load_dataset,
    rows_without_labels,
    step_batches,
)
from workers.models import hidden_size, load_model, load_tokenizer, resolve_model_dir
from workers.peft_setup import apply_peft, load_qlora_base
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    accumulate_gradients,
    all_reduce_sum,
    autocast_dtype,
    clip_and_step,
    distributed,
    enable_checkpointing,
    forward_loss_sum,
    label_tokens,
    make_grad_scaler,
    make_optimizer,
    make_telemetry,
    maybe_inject_failure,
    warmup_cosine,
    write_failure,
)

# --- shared setup -------------------------------------------------------------------------------


@dataclass
class Setup:
    model_dir: str
    tokenizer: object
    train: TokenizedData
    val: TokenizedData | None
    sampler: StepSampler
    total_steps: int
    notices: list[dict] = field(default_factory=list)


def prepare(args: TrainArgs, env: WorkerEnv) -> Setup:
    torch.manual_seed(args.seed)
    model_dir = resolve_model_dir(args.model, args.model_path)
    tokenizer = load_tokenizer(model_dir)
    train = load_dataset(args.training_path, tokenizer, args.max_seq_length, args.packing)
    val = load_dataset(args.validation_path, tokenizer, args.max_seq_length) if args.validation_path else None
    sampler = StepSampler(len(train), args.micro_batch_size, args.accumulation, env.world_size, args.seed)
    return Setup(model_dir, tokenizer, train, val, sampler, sampler.total_steps(args.n_epochs, args.max_steps),
                 data_notices(args, train))


def data_notices(args: TrainArgs, train: TokenizedData) -> list[dict]:
    """Warnings about the training data for the job's events (rank 0 sends them with its first report)."""
    empty = rows_without_labels(train)
    if not empty or args.packing:
        return []
    return [{"level": "warn", "dedupe": "rows-without-labels", "data": {"rows": empty, "of": len(train)},
             "message": f"{empty} of {len(train)} training examples have no label tokens within "
                        f"max_seq_length={args.max_seq_length} (the text to learn falls after the cut): they "
                        "add compute and no loss; raise training.hyperparameters.max_seq_length or shorten them"}]


def build_model(args: TrainArgs, model_dir: str):
    """Base model (+ gradient checkpointing, + QAT fake quantization, + PEFT adapter), on CPU in fp32."""
    if args.peft_method == "qlora":
        model = load_qlora_base(model_dir, args.attention)
    else:
        model = load_model(model_dir, args.attention)
    # Training never reads a KV cache; left on, GPT-2 keeps a copy of every block's keys and values.
    model.config.use_cache = False
    if args.gradient_checkpointing:
        enable_checkpointing(model)
    if args.qat_enabled:
        qat_prepare(model, args.qat_scheme, args.qat_group_size)
    if args.is_peft:
        model = apply_peft(model, "lora" if args.peft_method == "qlora" else args.peft_method, r=args.peft_r,
                           alpha=args.peft_alpha, dropout=args.peft_dropout, targets=args.peft_targets,
                           num_virtual_tokens=args.peft_virtual_tokens)
        if args.peft_method == "lora" and args.precision == "bf16" and args.strategy == "ddp":
            frozen_base_to_bf16(model)
    return model


def frozen_base_to_bf16(model) -> int:
    """LoRA with bf16 under DDP: the frozen base is only read, so it is kept in bf16 (2 bytes per
    parameter instead of 4, what LoRA users expect); the adapter stays fp32 for AdamW and autocast
    casts it per matmul. (FSDP2 keeps one dtype per unit and casts for compute; DeepSpeed's bf16 mode
    converts the whole module itself.) Returns the number of parameters converted."""
    n = 0
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
            n += p.numel()
    return n


# --- QAT ----------------------------------------------------------------------------------------
#
# Quantization-aware training with torchao's QATConfig: "prepare" swaps each quantised nn.Linear for
# a FakeQuantizedLinear, whose forward rounds its weight (and, for the dynamic-activation scheme, its
# input) to the target integer grid and back, so training learns weights that survive quantisation;
# gradients pass the rounding straight through to the float "shadow" weights the optimizer updates.
#
# What the export holds (``qat_export``): after training, torchao's "convert" step quantises each of
# those linears for real — int4 values q in [-8, 7] per group of ``group_size`` input weights, one
# scale s per group, symmetric (zero point 0) — and the exported ``model/`` holds, in every quantised
# linear, the dequantised weight s × q: exactly the weight the fake-quantised forward computed with,
# not the float shadow. It is a stock transformers checkpoint (from_pretrained, no torchao needed);
# activations are quantised at run time, so the int8-dynamic-act scheme stores nothing more.
# A linear whose weight is the input embedding (tie_word_embeddings) stays float: one tensor cannot
# be both an int4 lm_head and the float embedding the model reads its inputs with.

QAT_SCHEMES = ("int8-dynamic-act-int4-weight", "int4-weight-only")


def qat_base_config(scheme: str, group_size: int):
    """The torchao post-training config the scheme trains for (QATConfig derives its fake quantizers
    in "prepare" and applies it in "convert").

    - ``int8-dynamic-act-int4-weight``: Int8DynamicActivationIntxWeightConfig — int8 activations per
      token, asymmetric, quantised at run time; int4 weights per group, symmetric.
    - ``int4-weight-only``: IntxWeightOnlyConfig at int4 per group, symmetric; activations stay float.
      Not Int4WeightOnlyConfig: its packed layouts only convert with kernels not on PyPI for CPU,
      while this unpacked layout converts on any device.
    """
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerGroup,
    )

    if scheme == "int8-dynamic-act-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int4-weight-only":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    raise ValueError(f"training.qat.scheme: unknown scheme {scheme!r}; known: {', '.join(QAT_SCHEMES)}")


def qat_targets(model) -> dict[str, torch.nn.Linear]:
    """The linears QAT quantises: every nn.Linear except one sharing its weight with an embedding."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in embedded}


def qat_prepare(model, scheme: str, group_size: int) -> int:
    """Fake-quantise the model's linears for ``scheme`` (see above). Returns how many."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    targets = qat_targets(model)
    if not targets:
        raise ValueError(f"training.qat.enabled: {type(model).__name__} has no torch.nn.Linear layers to quantise "
                         "(GPT-2's blocks are Conv1D)")
    uneven = [f"{name} ({m.in_features})" for name, m in targets.items() if m.in_features % group_size]
    if uneven:
        raise ValueError(f"training.qat.group_size={group_size} must divide the input width of every quantised "
                         f"linear; it does not divide {', '.join(uneven[:4])}" + (" …" if len(uneven) > 4 else ""))
    quantize_(model, QATConfig(qat_base_config(scheme, group_size), step="prepare"),
              filter_fn=lambda m, fqn: fqn in targets)
    return len(targets)


def qat_export(model, scheme: str, group_size: int) -> None:
    """After training: torchao's convert step quantises the fake-quantised linears for real, then each
    quantised weight is replaced by its dequantised values (s × q per group), so the model is plain
    nn.Linear again, holding the quantised weights (see above), and exports with stock transformers."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.utils import TorchAOBaseTensor

    quantize_(model, QATConfig(qat_base_config(scheme, group_size), step="convert"))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and isinstance(m.weight, TorchAOBaseTensor):
            m.weight = torch.nn.Parameter(m.weight.dequantize(), requires_grad=False)


@torch.no_grad()
def evaluate(model, val: TokenizedData | None, args: TrainArgs, env: WorkerEnv, amp_dtype=None) -> float | None:
    if val is None:
        return None
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in eval_batches(val, args.micro_batch_size, env.rank, env.world_size):
        loss_sum += float(forward_loss_sum(model, batch, env.device, amp_dtype))
        tokens += label_tokens(batch)
    model.train(was_training)
    return all_reduce_sum(loss_sum, env.device) / max(all_reduce_sum(tokens, env.device), 1.0)


def finish_step(progress: Progress, step: int, *, loss, lr, grad_norm, step_time_s, input_tokens, memory,
                save_state, eval_fn) -> None:
    """After optimizer step ``step`` (1-based): fault injection, metrics at the telemetry cadence,
    eval loss and a checkpoint at the checkpoint cadence."""
    maybe_inject_failure(progress.args, progress.env, step)
    progress.trained_tokens += input_tokens
    due_ckpt = progress.due_checkpoint(step)
    if not (due_ckpt or progress.due_metrics(step, memory)):
        return
    eval_loss = eval_fn() if due_ckpt else None
    metrics = progress.metrics(step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                               tokens=input_tokens, eval_loss=eval_loss, memory=memory)
    progress.report(metrics, save_state if due_ckpt else None)


def report_result(args: TrainArgs, env: WorkerEnv, progress: Progress, artifacts: dict, total_steps: int) -> None:
    result = None
    if env.rank == 0:
        result = {
            "kind": "result",
            "fine_tuned_model": f"ft:{args.model}:{args.job_id}",
            "artifacts": artifacts,
            "trained_tokens": int(all_reduce_sum(progress.trained_tokens, env.device)),
        }
    else:
        all_reduce_sum(progress.trained_tokens, env.device)
    env.report({"kind": "result", "rank": env.rank, "step": total_steps, "result": result})


def _barrier() -> None:
    if distributed():
        torch.distributed.barrier()


# --- ddp ----------------------------------------------------------------------------------------


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
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    save_state = lambda d, step, prog: ckpt.save_torch_state(  # noqa: E731
        d, model, optimizer, scheduler, step=step, strategy="ddp", trained_tokens=prog.trained_tokens,
        rank=env.rank, trainable_only=args.is_peft)
    return _torch_loop(args, env, s, model, optimizer, scheduler, save_state,
                       no_sync=model.no_sync if ddp else None, amp_dtype=autocast_dtype(args.precision),
                       strategy="ddp", offload={"optimizer": "none", "param": "none"})


def _torch_loop(args, env, s: Setup, model, optimizer, scheduler, save_state, *, no_sync, amp_dtype, strategy,
                offload) -> dict:
    """The loop ddp and fsdp share (they differ in how the model is wrapped, not in the step)."""
    scaler = make_grad_scaler(args.precision, env.device)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [])
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = ckpt.load_torch_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))
    tel = make_telemetry(args, env, model, optimizer, strategy, offload)
    model.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = step_batches(s.train, s.sampler, step - 1, env.rank)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            if tel is not None:
                tel.begin_step(step)
            loss, _, input_tokens = accumulate_gradients(
                model, batches, device=env.device, world_size=env.world_size, amp_dtype=amp_dtype,
                scaler=scaler, tel=tel, no_sync=no_sync, where=where)
            where["phase"] = "optimizer"
            lr = optimizer.param_groups[0]["lr"]
            grad_norm = clip_and_step(model, optimizer, scheduler, args.max_grad_norm, scaler)
            if tel is not None:
                tel.mark("optimizer")
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step) if tel is not None else []
        finish_step(progress, step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                    input_tokens=input_tokens, memory=memory,
                    save_state=lambda d, step=step: save_state(d, step, progress),
                    eval_fn=lambda: evaluate(model, s.val, args, env, amp_dtype))
    state = ckpt.full_model_state(model, trainable_only=args.is_peft)
    if args.qat_enabled and env.rank == 0:
        qat_export(ckpt.unwrap(model), args.qat_scheme, args.qat_group_size)  # the quantised weights
        state = ckpt.full_model_state(model, trainable_only=False)
    artifacts = ckpt.export_artifacts(args, state, s.model_dir, s.tokenizer) if env.rank == 0 else {}
    _barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts


# --- fsdp ---------------------------------------------------------------------------------------


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks (LlamaDecoderLayer, GPT2Block …) named by the model's _no_split_modules."""
    from transformers import PreTrainedModel

    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and getattr(m, "_no_split_modules", None):
            names = set(m._no_split_modules)
            break
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_fsdp2(model, device: torch.device, world_size: int, *, precision: str, reshard_after_forward: bool,
                cpu_offload: bool):
    """FSDP2: each decoder layer is one unit (gathered just before it runs), the root holds the rest.
    FSDP1 refuses CPU devices; FSDP2 runs there, offload included when memory is not pinned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):
        # Compute in 16 bits, reduce gradients in fp32: the shards and the optimizer stay fp32.
        mp = MixedPrecisionPolicy(param_dtype=autocast_dtype(precision), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    model = model.to(device) if not cpu_offload else model
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    return model


def train_fsdp(args: TrainArgs, env: WorkerEnv) -> dict:
    s = prepare(args, env)
    model = build_model(args, s.model_dir)
    model = shard_fsdp2(model, env.device, env.world_size, precision=args.precision,
                        reshard_after_forward=args.fsdp_reshard_after_forward, cpu_offload=args.fsdp_cpu_offload)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    save_state = lambda d, step, prog: ckpt.save_torch_state(  # noqa: E731
        d, model, optimizer, scheduler, step=step, strategy="fsdp", trained_tokens=prog.trained_tokens,
        rank=env.rank, trainable_only=args.is_peft)
    off = "cpu" if args.fsdp_cpu_offload else "none"
    # MixedPrecisionPolicy already computes in 16 bits: no autocast on top (it would re-cast).
    return _torch_loop(args, env, s, model, optimizer, scheduler, save_state, no_sync=None, amp_dtype=None,
                       strategy="fsdp", offload={"optimizer": off, "param": off})


# --- deepspeed ----------------------------------------------------------------------------------


def deepspeed_config(*, stage: int, micro_batch_size: int, accumulation: int, world_size: int, lr: float,
                     weight_decay: float, max_grad_norm: float | None, precision: str, offload_optimizer: str,
                     offload_param: str, hidden: int, reduce_bucket_elements: int | None, on_cpu: bool) -> dict:
    """DeepSpeed's JSON config. Buckets follow hidden² (Hugging Face's "auto" values), not DeepSpeed's
    5e8-element default that allocates ~1 GB per rank whatever the model — the planner assumes these."""
    bucket = int(reduce_bucket_elements or hidden * hidden)
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        zero["stage3_param_persistence_threshold"] = 10 * hidden
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
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if on_cpu and offload_optimizer == "cpu":
        config["zero_force_ds_cpu_optimizer"] = False  # let the torch AdamW run on the offloaded states
    return config


def _skip_shm_build() -> None:
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
        _skip_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    config = deepspeed_config(
        stage=args.ds_stage, micro_batch_size=args.micro_batch_size, accumulation=args.accumulation,
        world_size=env.world_size, lr=args.learning_rate, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, precision=args.precision, offload_optimizer=args.ds_offload_optimizer,
        offload_param=args.ds_offload_param, hidden=hidden_size(model),
        reduce_bucket_elements=args.ds_reduce_bucket_elements, on_cpu=on_cpu)
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
            if tel is not None:
                tel.begin_step(step)
            loss, _, input_tokens = accumulate_gradients(
                engine, batches, device=env.device, world_size=env.world_size, tel=tel,
                backward=ds_backward, where=where)
            where["phase"] = "optimizer"
            lr = scheduler.get_last_lr()[0]
            engine.step()  # the accumulation boundary: clip, optimizer step, schedule, zero grads
            if tel is not None:
                tel.mark("optimizer")
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step) if tel is not None else []
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
    _barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts


# --- pipeline -----------------------------------------------------------------------------------


def train_pipeline(args: TrainArgs, env: WorkerEnv) -> dict:
    raise NotImplementedError(
        "training.strategy 'pipeline' is not available in this version of the workers; use ddp, fsdp or deepspeed"
    )


STRATEGIES = {"ddp": train_ddp, "fsdp": train_fsdp, "deepspeed": train_deepspeed, "pipeline": train_pipeline}


def train(args: TrainArgs, env: WorkerEnv) -> dict:
    return STRATEGIES[args.strategy](args, env)

