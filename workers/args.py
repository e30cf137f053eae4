"""The one place a JobSpec becomes flat training arguments. Strategy code only ever sees TrainArgs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from service.domain.spec import RunRequest, dpo_beta, rl_reference_mode
from service.domain.training import MERGEABLE_PEFT, local_stages


@dataclass
class TrainArgs:
    job_id: str
    output_dir: str
    training_path: str
    model: str
    validation_path: str | None = None
    suffix: str | None = None  # the fine-tuned model's name (service/domain/model_names.py)
    model_path: str | None = None
    attempt: int = 1
    strategy: str = "ddp"
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    attention: str = "sdpa"
    loss_chunk_tokens: int | None = None  # workers/chunked_loss.py; None: the whole micro-batch at once
    activation_offload: bool = False  # workers/activation_offload.py
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    micro_batch_size: int = 4
    accumulation: int = 1
    max_seq_length: int = 512
    max_steps: int | None = None
    n_epochs: int = 1
    packing: bool = False
    method: str = "supervised"  # or "dpo" (workers/dpo.py)
    dpo_beta: float = 0.1
    dpo_reference: str = "auto"  # service/domain/spec.py dpo_reference_mode
    # method "reinforcement" (workers/rl.py): the grader as given, training.rl's knobs
    rl_grader: dict | None = None
    rl_samples_per_prompt: int = 4
    rl_max_completion_tokens: int = 64
    rl_temperature: float = 1.0
    rl_top_p: float = 1.0
    rl_clip_epsilon: float = 0.2
    rl_kl_coef: float = 0.0
    rl_reference: str = "none"  # service/domain/spec.py rl_reference_mode
    rl_sampler_memory_fraction: float | None = None
    rl_eval_samples: int = 1
    rl_grader_timeout_s: float = 30.0
    rl_grader_memory_bytes: int = 512 * 2**20
    seed: int = 42
    peft_method: str = "none"
    peft_r: int = 8
    peft_alpha: float = 16.0
    peft_dropout: float = 0.0
    peft_targets: list[str] | str = "auto"
    peft_virtual_tokens: int = 16
    peft_merge: bool = True  # asked for; ``merges_adapter`` says whether the method allows it
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    ds_stage: int = 2
    ds_offload_optimizer: str = "none"
    ds_offload_param: str = "none"
    ds_reduce_bucket_elements: int | None = None
    ds_nvme_path: str | None = None  # offload to nvme: the spec's nvme_path
    qat_enabled: bool = False
    qat_scheme: str = "int8-dynamic-act-int4-weight"  # workers.strategies.qat.qat_base_config
    qat_group_size: int = 32
    pipeline_schedule: str = "1f1b"
    pipeline_stages: int = 2
    pipeline_local_stages: int = 1  # interleaved_1f1b: model stages per rank (service/domain/training.py: local_stages)
    pipeline_microbatches: int = 4
    tensor_parallel_size: int | None = None  # strategy tensor: None is the world size
    checkpoint_every_steps: int = 50
    eval_every_steps: int | None = None  # None: service/domain/training.py eval_interval's default
    telemetry_every_steps: int = 1
    memory_trace_every_steps: int = 10
    host_memory_budget_bytes: int | None = None
    plan: dict | None = None
    # Fault injection for tests: "<step>[:<rank>]" makes that rank exit once at that step.
    fail_at: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def dpo(self) -> bool:
        return self.method == "dpo"

    @property
    def rl(self) -> bool:
        return self.method == "reinforcement"

    @property
    def is_peft(self) -> bool:
        return self.peft_method != "none"

    @property
    def merges_adapter(self) -> bool:
        """Also export a merged model: asked for, and the method's adapter folds into the weights."""
        return self.peft_merge and self.peft_method in MERGEABLE_PEFT

    def to_dict(self) -> dict:
        return asdict(self)


def train_args(req: RunRequest, fail_at: str | None = None) -> TrainArgs:
    spec = req.spec
    t = spec.training
    hp = t.hyperparameters
    r = spec.resolved()
    peft_method = t.peft.method.value
    return TrainArgs(
        job_id=req.job_id,
        attempt=req.attempt,
        output_dir=req.output_dir,
        training_path=req.training_path,
        validation_path=req.validation_path,
        model=spec.model,
        suffix=spec.suffix,
        model_path=req.model_path,
        strategy=t.strategy.value,
        precision=t.precision.value,
        gradient_checkpointing=t.gradient_checkpointing,
        attention=t.attention,
        loss_chunk_tokens=t.loss_chunk_tokens,
        activation_offload=t.activation_offload,
        learning_rate=r.learning_rate,
        weight_decay=hp.weight_decay,
        warmup_steps=hp.warmup_steps,
        max_grad_norm=hp.max_grad_norm,
        micro_batch_size=r.micro_batch_size,
        accumulation=r.gradient_accumulation_steps,
        max_seq_length=hp.max_seq_length,
        max_steps=hp.max_steps,
        n_epochs=r.n_epochs,
        packing=hp.packing,
        method=spec.method.type,
        dpo_beta=dpo_beta(spec.openai_hyperparameters.beta) if spec.method.type == "dpo" else 0.1,
        dpo_reference=t.dpo_reference,
        **rl_args(spec),
        seed=r.seed,
        peft_method=peft_method,
        peft_r=t.peft.r,
        peft_alpha=t.peft.alpha,
        peft_dropout=t.peft.dropout,
        peft_targets=t.peft.target_modules,
        peft_virtual_tokens=t.peft.num_virtual_tokens,
        peft_merge=t.peft.merge,
        fsdp_reshard_after_forward=t.fsdp.reshard_after_forward,
        fsdp_cpu_offload=t.fsdp.cpu_offload,
        ds_stage=t.deepspeed.zero_stage,
        ds_offload_optimizer=t.deepspeed.offload_optimizer,
        ds_offload_param=t.deepspeed.offload_param,
        ds_reduce_bucket_elements=t.deepspeed.reduce_bucket_elements,
        ds_nvme_path=t.deepspeed.nvme_path,
        qat_enabled=t.qat.enabled,
        qat_scheme=t.qat.scheme,
        qat_group_size=t.qat.group_size,
        pipeline_schedule=t.pipeline.schedule,
        pipeline_stages=t.pipeline.stages,
        pipeline_local_stages=local_stages(t.pipeline.schedule, t.pipeline.virtual_stages),
        pipeline_microbatches=r.pipeline_microbatches,
        tensor_parallel_size=t.tensor_parallel.size,
        checkpoint_every_steps=t.checkpoint_every_steps,
        eval_every_steps=t.eval_every_steps,
        telemetry_every_steps=t.telemetry_every_steps,
        memory_trace_every_steps=t.memory_trace_every_steps,
        host_memory_budget_bytes=t.resources.host_memory_budget_bytes,
        plan=req.plan,
        fail_at=fail_at if fail_at is not None else os.environ.get("MEMFIT_FAIL_AT_STEP"),
    )


def rl_args(spec) -> dict:
    """method 'reinforcement': the grader and training.rl as flat arguments (workers/rl.py)."""
    if spec.method.type != "reinforcement" or spec.method.reinforcement is None:
        return {}
    t, rl = spec.training, spec.training.rl
    samples = spec.method.reinforcement.hyperparameters.eval_samples
    return dict(rl_grader=spec.method.reinforcement.grader.model_dump(mode="json", exclude_none=True),
                rl_samples_per_prompt=rl.samples_per_prompt, rl_max_completion_tokens=rl.max_completion_tokens,
                rl_temperature=rl.temperature, rl_top_p=rl.top_p, rl_clip_epsilon=rl.clip_epsilon, rl_kl_coef=rl.kl_coef,
                rl_reference=rl_reference_mode(t), rl_sampler_memory_fraction=rl.sampler_memory_fraction,
                rl_eval_samples=1 if samples == "auto" else int(samples), rl_grader_timeout_s=rl.grader_timeout_s,
                rl_grader_memory_bytes=rl.grader_memory_bytes)
