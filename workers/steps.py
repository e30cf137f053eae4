"""Helpers every strategy shares: where the worker runs, the loss, one accumulated step, the
optimizer and schedule, and the cadence of reports and checkpoints.

The maths of accumulation (why the loss is scaled the way it is): one optimizer step covers
``accumulation`` micro-batches on each of ``world`` ranks. The update we want is the gradient of

    L = (Σ over all micro-batches and ranks of the summed token losses) / T,

with T the number of label tokens (not -100) in the whole window across ranks — exactly what one
big batch would give. Each backward therefore uses ``loss_sum × world / T``: the data-parallel
all-reduce (DDP, FSDP2's reduce-scatter, DeepSpeed) *averages* gradients over ranks, and the
``× world`` undoes that average so the result is the plain sum divided by T.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from workers.activation_offload import offloading
from workers.args import TrainArgs
from workers.chunked_loss import loss_targets
from workers.telemetry import HostMemoryExceeded, PhaseMeter, StepTelemetry

# --- where this worker runs ---------------------------------------------------------------------


@dataclass
class WorkerEnv:
    """Rank, device and the two Ray Train calls a strategy needs, swappable for a plain process
    (single-process tests, benchmarks under torch.multiprocessing)."""

    rank: int
    world_size: int
    device: torch.device
    in_ray: bool = False
    reports: list[dict] = field(default_factory=list)  # local mode: what would have been reported
    checkpoints: list[str] = field(default_factory=list)
    resume_dir: str | None = None
    node_id: str | None = None  # the Ray node this rank runs on (None outside Ray)

    @classmethod
    def from_ray(cls) -> "WorkerEnv":
        import ray
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        return cls(ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(), in_ray=True,
                   node_id=ray.get_runtime_context().get_node_id())

    @classmethod
    def local(cls, device: str | torch.device = "cpu") -> "WorkerEnv":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), torch.device(device))
        return cls(0, 1, torch.device(device))

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        if self.in_ray:
            import ray.train

            from workers.checkpoint import persist_checkpoint

            if checkpoint_dir:  # persist_checkpoint: a full volume leaves no partial checkpoint folder
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
                                 checkpoint_upload_fn=persist_checkpoint)
            else:
                ray.train.report(metrics)
        else:
            self.reports.append(metrics)
            if checkpoint_dir:
                self.checkpoints.append(checkpoint_dir)

    @contextlib.contextmanager
    def latest_checkpoint(self):
        """The directory of the checkpoint to resume from, or None: Ray Train's latest of this run
        (a restart within the attempt), else ``resume_dir`` (RunRequest.resume_from)."""
        if self.in_ray:
            import ray.train

            ckpt = ray.train.get_checkpoint()
            if ckpt is None:  # this attempt has made none yet: the one an earlier attempt left, if any
                from workers.storage import fetch_checkpoint, is_remote

                if is_remote(self.resume_dir):  # staged in the bucket: this rank's copy, for the load
                    with tempfile.TemporaryDirectory(prefix="memfit-resume-") as d:
                        yield fetch_checkpoint(self.resume_dir, d)
                    return
                yield self.resume_dir
                return
            with ckpt.as_directory() as d:
                yield d
        else:
            yield self.resume_dir


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    if not distributed():
        return float(value)
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


# --- loss and one optimizer step ----------------------------------------------------------------


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over label positions that are not -100, in fp32.
    Prompt tuning prepends virtual tokens to the logits: only the last len(labels) positions count.

    Position t predicts label t+1. The labels are shifted (left by one, -100 in the last column)
    rather than the logits: slicing the logits to ``[:, :-1]`` makes them non-contiguous, so the
    reshape would copy all batch x seq x vocab of them in forward and its backward would allocate
    a zero-filled gradient of that size to scatter into (together ~4% of a small model's step on
    CPU). The sum has the same terms (the extra last position of each row is ignored), and each
    logit's gradient is the same: Hugging Face's ForCausalLMLoss shifts the same way."""
    if logits.shape[1] > labels.shape[1]:
        logits = logits[:, -labels.shape[1] :]
    shift_labels = shifted_labels(labels.to(logits.device, non_blocking=True))
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    # logits sharded on the vocabulary (strategy tensor, under loss_parallel) give a DTensor replicated
    # over the group: each rank's local value is already the whole sum
    return loss.to_local() if hasattr(loss, "to_local") else loss


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: the next token's, -100 after the last."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def label_tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@torch.no_grad()
def token_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Label positions whose argmax logit is the label (the numerator of OpenAI's mean token accuracy:
    over the tokens the loss counts), a 0-dim device tensor; None for vocabulary-sharded logits (strategy
    tensor under loss_parallel), whose argmax would need the whole vocabulary gathered."""
    if hasattr(logits, "to_local"):
        return None
    if logits.shape[1] > labels.shape[1]:
        logits = logits[:, -labels.shape[1]:]
    target = shifted_labels(labels.to(logits.device, non_blocking=True))
    return ((logits.argmax(-1) == target) & (target != -100)).sum()


def model_inputs(batch: dict, device: torch.device) -> dict:
    """What the model's forward is given: the ids, and either the padding mask or, for packed rows, the
    position ids that restart at each example (workers/data.py collate) and no mask, from which the
    model builds the block-diagonal causal mask that keeps the examples apart."""
    inputs = {"input_ids": batch["input_ids"].to(device, non_blocking=True)}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"].to(device, non_blocking=True)
        # transformers reads packed sequences from the position ids only without a KV cache (masking_utils)
        inputs["use_cache"] = False
    else:
        inputs["attention_mask"] = batch["attention_mask"].to(device, non_blocking=True)
    return inputs


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: torch.device):
    """fp16 needs loss scaling; only on CUDA (the spec refuses fp16 on CPU workers)."""
    if precision != "fp16":
        return None
    if device.type != "cuda":
        raise RuntimeError("fp16 needs a CUDA device; use bf16 on CPU workers")
    return torch.amp.GradScaler("cuda")


def forward_loss_sum(model, batch: dict, device: torch.device, amp_dtype, offload_activations: bool = False,
                     counts: dict | None = None) -> torch.Tensor:
    """The micro-batch's summed token loss. A head made chunked (workers/chunked_loss.py, training.
    loss_chunk_tokens) computes it inside the forward from the labels set here; otherwise it is
    token_loss_sum of the logits. ``offload_activations`` moves what the model's forward saves to host
    memory (workers/activation_offload.py); the loss's own saved tensors stay on the device. ``counts``,
    when given, collects ``correct``: the label positions predicted right (token_correct)."""
    labels = batch["labels"]
    with loss_targets(shifted_labels(labels)) as target, autocast(device, amp_dtype), \
            offloading(device, offload_activations):
        out = model(**model_inputs(batch, device))
    if target.chunked:  # the model's output, through every wrapper's hooks (workers/chunked_loss.py)
        if counts is not None and target.tally:
            _count(counts, sum(target.tally.values()))
        return out.logits
    loss = token_loss_sum(out.logits, labels)
    if counts is not None:
        _count(counts, token_correct(out.logits, labels))
    return loss


def _count(counts: dict, correct: torch.Tensor | None) -> None:
    if correct is None:
        counts["correct"] = None  # not measured for this micro-batch: the step's accuracy is unknown
    elif counts.get("correct", 0) is not None:
        counts["correct"] = counts.get("correct", 0) + correct


def run_backward(loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None, scaler=None) -> None:
    """One micro-batch's backward: the strategy's own (DeepSpeed's engine.backward), fp16's scaled one, or plain."""
    if backward is not None:
        backward(loss)
    elif scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def accumulate_gradients(
    model,
    micro_batches: list[dict],
    *,
    device: torch.device,
    world_size: int,
    amp_dtype=None,
    scaler=None,
    tel=None,
    no_sync: Callable[[], Any] | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
    where: dict | None = None,
    offload_activations: bool = False,
    stats: dict | None = None,
) -> tuple[float | torch.Tensor | None, int, int]:
    """Forward and backward every micro-batch of one optimizer step with the loss scaled as the
    module docstring explains. Returns (mean loss over the window across ranks, global label
    tokens, local input tokens). On a GPU the mean loss is a 0-dim device tensor, read on the host
    only when a report needs it (``host_value``): reading it here would wait for the GPU every
    step, and a CPU's is a float. ``no_sync`` skips DDP's all-reduce on all but the last micro-batch;
    ``backward`` replaces ``loss.backward()`` (DeepSpeed's engine.backward); ``where["phase"]``
    tracks the phase for an out-of-memory report; ``offload_activations``: forward_loss_sum's. ``stats``,
    when given, gets ``mean_token_accuracy``: the window's label tokens predicted right (argmax) over all
    of them, across ranks (None where the strategy cannot measure it)."""
    where = where if where is not None else {}
    counts: dict = {}
    if tel is not None:
        tel.note_batches(micro_batches)
    local_tokens = sum(label_tokens(b) for b in micro_batches)
    global_tokens = all_reduce_sum(local_tokens, device)
    scale = world_size / max(global_tokens, 1.0)
    loss_total = None  # float64 on the loss's device, summed without a host sync
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            where["phase"] = "forward"
            loss_sum = forward_loss_sum(model, batch, device, amp_dtype, offload_activations, counts)
            if tel is not None:
                tel.mark("forward")
            loss = loss_sum * scale
            where["phase"] = "backward"
            run_backward(loss, backward, scaler)
            if tel is not None:
                tel.mark("backward")
        part = loss_sum.detach().double()
        loss_total = part if loss_total is None else loss_total + part
    correct = counts.get("correct")
    measured = isinstance(correct, torch.Tensor)  # the same on every rank: they run the same model and head
    if distributed():
        import torch.distributed as dist

        if measured:  # one collective for both sums: the loss and the correct predictions
            totals = torch.stack([loss_total, correct.to(loss_total.device).double()])
            dist.all_reduce(totals)
            loss_total, correct = totals[0], totals[1]
        else:
            dist.all_reduce(loss_total)
    input_tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
    # A window whose examples were all truncated before their assistant/completion tokens has no
    # label to learn from: its loss is undefined, not 0.0 (which a dashboard would show as perfect).
    if global_tokens <= 0:
        return None, 0, input_tokens
    if stats is not None:
        accuracy = correct / global_tokens if measured else None
        stats["mean_token_accuracy"] = accuracy if accuracy is None or accuracy.device.type == "cuda" else float(accuracy)
    mean_loss = loss_total / global_tokens
    return (mean_loss if mean_loss.device.type == "cuda" else float(mean_loss)), int(global_tokens), input_tokens


def host_value(x: float | torch.Tensor | None) -> float | None:
    """A metric as a Python float: the one place a step's deferred device scalars (loss, gradient
    norm) are read back, at the report cadence."""
    return float(x) if isinstance(x, torch.Tensor) else x


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float | None, scaler=None) -> torch.Tensor:
    """Clip, step, schedule, zero. Returns the total gradient norm before clipping, a 0-dim tensor
    (``host_value`` reads it at the report cadence; on a GPU, float() here would be a host sync)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the mesh
        norm = norm.full_tensor()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def make_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW in torch's own choice of implementation, except fused on a GPU where it can.

    torch's default (foreach=None) is the per-tensor loop for CPU tensors (CPU workers, FSDP2's
    CPU offload, whose host shards the multi-tensor path cannot take) and the multi-tensor foreach
    path for CUDA tensors, DTensor shards included. Where every trainable parameter is a plain
    CUDA tensor, the fused kernel updates them in place in one launch per group: fewer launches
    than foreach and none of its whole-list temporaries (the planner counts the step's
    temporaries per tensor). All three are the same AdamW; they differ in rounding only (~1e-7).
    Unchecked on a GPU in this repository's tests (no GPU here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type == "cuda" and type(p) in (torch.Tensor, torch.nn.Parameter)
                                 and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up to the peak, then cosine decay to 10% of it at the last step."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing: works with frozen inputs (PEFT) and FSDP2."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def make_telemetry(args: TrainArgs, env: WorkerEnv, model, optimizer, strategy: str, offload: dict) -> StepTelemetry:
    tel = StepTelemetry(
        rank=env.rank, device=env.device, model=model, optimizer=optimizer,
        every_steps=args.telemetry_every_steps, trace_every_steps=args.memory_trace_every_steps,
        host_budget_bytes=args.host_memory_budget_bytes, offload=offload, strategy=strategy,
    )
    tel.plan = args.plan
    return tel


# --- the cadence of reports, checkpoints and failures -------------------------------------------


STALL_ENV = "MEMFIT_WORKER_STALL_AT"
LEAK_ENV = "MEMFIT_WORKER_LEAK_BYTES"
PAUSE_ENV = "MEMFIT_WORKER_STEP_PAUSE_S"
_LEAKED: list[torch.Tensor] = []  # MEMFIT_WORKER_LEAK_BYTES: what the test-only leak keeps


def maybe_inject_failure(args: TrainArgs, env: WorkerEnv, step: int) -> None:
    """MEMFIT_FAIL_AT_STEP=<step>[:<rank>]: exit that rank once (a marker file remembers it).
    MEMFIT_WORKER_LEAK_BYTES=<bytes>[:<rank>]: after every step that rank keeps one more tensor of that size (the
    memory alarms' test: service/memory/alarms.py).
    MEMFIT_WORKER_STALL_AT=<step>:<attempt>: rank 0 of that memfit attempt hangs after that step, as
    a rank whose peer's node vanished waits in a collective (the scheduler forwards MEMFIT_WORKER_*).
    MEMFIT_WORKER_STEP_PAUSE_S=<seconds>: every rank sleeps that long after each step, so that a fault test's
    run lasts on a loaded machine without using its CPU, and the fault (a killed worker, a head restart) lands
    mid-run rather than after the tiny run has ended."""
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        time.sleep(float(pause))
    leak = os.environ.get(LEAK_ENV)
    if leak:  # test-only: a tensor kept across steps, as a loss summed with its graph keeps its activations
        size, _, rank = leak.partition(":")
        if not rank or int(rank) == env.rank:
            _LEAKED.append(torch.ones(int(size), dtype=torch.uint8))
    stall = os.environ.get(STALL_ENV)
    if stall and env.rank == 0:
        at, _, attempt = stall.partition(":")
        if int(at) == step and os.environ.get("MEMFIT_ATTEMPT", "1") == (attempt or "1"):
            while True:  # until the run is stopped
                time.sleep(3600)
    if not args.fail_at:
        return
    at, _, rank = args.fail_at.partition(":")
    if int(at) != step or int(rank or 0) != env.rank:
        return
    marker = Path(args.output_dir) / f".failed-at-{at}-rank{env.rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(time.time()))
    os._exit(1)


@dataclass
class Progress:
    """Decides, per completed step, what to report; every rank calls it the same way, since
    ray.train.report is a barrier that every rank must reach equally often."""

    args: TrainArgs
    env: WorkerEnv
    total_steps: int
    epoch_of: Callable[[int], float]
    trained_tokens: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    events: list[dict] = field(default_factory=list)  # job events still to send, with the next report
    # the job's phases outside the step (load, eval, checkpoint, export), measured and sent with the next report
    phases: PhaseMeter | None = None

    def __post_init__(self) -> None:
        if self.env.node_id:  # where each rank runs, once per placement (a restart may move it)
            import socket

            rank, node = self.env.rank, self.env.node_id
            self.events = [*self.events, {  # a new list: the caller's notices stay as they are
                "level": "info", "dedupe": f"placed:{rank}:{node}",
                "data": {"rank": rank, "node_id": node, "hostname": socket.gethostname()},
                "message": f"Rank {rank} runs on Ray node {node[:12]} ({socket.gethostname()})"}]

    def resumed(self, step: int, trained_tokens: int) -> None:
        """Training continues after the checkpoint of ``step``: say so in the job's events (rank 0)."""
        self.trained_tokens = trained_tokens
        if self.env.rank == 0:
            self.events.append({"level": "info", "dedupe": f"resumed:{step}", "data": {"step": step},
                                "message": f"Resumed from the checkpoint of step {step}"})

    def due_checkpoint(self, step: int) -> bool:
        return step % self.args.checkpoint_every_steps == 0 or step == self.total_steps

    def due_eval(self, step: int) -> bool:
        """Evaluation on the validation file: every training.eval_every_steps (by default a few times per
        run, service/domain/training.py eval_interval) and after the last step, whatever the checkpoints."""
        from service.domain.training import eval_interval

        return step % eval_interval(self.args.eval_every_steps, self.total_steps) == 0 or step == self.total_steps

    def due_metrics(self, step: int, memory: list) -> bool:
        return (bool(memory) or step % self.args.telemetry_every_steps == 0 or step == self.total_steps
                or bool(self.phases and self.phases._pending))

    def metrics(self, step: int, *, loss, lr, grad_norm, step_time_s, tokens, eval_loss=None, memory=(),
                extra: dict | None = None) -> dict:
        m = {
            "kind": "metrics",
            "rank": self.env.rank,
            "step": step,
            "total_steps": self.total_steps,
            "epoch": round(self.epoch_of(step), 4),
            "loss": loss,
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / step_time_s if step_time_s > 0 else None,
            "trained_tokens": self.trained_tokens,
            "step_time_s": step_time_s,
            "memory": list(memory) + (self.phases.records() if self.phases is not None else []),
        }
        if eval_loss is not None:
            m["eval_loss"] = eval_loss
        m.update({k: v for k, v in (extra or {}).items() if v is not None})
        if self.events:
            m["events"], self.events = self.events, []
        return m

    def report(self, metrics: dict, save_state: Callable[[str], None] | None) -> None:
        """Report metrics; with ``save_state`` also a checkpoint (every rank writes into its own
        temporary directory, Ray merges them into one checkpoint directory in storage)."""
        if save_state is None:
            self.env.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="memfit-ckpt-") as d:
            if self.phases is not None:
                with self.phases.measure("checkpoint", metrics["step"]):
                    save_state(d)
            else:
                save_state(d)
            if self.env.in_ray:
                self.env.report(metrics, d)
            else:  # local mode keeps the directory: copy it under output_dir
                import shutil

                from service.domain.errors import find_storage_full
                from workers.checkpoint import StorageFullError

                keep = Path(self.args.output_dir) / "checkpoints" / f"step-{metrics['step']}"
                try:
                    shutil.copytree(d, keep, dirs_exist_ok=True)  # every rank merges its files, like Ray
                except (OSError, shutil.Error) as exc:
                    if find_storage_full(exc) is None:
                        raise
                    shutil.rmtree(keep, ignore_errors=True)  # never a half-copied checkpoint
                    raise StorageFullError.writing(f"the checkpoint of step {metrics['step']}", keep, exc,
                                                   "checkpoint") from exc
                self.env.report(metrics, str(keep))


def write_failure(args: TrainArgs, env: WorkerEnv, exc: BaseException, step: int, phase: str,
                  tel: StepTelemetry) -> dict:
    """The structured out-of-memory failure, written beside the job's outputs for the driver."""
    import json

    details = tel.post_mortem(exc, step=step, phase=phase)
    failure = {
        "kind": "failure",
        "code": "out_of_memory",
        "message": f"{type(exc).__name__}: {exc}"[:8000],
        "rank": env.rank,
        "step": step,
        "phase": phase,
        "details": details,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"failure-rank{env.rank}.json").write_text(json.dumps(failure, default=str))
    return failure


OOM_ERRORS = (torch.OutOfMemoryError, HostMemoryExceeded)
