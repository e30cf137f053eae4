"""What every strategy shares before and after its loop: data and step count, the model as built
(precision regime, checkpointing, QAT, PEFT), eval loss, the per-step cadence and the final result.
The step itself (loss, accumulation, optimizer) is workers/steps.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
from workers.models import load_model, load_tokenizer, resolve_model_dir
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
    train: TokenizedData
    val: TokenizedData | None
    sampler: StepSampler
    total_steps: int
    notices: list[dict] = field(default_factory=list)


def prepare(args: TrainArgs, env: WorkerEnv, data_parallel: tuple[int, int] | None = None) -> Setup:
    """Data, tokenizer and step count. ``data_parallel`` = (replicas, this rank's replica) where they
    are not the world (pipeline stages of one replica read the same rows)."""
    torch.manual_seed(args.seed)
    model_dir = resolve_model_dir(args.model, args.model_path)
    tokenizer = load_tokenizer(model_dir)
    train = load_dataset(args.training_path, tokenizer, args.max_seq_length, args.packing)
    val = load_dataset(args.validation_path, tokenizer, args.max_seq_length) if args.validation_path else None
    replicas = data_parallel[0] if data_parallel else env.world_size
    sampler = StepSampler(len(train), args.micro_batch_size, args.accumulation, replicas, args.seed)
    return Setup(model_dir, tokenizer, train, val, sampler, sampler.total_steps(args.n_epochs, args.max_steps),
                 [*args.extra.get("events", []), *data_notices(args, train)])


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
    """Base model (+ gradient checkpointing, + QAT fake quantization, + PEFT adapter, + the chunked
    loss head), on CPU in fp32, with the frozen base cast where the job's regime holds it in 16 bits."""
    if args.peft_method == "qlora":
        compute = torch_dtype(training_regime(args).compute_dtype)
        # FSDP2 gathers a unit in the compute dtype: the packed 4-bit codes are stored in it (workers/peft_setup.py)
        model = load_qlora_base(model_dir, args.attention, compute, compute if args.strategy == "fsdp" else None)
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
        rg = training_regime(args)
        if rg.cast_frozen_base:
            cast_frozen_base(model, torch_dtype(rg.frozen_dtype))
    if args.loss_chunk_tokens:  # last: the head as PEFT/QAT left it computes the loss chunk by chunk
        chunked_loss.install(model, args.loss_chunk_tokens)
    return model


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
    # Only here, at the report cadence, are the step's device scalars read back (a GPU host sync).
    metrics = progress.metrics(step, loss=host_value(loss), lr=lr, grad_norm=host_value(grad_norm),
                               step_time_s=step_time_s, tokens=input_tokens, eval_loss=eval_loss, memory=memory)
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


def barrier() -> None:
    if distributed():
        torch.distributed.barrier()
