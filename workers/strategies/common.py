"""What every strategy shares before and after its loop: data and step count, the model as built
(precision regime, checkpointing, QAT, PEFT), eval loss, the per-step cadence and the final result.
The step itself (loss, accumulation, optimizer) is workers/steps.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from service.domain.model_names import fine_tuned_model_name
from service.domain.training import Regime, regime
from workers import chunked_loss
from workers.args import TrainArgs
from workers.data import (
    StepSampler,
    TokenizedData,
    eval_batches,
    load_dataset,
    rows_without_labels,
)
from workers.models import load_model, load_tokenizer, local_model_dir, resolve_model_dir
from workers.peft_setup import apply_peft, load_qlora_base
from workers.steps import (
    Progress,
    WorkerEnv,
    all_reduce_sum,
    distributed,
    enable_checkpointing,
    forward_loss_sum,
    host_value,
    label_tokens,
    maybe_inject_failure,
)
from workers.strategies.qat import qat_prepare
from workers.telemetry import heap_in_use_bytes, note_process_baseline

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def training_regime(args: TrainArgs) -> Regime:
    """The precision regime this job trains in: the planner's (service/domain/training.py)."""
    return regime(args.strategy, args.peft_method, args.precision)


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def autocast_dtype(rg: Regime) -> torch.dtype | None:
    """The dtype torch.autocast casts to around forward, or None where the regime does not autocast."""
    return torch_dtype(rg.compute_dtype) if rg.autocast else None


# --- setup --------------------------------------------------------------------------------------


@dataclass
class Setup:
    model_dir: str
    tokenizer: object
    train: TokenizedData  # or workers/dpo.py PreferenceData (method dpo)
    val: TokenizedData | None
    sampler: StepSampler
    total_steps: int
    notices: list[dict] = field(default_factory=list)


@dataclass
class StepFns:
    """How a strategy's loop forms a step's micro-batches, runs them and evaluates: supervised
    (workers/steps.py accumulate_gradients) or DPO (workers/dpo.py, with its reference)."""

    batches: Callable[[int, int], list[dict]]  # (0-based step, data-parallel rank) → micro-batches
    accumulate: Callable  # accumulate_gradients' signature
    evaluate: Callable[[], object]  # finish_step's eval_fn
    save: Callable[[str, int], None] = lambda d, rank: None  # beside a checkpoint: what the step functions keep
    held_parameters: Callable[[], list] | None = None  # parameters outside the model (telemetry counts them)


def step_fns(args: TrainArgs, env: WorkerEnv, s: Setup, model, amp_dtype=None, shard=None, meter=None) -> StepFns:
    """The step functions for this job, ``model`` being the policy as the strategy wrapped it (what its
    forward is called on: the DDP module, the FSDP2 root, DeepSpeed's engine); ``shard`` places DPO's frozen
    reference copy as the strategy places the policy (fsdp: sharded)."""
    from workers.data import step_batches
    from workers.steps import accumulate_gradients

    if args.rl:  # reinforcement: sample, grade, GRPO (workers/rl.py); ``meter`` measures the sampling phase
        from workers import rl

        copy = frozen_copy(args, s.model_dir).to(env.device) if args.rl_reference == "frozen_copy" else None
        r = rl.RLStep(args, env, s, model, amp_dtype, copy=copy, meter=meter)
        return StepFns(lambda step, rank: rl.prompt_step_batches(s.train, s.sampler, step, rank), r.accumulate,
                       r.evaluate, held_parameters=(lambda: list(copy.parameters())) if copy is not None else None)
    if not args.dpo:
        return StepFns(lambda step, rank: step_batches(s.train, s.sampler, step, rank), accumulate_gradients,
                       lambda: evaluate_metrics(model, s.val, args, env, amp_dtype))
    import functools

    from workers import dpo

    copy = None
    if dpo.reference_mode(args) == "frozen_copy":
        copy = frozen_copy(args, s.model_dir)
        copy = shard(copy) if shard is not None else copy.to(env.device)
    reference = dpo.make_reference(args, s, model, env, amp_dtype, copy)
    return StepFns(lambda step, rank: dpo.pair_step_batches(s.train, s.sampler, step, rank),
                   functools.partial(dpo.dpo_accumulate, reference=reference, beta=args.dpo_beta),
                   lambda: dpo.dpo_evaluate(model, s.val, reference, args.dpo_beta, args.micro_batch_size, env, amp_dtype),
                   reference.save, (lambda: list(copy.parameters())) if copy is not None else None)


def prepare(args: TrainArgs, env: WorkerEnv, data_parallel: tuple[int, int] | None = None) -> Setup:
    """Data, tokenizer and step count. ``data_parallel`` = (replicas, this rank's replica) where they
    are not the world (pipeline stages of one replica read the same rows)."""
    torch.manual_seed(args.seed)
    model_dir = local_model_dir(resolve_model_dir(args.model, args.model_path))
    tokenizer = load_tokenizer(model_dir)
    if args.rl:  # prompt rows: the policy writes the completions (workers/rl.py)
        from workers.rl import load_prompts

        room = args.max_seq_length - args.rl_max_completion_tokens
        train = load_prompts(args.training_path, tokenizer, room)
        val = load_prompts(args.validation_path, tokenizer, room) if args.validation_path else None
    elif args.dpo:  # preference rows: a pair of sequences each (workers/dpo.py)
        from workers.dpo import load_preferences

        train = load_preferences(args.training_path, tokenizer, args.max_seq_length)
        val = load_preferences(args.validation_path, tokenizer, args.max_seq_length) if args.validation_path else None
    else:
        train = load_dataset(args.training_path, tokenizer, args.max_seq_length, args.packing)
        val = load_dataset(args.validation_path, tokenizer, args.max_seq_length) if args.validation_path else None
    replicas = data_parallel[0] if data_parallel else env.world_size
    sampler = StepSampler(len(train), args.micro_batch_size, args.accumulation, replicas, args.seed)
    return Setup(model_dir, tokenizer, train, val, sampler, sampler.total_steps(args.n_epochs, args.max_steps),
                 [*args.extra.get("events", []), *data_notices(args, train)])


def data_notices(args: TrainArgs, train: TokenizedData) -> list[dict]:
    """Warnings about the training data for the job's events (rank 0 sends them with its first report)."""
    if args.dpo or args.rl:
        return []
    empty = rows_without_labels(train)
    if not empty or args.packing:
        return []
    return [{"level": "warn", "dedupe": "rows-without-labels", "data": {"rows": empty, "of": len(train)},
             "message": f"{empty} of {len(train)} training examples have no label tokens within "
                        f"max_seq_length={args.max_seq_length} (the text to learn falls after the cut): they "
                        "add compute and no loss; raise training.hyperparameters.max_seq_length or shorten them"}]


def base_dtype(args: TrainArgs) -> torch.dtype:
    """The dtype the base model's weights are held in: the trained weights' for a full fine-tune, the frozen
    base's for PEFT (a 16-bit base is read as 16 bits, never as fp32 first)."""
    rg = training_regime(args)
    return torch_dtype(rg.frozen_dtype if args.is_peft else rg.trainable_dtype)


def build_model(args: TrainArgs, model_dir: str, *, on_meta: bool = False, zero3_config: dict | None = None,
                device: torch.device | str = "cpu"):
    """Base model (+ gradient checkpointing, + QAT fake quantization, + PEFT adapter, + the chunked loss
    head), on the host, its base in the dtype the job's regime holds it in (``base_dtype``).

    The base is built empty (workers/models.py ``empty_model``) and its weights read from the checkpoint's
    safetensors files (workers/weights.py), never loaded whole in fp32 first:

    - default: every weight read whole, straight into place on ``device`` (DDP, DeepSpeed ZeRO-0/1/2, QAT:
      every rank needs the whole model; on a GPU worker, read onto the GPU through a small staging buffer);
    - ``on_meta``: the base's parameters stay on the meta device (its buffers and a PEFT adapter are real);
      the strategy shards or splits it, then reads what the rank holds (``materialize``);
    - ``zero3_config``: built under ``deepspeed.zero.Init``, each parameter partitioned over the ranks as it
      is made; ``materialize`` then reads each rank's partition.
    QLoRA's 4-bit base is loaded quantised tensor by tensor by transformers and bitsandbytes, as before."""
    from workers.models import empty_model, has_safetensors, load_model
    from workers.weights import load_model_weights, pending, snapshot_real, to_empty

    heap_before = heap_in_use_bytes()  # the telemetry's referee counts from here (workers/telemetry.py: Referee)

    built_empty, report = False, None
    if args.peft_method == "qlora":
        compute = torch_dtype(training_regime(args).compute_dtype)
        # FSDP2 gathers a unit in the compute dtype: the packed 4-bit codes are stored in it (workers/peft_setup.py)
        model = load_qlora_base(model_dir, args.attention, compute, compute if args.strategy == "fsdp" else None)
    elif not has_safetensors(model_dir):
        # pytorch_model.bin only: transformers loads it whole (in the dtype the base is held in); the strategy
        # shards the whole model, as before memfit read safetensors itself
        model = load_model(model_dir, args.attention, dtype=base_dtype(args))
    else:
        built_empty = True
        model = empty_model(model_dir, args.attention, base_dtype(args), zero3_config=zero3_config)
        if not on_meta and zero3_config is None:
            computed, wanted = snapshot_real(model), pending(model)  # the buffers the model computed when built
            to_empty(model, device)
            report = load_model_weights(model, model_dir, snapshot=computed, only=wanted)
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
    if args.loss_chunk_tokens:  # last: the head as PEFT/QAT left it computes the loss chunk by chunk
        chunked_loss.install(model, args.loss_chunk_tokens)
    if on_meta and built_empty:
        # What is real now (the adapter PEFT initialised, the buffers the model computed) is kept whole, to
        # be put back after the strategy's ``to_empty``: the checkpoint has none of it.
        model._memfit_snapshot = snapshot_real(model)
    model._memfit_load_report = report  # what this rank read (None until materialize reads it)
    note_process_baseline(model, heap_before)
    return model


def materialize(model, model_dir: str, device: torch.device, *, transforms: dict | None = None,
                aliases: dict | None = None, snapshot: dict | None = None):
    """After a strategy sharded or split a model built ``on_meta``: room for what this rank holds, on
    ``device``, filled from the checkpoint and from the snapshot build_model kept (the tensors that were
    real: a fresh adapter, computed buffers). A ZeRO-3 model built under ``zero3_config`` holds its
    partitions already: they are filled in place (before ``deepspeed.initialize``, which copies them into
    the fp32 masters). Returns workers/weights.py's LoadReport."""
    from workers.weights import is_meta, load_model_weights, named_tensors, pending, to_empty

    if snapshot is None:
        snapshot = getattr(model, "_memfit_snapshot", None) or {}
    wanted = pending(model)
    if any(is_meta(t) for _, t in named_tensors(model)):
        to_empty(model, device)  # the real tensors too: the snapshot puts them back
    report = load_model_weights(model, model_dir, snapshot=snapshot, transforms=transforms, aliases=aliases,
                                only=wanted)
    if hasattr(model, "_memfit_snapshot"):
        del model._memfit_snapshot
    model._memfit_load_report = report
    return report


def frozen_copy(args: TrainArgs, model_dir: str):
    """DPO's frozen_copy reference: the base once more, frozen, in the dtype the policy holds its weights in
    (a PEFT base: the regime's frozen dtype), on CPU; the strategy places it (step_fns' ``shard``)."""
    rg = training_regime(args)
    copy = load_model(model_dir, args.attention)
    copy.config.use_cache = False
    copy.requires_grad_(False).eval()
    dtype = rg.frozen_dtype if args.is_peft else rg.trainable_dtype
    return copy.to(dtype=torch_dtype(rg.compute_dtype if dtype == "nf4" else dtype))


def cast_frozen_base(model, dtype: torch.dtype) -> int:
    """The frozen base is only read: hold it in ``dtype``; the adapter keeps fp32 for AdamW. Returns
    the number of parameters converted."""
    n = 0
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
            n += p.numel()
    return n


# --- the loop's shared pieces -------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, val: TokenizedData | None, args: TrainArgs, env: WorkerEnv, amp_dtype=None) -> float | None:
    """The validation file's mean token loss, across ranks (see evaluate_metrics)."""
    return evaluate_metrics(model, val, args, env, amp_dtype)[0]


@torch.no_grad()
def evaluate_metrics(model, val: TokenizedData | None, args: TrainArgs, env: WorkerEnv,
                     amp_dtype=None) -> tuple[float | None, float | None]:
    """(mean token loss, mean token accuracy) over the whole validation file, each rank its share, summed
    across ranks; (None, None) without one. The accuracy is None where the logits are sharded."""
    if val is None:
        return None, None
    was_training = model.training
    model.eval()
    loss_sum, tokens, counts = 0.0, 0, {}
    for batch in eval_batches(val, args.micro_batch_size, env.rank, env.world_size):
        loss_sum += float(forward_loss_sum(model, batch, env.device, amp_dtype, counts=counts))
        tokens += label_tokens(batch)
    model.train(was_training)
    correct = counts.get("correct")
    measured = isinstance(correct, torch.Tensor)
    total = max(all_reduce_sum(tokens, env.device), 1.0)
    loss = all_reduce_sum(loss_sum, env.device) / total
    return loss, (all_reduce_sum(float(correct), env.device) / total if measured else None)


def finish_step(progress: Progress, step: int, *, loss, lr, grad_norm, step_time_s, input_tokens, memory,
                save_state, eval_fn, stats: dict | None = None) -> None:
    """After optimizer step ``step`` (1-based): fault injection, metrics at the telemetry cadence, a
    checkpoint at the checkpoint cadence, and evaluation at its own (Progress.due_eval). ``eval_fn``
    returns the eval loss, or (loss, mean token accuracy); ``stats`` holds the step's other measures
    (accumulate_gradients: mean_token_accuracy; DPO: its rewards), reported with it. After the last step
    the evaluation is also the full validation's (OpenAI's full_valid_loss and full_valid_mean_token_accuracy)."""
    maybe_inject_failure(progress.args, progress.env, step)
    progress.trained_tokens += input_tokens
    due_ckpt = progress.due_checkpoint(step)
    due_eval = progress.due_eval(step)
    if not (due_ckpt or due_eval or progress.due_metrics(step, memory)):
        return
    evaluated = None
    if due_eval:
        if progress.phases is not None:
            with progress.phases.measure("eval", step):
                evaluated = eval_fn()
        else:
            evaluated = eval_fn()
    if isinstance(evaluated, dict):  # DPO: eval_loss and its own measures (workers/dpo.py dpo_evaluate)
        evaluated = dict(evaluated)
        eval_loss, eval_accuracy, eval_extra = evaluated.pop("eval_loss", None), None, evaluated
    else:
        eval_loss, eval_accuracy = evaluated if isinstance(evaluated, tuple) else (evaluated, None)
        eval_extra = {}
    # Only here, at the report cadence, are the step's device scalars read back (a GPU host sync).
    extra = {k: host_value(v) for k, v in (stats or {}).items()}
    extra.update(eval_extra, eval_mean_token_accuracy=eval_accuracy)
    if step == progress.total_steps:
        extra.update(full_eval_loss=eval_loss, full_eval_mean_token_accuracy=eval_accuracy)
    metrics = progress.metrics(step, loss=host_value(loss), lr=lr, grad_norm=host_value(grad_norm),
                               step_time_s=step_time_s, tokens=input_tokens, eval_loss=eval_loss, memory=memory,
                               extra=extra)
    progress.report(metrics, save_state if due_ckpt else None)


def report_result(args: TrainArgs, env: WorkerEnv, progress: Progress, artifacts: dict, total_steps: int) -> None:
    """Rank 0's result; every rank's last phases (the last checkpoint, the export) go with it."""
    result = None
    if env.rank == 0:
        result = {
            "kind": "result",
            "fine_tuned_model": fine_tuned_model_name(args.model, args.suffix, args.job_id),
            "artifacts": artifacts,
            "trained_tokens": int(all_reduce_sum(progress.trained_tokens, env.device)),
        }
    else:
        all_reduce_sum(progress.trained_tokens, env.device)
    memory = progress.phases.records() if progress.phases is not None else []
    env.report({"kind": "result", "rank": env.rank, "step": total_steps, "result": result, "memory": memory})


def load_phase(env: WorkerEnv):
    """The job's phase meter (workers/telemetry.py PhaseMeter) and the context that measures loading the model:
    ``with meter.measure("load", 0) as info: ...``; the strategy passes the meter to its Progress."""
    from workers.telemetry import PhaseMeter

    return PhaseMeter(env.rank, env.device)


def load_report(info: dict, model) -> None:
    """What a rank read (workers/weights.py LoadReport) beside its load phase's record."""
    report = getattr(model, "_memfit_load_report", None)
    if report is not None:
        info.update(bytes_read=report.bytes_read, bytes_held=report.bytes_held,
                    checkpoint_bytes=report.checkpoint_bytes, largest_tensor_bytes=report.largest_tensor_bytes)


def barrier() -> None:
    if distributed():
        torch.distributed.barrier()
