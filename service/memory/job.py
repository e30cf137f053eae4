"""A job as the planner reads it: the spec resolved, once, into the numbers every term needs — the rank's
model shape, the data-parallel ranks, the micro-batch, the planned width, the precision regime and the
training method — and the general assumptions a plan states about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.domain.spec import JobSpec, PeftMethod
from service.domain.training import Regime, regime
from service.memory.gpus import GPU, get_gpu
from service.memory.peft import adapted_modules, trainable_numels, trainable_parameters
from service.memory.shape import ModelShape
from service.memory.tensor_parallel import check_tensor, rank_shape


@dataclass
class PlannedJob:
    spec: JobSpec
    shape: ModelShape  # what one rank computes (strategy tensor: its share of the heads, columns, vocabulary)
    model_shape: ModelShape  # the whole model
    gpu: GPU | None  # None: a CPU worker, whose "device" is host memory
    world: int  # data-parallel ranks the model states are split over (strategy tensor: workers / size)
    micro_batch: int
    accumulation: int
    seq: int  # the planned width of a micro-batch (prompt tuning: with its virtual tokens)
    padded: bool  # the micro-batch holds shorter rows: attention runs with a padding mask
    regime: Regime
    targets: set[str] | None  # None: a full fine-tune; else the adapted modules
    trainable: int  # Pt: trainable parameters (one rank's share under strategy tensor)
    parameters: int  # P: every parameter the model holds, the adapter's included
    trainable_numels: list[int]
    tensor_size: int = 1
    tensor_assumptions: list[str] = field(default_factory=list)
    # the first micro-batch of an accumulated step: the step's gradients do not exist yet in its forward
    # (the previous step's zero_grad(set_to_none=True) freed them)
    first_micro_batch: bool = False

    @property
    def t(self):
        return self.spec.training

    @property
    def strategy(self) -> str:
        return self.spec.training.strategy.value

    @property
    def on_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def full(self) -> bool:
        return self.spec.training.peft.method == PeftMethod.none

    @property
    def qlora(self) -> bool:
        return self.spec.training.peft.method == PeftMethod.qlora


def planned_job(spec: JobSpec, shape: ModelShape, gpu: str | None, *, world_size: int | None,
                seq_length: int | None, padded: bool, first_micro_batch: bool = False) -> PlannedJob:
    """``spec`` resolved for the planner (see :func:`service.memory.planner.plan` for the arguments). Raises
    SpecInvalid for a model strategy tensor cannot split."""
    t = spec.training
    gpu = gpu or t.resources.gpu_type
    g = get_gpu(gpu) if gpu else None
    N = int(world_size or t.resources.num_workers)
    resolved = spec.resolved()
    s = t.hyperparameters.max_seq_length if seq_length is None else seq_length
    if t.peft.method == PeftMethod.prompt_tuning:  # peft prepends the virtual tokens to every row
        s += t.peft.num_virtual_tokens
    model_shape, tp, tp_assumptions = shape, 1, []
    if t.strategy.value == "tensor":  # one rank of a tensor-parallel group: a model of 1/size the heads and columns
        tp = check_tensor(spec, shape)
        shape, N = rank_shape(shape, tp), N // tp
        vocab = (f"1/{tp} of the vocabulary's embedding rows, LM head and logits (cross-entropy under loss_parallel)"
                 if shape.vocab != model_shape.vocab else "the embeddings and LM head whole")
        tp_assumptions = [f"tensor parallel: {tp} ranks each hold 1/{tp} of every block's heads and MLP columns, "
                          f"{vocab} and the norms whole; {N} data-parallel replica(s)"
                          + (" sharded by FSDP2" if N > 1 else "")]
    Pt = trainable_parameters(spec, shape)
    full = t.peft.method == PeftMethod.none
    targets = adapted_modules(spec, shape)
    return PlannedJob(
        spec=spec, shape=shape, model_shape=model_shape, gpu=g, world=N, micro_batch=resolved.micro_batch_size,
        accumulation=resolved.gradient_accumulation_steps, seq=s,
        padded=padded and t.strategy.value != "pipeline",  # the stages run causal attention without the mask
        regime=regime(t.strategy.value, t.peft.method.value, t.precision.value), targets=targets, trainable=Pt,
        # PEFT adds its adapter to the frozen base: the model holds both
        parameters=shape.parameter_count() + (Pt if not full else 0),
        trainable_numels=trainable_numels(spec, shape, targets), tensor_size=tp, tensor_assumptions=tp_assumptions,
        first_micro_batch=first_micro_batch)


def general_assumptions(job: PlannedJob, seq_length: int | None) -> list[str]:
    """The lines every plan states first: the width planned, the optimizer, the activations' regime, and the
    options that change the activations."""
    t = job.t
    b, accum, s = job.micro_batch, job.accumulation, job.seq
    out = [
        (f"sequences padded to max_seq_length={s}, micro-batch {b}, {accum} accumulation step(s)" if seq_length is None
         else f"rows padded to the longest row of the training data, {s} tokens (max_seq_length="
              f"{t.hyperparameters.max_seq_length}), micro-batch {b}, {accum} accumulation step(s)"),
        "AdamW: two fp32 moments per trainable parameter",
        f"activations: {job.regime.name} regime, {t.attention} attention, "
        f"{'checkpointing every block' if t.gradient_checkpointing else 'no checkpointing'}",
    ]
    if job.padded:
        out.append("the widest micro-batch holds shorter rows: attention runs with a padding mask "
                   "(every head's keys and values and an additive mask kept per block)")
    if t.activation_offload and job.on_gpu:
        out.append("activation offload: the forward's saved activations in pinned host memory (torch's "
                   "pinned allocator rounds each block up to a power of two), one block's back on the "
                   "device at a time in backward")
    return out
