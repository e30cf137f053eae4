"""Memory by phase of a job, planned: one rank's device and host peak while it loads the weights, trains a
step, evaluates, saves a checkpoint and exports — and which phase is the highest. Pure arithmetic on the plan
(service/memory/planner.py) and its host plan (service/memory/host.py); workers/telemetry.py PhaseMeter
measures the same phases on every rank.

Users meet out-of-memory failures outside the training step: the host killed while every rank loads the model
(DeepSpeed issues 3823 and 4239, LLaMA-Factory 4629 and 9258), evaluation-only (LLaMA-Factory 5419/7991,
axolotl 1813/3203) and save-only ones (axolotl PR 1828, pytorch 104143), and an export that rebuilds the model
on one host after the compute was spent. The plan says before the run which phase peaks, and ``fits`` holds
for every one of them.

Per phase, on the device (a GPU; a CPU worker's device is its host, so only the host column is given there):

- *load*: the parameters the rank holds (read straight into place, workers/weights.py), under ZeRO-3 one
  parameter whole beside them while ``deepspeed.zero.Init`` partitions it;
- *step*: the plan's peak (the largest of a step's instants);
- *eval*: forward only, without gradients: the model states that stay (parameters, optimizer states, ZeRO-3's
  flat gradient buffer, which DeepSpeed keeps), the weights a wrapper gathers for the forward, the logits and
  the loss's fp32 copy and log-softmax — the step's forward instant without the activations it saves for
  backward (the log-softmax is made and freed inside the loss) and without the gradients of earlier
  micro-batches (``zero_grad`` ran before the evaluation);
- *checkpoint*: the model states that stay (DCP and ``torch.save`` stage each storage to the host);
- *export*: the same, plus one tensor gathered whole on the device (FSDP2, tensor parallel, ZeRO-3).
On a GPU each adds the CUDA context, NCCL's buffers and the allocator's 5 %, as the step does. On the host,
the phases of service/memory/host.py's per-rank instants (load, step, checkpoint, export), and the evaluation's:
the worker process plus, on a CPU worker, the evaluation's device bytes, on a GPU worker the host column at rest.
"""

from __future__ import annotations

from service.domain.plan import JOB_PHASES, JobPhases, PhasePeak, Plan
from service.domain.spec import JobSpec, PeftMethod, StrategyName
from service.domain.training import dtype_bytes, regime
from service.memory.gpus import get_gpu
from service.memory.shape import ModelShape

ALLOCATOR_SHARE = 0.05  # the planner's allocator rounding/cache: 5 % of the live peak


def _held_bytes(dtype: str) -> int:
    return dtype_bytes(dtype) if dtype in ("float32", "bfloat16", "float16") else 4


def eval_live_bytes(spec: JobSpec, plan: Plan, shape: ModelShape, seq_length: int | None = None) -> int:
    """The evaluation's live bytes on the rank's device (module docstring), from the step's forward instant."""
    t = spec.training
    resolved = spec.resolved()
    b, s = resolved.micro_batch_size, seq_length or t.hyperparameters.max_seq_length
    forward = plan.phases.get("forward", plan.peak_bytes)
    states = plan.model_states.device
    zero3 = t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage == 3
    grads_in_forward = states.gradients if (resolved.gradient_accumulation_steps > 1 and not zero3) else 0
    tokens = min(b * s, t.loss_chunk_tokens) if t.loss_chunk_tokens else b * s
    log_softmax = tokens * shape.vocab * 4  # made and freed inside the loss
    return max(0, forward - plan.activations_saved_bytes - grads_in_forward) + log_softmax


def job_phases(spec: JobSpec, plan: Plan, shape: ModelShape) -> JobPhases:
    """Every phase's peak per rank (module docstring), whether each fits, and the highest on each side."""
    from service.memory.host import load_bytes

    t = spec.training
    on_gpu = plan.gpu is not None
    host = plan.host_memory.per_rank_bytes if plan.host_memory is not None else {}
    runtime = plan.host_memory.runtime_bytes if plan.host_memory is not None else 0
    states = plan.model_states.device
    zero3 = t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage == 3
    rg = regime(t.strategy.value, t.peft.method.value, t.precision.value)
    held = _held_bytes(rg.trainable_dtype if t.peft.method == PeftMethod.none else rg.frozen_dtype)
    largest = max(shape.parameter_numels(), default=0)
    kept = states.parameters + states.optimizer_states + (states.gradients if zero3 else 0)
    eval_live = eval_live_bytes(spec, plan, shape)
    gathered = 0
    if t.peft.method == PeftMethod.none and (t.strategy in (StrategyName.fsdp, StrategyName.tensor) or zero3):
        gathered = largest * held  # export: one tensor whole on the device
    load_device, _ = load_bytes(spec, plan, largest_numel=largest, trainable=plan.trainable_parameter_count,
                                base_dtype_bytes=held, on_gpu=on_gpu, family=shape.family)
    live = {"load": load_device, "step": None, "eval": eval_live, "checkpoint": kept, "export": kept + gathered}
    out = JobPhases()
    if on_gpu:
        g = get_gpu(plan.gpu)
        fixed = g.context_bytes + (g.nccl_bytes if plan.world_size > 1 else 0)
        device = {k: (plan.peak_bytes if v is None else v + fixed + int(ALLOCATOR_SHARE * v)) for k, v in live.items()}
        host_eval = runtime + plan.per_rank.host.parameters + plan.per_rank.host.gradients \
            + plan.per_rank.host.optimizer_states + plan.per_rank.host.overhead
    else:
        device = {k: None for k in live}
        host_eval = runtime + eval_live
    hosts = {"load": host.get("load", runtime), "step": host.get("step", plan.need_bytes), "eval": host_eval,
             "checkpoint": host.get("checkpoint", runtime), "export": host.get("export", runtime)}
    usable = plan.usable_bytes
    node = plan.host_memory if plan.host_memory is not None and plan.host_memory.checked else None
    for phase in JOB_PHASES:
        fits: bool | None = None
        if on_gpu and usable is not None:
            fits = device[phase] <= usable
            if node is not None and phase in node.node_instants_bytes:
                fits = fits and node.node_instants_bytes[phase] <= node.node_usable_bytes
        elif not on_gpu and usable is not None:
            # a CPU worker: its RAM holds everything; the step's need carries the planner's accuracy margin too
            fits = (hosts[phase] <= usable) if phase != "step" else plan.need_bytes <= usable
        note = "rank 0" if phase == "export" else ""
        out.phases[phase] = PhasePeak(device_bytes=device[phase], host_bytes=hosts[phase], fits=fits, note=note)
    if on_gpu:
        out.device_peak_phase = max(JOB_PHASES, key=lambda k: out.phases[k].device_bytes or 0)
    out.host_peak_phase = max(JOB_PHASES, key=lambda k: out.phases[k].host_bytes)
    verdicts = [p.fits for p in out.phases.values()]
    out.fits = False if False in verdicts else (None if None in verdicts else True)
    return out
