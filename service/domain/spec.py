"""The job spec: one pydantic model that the API validates, the store keeps and the workers run.

The body is OpenAI's fine-tuning create body (``model``, ``training_file``, ``method`` …) plus one
extension object, ``training``, that carries every memfit knob. Every field has a default, a
description and bounds; rules that involve several fields are collected by :func:`check_rules`
and raised together as :class:`SpecError`, each naming its field with a dotted path.

A caller may speak only OpenAI's knobs (``batch_size``, ``learning_rate_multiplier``, ``n_epochs``);
:func:`derive` turns them into memfit's (micro-batch, accumulation, learning rate, epochs) once, when
the job is created, so the stored spec is explicit, and reports each value it filled in. Only a
combination the caller set can be refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.domain.elastic import WorldPlan
from service.domain.graders import Grader
from service.domain.model_names import check_suffix
from service.domain.training import MERGEABLE_PEFT, TENSOR_PEFT
from service.domain.storage import ObjectStore


class Strict(BaseModel):
    """Base for every spec object: unknown fields are rejected, not ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)


Auto = Literal["auto"]


# --- OpenAI's create body ---------------------------------------------------------------------


class OpenAIHyperparameters(Strict):
    n_epochs: Union[Auto, int] = Field(
        "auto",
        description="Passes over the training file. 'auto' follows OpenAI's rule for the file's size "
        "(service.domain.spec.auto_epochs: 3, raised to see 100 examples or lowered to 25,000, within 1–25).",
    )
    batch_size: Union[Auto, int] = Field(
        "auto",
        description="Global batch in examples per optimizer step: micro_batch_size × "
        "gradient_accumulation_steps × data-parallel workers. A number is split over those three "
        "(service.domain.spec.split_batch); 'auto' is whatever `training` makes of them.",
    )
    learning_rate_multiplier: Union[Auto, float] = Field(
        "auto", description="Multiplies memfit's base rate, training.hyperparameters.learning_rate; 'auto' is 1."
    )

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v):
        if v != "auto" and not 1 <= v <= 100:
            raise ValueError("n_epochs must be between 1 and 100")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if v != "auto" and not 1 <= v <= 65536:
            raise ValueError("batch_size must be between 1 and 65536")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _lrm(cls, v):
        if v != "auto" and not 0 < v <= 100:
            raise ValueError("learning_rate_multiplier must be in (0, 100]")
        return v


class Supervised(Strict):
    hyperparameters: OpenAIHyperparameters = Field(default_factory=OpenAIHyperparameters)


DEFAULT_DPO_BETA = 0.1  # 'auto': the DPO paper's and TRL's default


def dpo_beta(beta: Union[Literal["auto"], float]) -> float:
    """DPO's β with 'auto' worked out."""
    return DEFAULT_DPO_BETA if beta == "auto" else float(beta)


class DpoHyperparameters(OpenAIHyperparameters):
    beta: Union[Auto, float] = Field(
        "auto", description="DPO's β: how far the policy may move from the reference (the loss is "
                            "−log σ(β·((log π_c − log ref_c) − (log π_r − log ref_r)))); 'auto' is 0.1. Within (0, 2].")

    @field_validator("beta")
    @classmethod
    def _beta(cls, v):
        if v != "auto" and not 0 < v <= 2:
            raise ValueError("beta must be in (0, 2]")
        return v


class Dpo(Strict):
    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)


DEFAULT_SAMPLES_PER_PROMPT = 4  # compute_multiplier 'auto' (training.rl.samples_per_prompt's default)


class ReinforcementHyperparameters(OpenAIHyperparameters):
    eval_interval: Union[Auto, int] = Field(
        "auto", description="Training steps between evaluations of the validation file (its mean reward); 'auto': "
                            "training.eval_every_steps (about four per run).")
    eval_samples: Union[Auto, int] = Field(
        "auto", description="Samples per validation prompt at each evaluation; 'auto' is 1.")
    compute_multiplier: Union[Auto, float] = Field(
        "auto", description="Scales the samples drawn per prompt each step: training.rl.samples_per_prompt × it, "
                            "at least 2 (a group needs two to compare); 'auto' is 1.")
    reasoning_effort: Literal["default", "low", "medium", "high"] = Field(
        "default", description="OpenAI's reasoning models' effort; memfit's models do not reason: only 'default'.")

    @field_validator("eval_interval", "eval_samples")
    @classmethod
    def _positive(cls, v):
        if v != "auto" and not 1 <= v <= 1_000_000:
            raise ValueError("must be between 1 and 1000000")
        return v

    @field_validator("compute_multiplier")
    @classmethod
    def _compute(cls, v):
        if v != "auto" and not 0 < v <= 10:
            raise ValueError("compute_multiplier must be in (0, 10]")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v):
        if v != "default":
            raise ValueError(f"reasoning_effort {v!r} is not supported: memfit's models do not reason; leave it "
                             "'default'")
        return v


class Reinforcement(Strict):
    grader: Grader = Field(..., description="How each sample is scored (service/domain/graders.py): string_check, "
                                            "text_similarity, python, score_model or multi.")
    hyperparameters: ReinforcementHyperparameters = Field(default_factory=ReinforcementHyperparameters)


class Method(Strict):
    type: Literal["supervised", "dpo", "reinforcement"] = Field(
        "supervised",
        description="'supervised' (chat, prompt/completion or text rows), 'dpo' (preference rows: input, "
                    "preferred_output, non_preferred_output) or 'reinforcement' (prompt rows and a grader: "
                    "workers/rl.py).",
    )
    supervised: Supervised = Field(default_factory=Supervised)
    dpo: Dpo | None = Field(None, description="Direct preference optimization's hyperparameters (method.type 'dpo').")
    reinforcement: Reinforcement | None = Field(
        None, description="Reinforcement fine-tuning's grader and hyperparameters (method.type 'reinforcement')."
    )


class WandbIntegration(Strict):
    project: str = Field(..., min_length=1, max_length=256, description="Weights & Biases project.")
    entity: str | None = Field(None, max_length=256, description="Team or user the run belongs to.")
    name: str | None = Field(None, max_length=256, description="Display name of the run.")
    tags: list[str] | None = Field(None, max_length=64, description="Tags attached to the run.")


class MlflowIntegration(Strict):
    tracking_uri: str | None = Field(
        None, max_length=2048,
        description="An MLflow tracking server (http:// or https://); None: a store in the job's own folder, served "
                    "with its artefacts (mlruns/). A path on the server's disk cannot be named.")
    experiment: str = Field("memfit", min_length=1, max_length=256, description="The MLflow experiment of the run.")
    run_name: str | None = Field(None, max_length=256, description="The run's name; None: the job id.")

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v):
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("tracking_uri must be an http:// or https:// URL (leave it out for a store in the job's folder)")
        return v


class Integration(Strict):
    """OpenAI's integration object (W&B), and memfit's MLflow beside it. Each runs where the job's metrics are
    gathered (workers/integrations.py): every step's metrics, the config and the final summary."""

    type: Literal["wandb", "mlflow"] = Field(..., description="'wandb' (OpenAI's) or 'mlflow' (memfit's extension).")
    wandb: WandbIntegration | None = Field(
        None, description="The W&B run. Online where the server has WANDB_API_KEY, else offline into the job's folder "
                          "(wandb/, an artefact `wandb sync` uploads later).")
    mlflow: MlflowIntegration | None = Field(None, description="The MLflow run (type 'mlflow').")

    @model_validator(mode="after")
    def _its_object(self):
        if getattr(self, self.type) is None:
            raise ValueError(f"an integration of type {self.type!r} needs its {self.type!r} object")
        other = "mlflow" if self.type == "wandb" else "wandb"
        if getattr(self, other) is not None:
            raise ValueError(f"{other!r} belongs to an integration of type {other!r}")
        return self


# --- memfit's extension: `training` -----------------------------------------------------------


class StrategyName(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"
    deepspeed = "deepspeed"
    pipeline = "pipeline"
    tensor = "tensor"


class PeftMethod(str, Enum):
    none = "none"
    lora = "lora"
    qlora = "qlora"
    ia3 = "ia3"
    loha = "loha"
    lokr = "lokr"
    prefix_tuning = "prefix_tuning"
    prompt_tuning = "prompt_tuning"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class MemoryPolicy(str, Enum):
    reject = "reject"
    auto = "auto"
    ignore = "ignore"


class TrainingHyperparameters(Strict):
    learning_rate: float = Field(2e-4, gt=0, le=1.0, description="Peak learning rate of AdamW.")
    micro_batch_size: int = Field(
        4, ge=1, le=4096, description="Examples per forward/backward on one worker."
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, le=4096, description="Micro-batches whose gradients are summed before one optimizer step."
    )
    max_seq_length: int = Field(512, ge=8, le=1_048_576, description="Tokens per example after truncation.")
    max_steps: int | None = Field(
        None, ge=1, le=10_000_000, description="Optimizer steps; None runs n_epochs over the data."
    )
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Linear warm-up steps before cosine decay.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; None disables.")
    packing: bool = Field(False, description="Pack several examples into each max_seq_length row; each keeps its own "
                                             "positions and attends only to itself (a block-diagonal causal mask).")


class FSDPOptions(Strict):
    reshard_after_forward: bool = Field(
        True,
        description="True: full sharding (params re-gathered for backward, like ZeRO-3). "
        "False: keep params gathered through backward (like ZeRO-2).",
    )
    cpu_offload: bool = Field(False, description="Keep sharded params, grads and optimizer states in host memory.")


class DeepSpeedOptions(Strict):
    zero_stage: int = Field(2, ge=0, le=3, description="ZeRO stage: 0 none, 1 optimizer, 2 +grads, 3 +params.")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field("none", description=(
        "Optimizer states to host memory (cpu) or to a local disk (nvme: ZeRO-Infinity, stage 3, needs nvme_path)."))
    offload_param: Literal["none", "cpu", "nvme"] = Field("none", description=(
        "Parameters to host memory (cpu) or to a local disk (nvme: ZeRO-Infinity, needs nvme_path); stage 3 only."))
    nvme_path: str | None = Field(None, max_length=1024, description=(
        "nvme offload: an absolute path to a directory on a local disk, the same path on every node; each job "
        "writes its ranks' swap files under <nvme_path>/memfit/<job>/ and removes them when it ends."))
    reduce_bucket_elements: int | None = Field(
        None,
        ge=1,
        description="Reduce bucket size in elements; None uses hidden², not DeepSpeed's 5e8 default.",
    )


class PipelineOptions(Strict):
    stages: int = Field(2, ge=2, le=128, description=(
        "Pipeline stages, one per worker; resources.num_workers is a multiple of it (the rest is data parallel)."))
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description=(
        "Pipeline schedule: gpipe runs every chunk's forward before any backward; 1f1b holds at most `stages`; "
        "interleaved_1f1b gives each worker `virtual_stages` non-adjacent slices of the blocks (a smaller bubble)."))
    virtual_stages: int | None = Field(None, ge=2, le=32, description=(
        "interleaved_1f1b: model stages per worker (the blocks are split into stages × virtual_stages); "
        "None: 2. Only with schedule interleaved_1f1b."))
    microbatches: int | None = Field(None, ge=1, le=1024, description=(
        "Chunks each micro-batch is split into as it flows through the stages; divides micro_batch_size. "
        "None: one row per chunk (micro_batch_size chunks)."))


class TensorParallelOptions(Strict):
    size: int | None = Field(None, ge=2, le=128, description=(
        "Ranks each layer's attention heads and MLP columns are split over (strategy tensor); "
        "resources.num_workers is a multiple of it (the rest is FSDP2 data parallel). None: num_workers."))


class PeftOptions(Strict):
    method: PeftMethod = Field(PeftMethod.none, description="Parameter-efficient method, or none for a full fine-tune.")
    r: int = Field(8, ge=1, le=1024, description="Rank for lora/qlora/loha/lokr.")
    alpha: float = Field(16.0, gt=0, le=4096, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["auto"] = Field(
        "auto", description="Module names to adapt; 'auto' picks the attention projections of the family."
    )
    num_virtual_tokens: int = Field(16, ge=1, le=1024, description="Virtual tokens for prefix/prompt tuning.")
    merge: bool = Field(True, description="Also save a merged full model where the method allows.")


class QATOptions(Strict):
    enabled: bool = Field(False, description="Quantization-aware training with torchao fake quantization.")
    scheme: Literal["int8-dynamic-act-int4-weight", "int4-weight-only"] = Field(
        "int8-dynamic-act-int4-weight", description="torchao QAT scheme."
    )
    group_size: int = Field(32, ge=8, le=1024, description="Weight quantization group size.")


class Resources(Strict):
    num_workers: int = Field(1, ge=1, le=4096, description="Ray Train workers (data-parallel ranks or stages).")
    min_workers: int | None = Field(
        None, ge=1, le=4096,
        description="Elastic: run on as few as this many workers when num_workers are not free (a node lost, a "
                    "busy cluster); Ray Train starts the largest group that fits and the global batch is kept "
                    "by more accumulation (service/memory/elastic.py). None: exactly num_workers.")
    gpus_per_worker: float = Field(0, ge=0, le=16, description="GPUs per worker; 0 runs on CPUs.")
    gpu_type: str | None = Field(
        None, description="A named GPU from the catalogue (e.g. 'a100-40gb'); None for CPU workers."
    )
    cpus_per_worker: float = Field(1, gt=0, le=512, description="CPUs reserved per worker.")
    host_memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="Fail a worker whose process memory exceeds this many bytes (out_of_memory on CPU).",
    )


class RLOptions(Strict):
    """memfit's knobs of reinforcement fine-tuning (method.type 'reinforcement', workers/rl.py)."""

    samples_per_prompt: int = Field(
        DEFAULT_SAMPLES_PER_PROMPT, ge=2, le=256,
        description="n: completions sampled per prompt each step, the group whose rewards are normalised into "
                    "advantages (method.reinforcement.hyperparameters.compute_multiplier scales it).")
    max_completion_tokens: int = Field(64, ge=1, le=65536, description="Longest sampled completion, in tokens.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling's mass.")
    clip_epsilon: float = Field(0.2, gt=0, le=1, description="PPO's clip of the probability ratio (1 ± ε).")
    kl_coef: float = Field(0.0, ge=0, le=10, description="Weight of the KL penalty to the reference (k3 estimator); "
                                                           "0: no reference is held or run.")
    reference: Literal["auto", "adapter_disabled", "frozen_copy"] = Field(
        "auto", description="The KL term's reference (kl_coef > 0): the PEFT base with its adapter disabled (no "
                            "second model) or a frozen copy of the base; auto: adapter_disabled with LoRA-like PEFT.")
    sampler_memory_fraction: float | None = Field(
        None, gt=0, le=1,
        description="Cap the sampler's KV cache at this fraction of the worker's memory: the prompts of a "
                    "micro-batch are sampled in as many rounds as it takes (service/memory/rl.py). None: one round.")
    grader_timeout_s: float = Field(30.0, gt=0, le=3600, description="A python grader's wall-clock limit per batch.")
    grader_memory_bytes: int = Field(512 * 2**20, ge=64 * 2**20, le=64 * 2**30,
                                     description="A python grader's address-space limit.")


class TrainingOptions(Strict):
    hyperparameters: TrainingHyperparameters = Field(default_factory=TrainingHyperparameters)
    strategy: StrategyName = Field(StrategyName.ddp, description="How model state is split across workers.")
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    pipeline: PipelineOptions = Field(default_factory=PipelineOptions)
    tensor_parallel: TensorParallelOptions = Field(default_factory=TensorParallelOptions)
    peft: PeftOptions = Field(default_factory=PeftOptions)
    precision: Precision = Field(Precision.fp32, description="fp32, bf16 autocast, or fp16 with a grad scaler (GPU only).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward instead of keeping them.")
    attention: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel; eager keeps the s² score matrix.")
    loss_chunk_tokens: int | None = Field(
        None, ge=128, le=16_777_216,
        description="Compute the LM head and cross-entropy over chunks of this many tokens, recomputing each "
                    "chunk's logits in backward, so the micro-batch's fp32 logits never exist whole "
                    "(workers/chunked_loss.py). Costs a second forward of the LM head; None: the whole micro-batch at once.")
    activation_offload: bool = Field(
        False, description="Move what the forward saves for backward to pinned host memory and back (GPU only: "
                           "on a CPU worker the host is the same memory).")
    qat: QATOptions = Field(default_factory=QATOptions)
    resources: Resources = Field(default_factory=Resources)
    memory_policy: MemoryPolicy = Field(
        MemoryPolicy.reject, description="A job predicted not to fit: reject it, auto-fix it, or ignore."
    )
    checkpoint_every_steps: int = Field(50, ge=1, le=1_000_000, description="Ray Train checkpoint cadence.")
    dpo_reference: Literal["auto", "adapter_disabled", "frozen_copy", "precomputed"] = Field(
        "auto",
        description="method.type 'dpo': the reference model's log-probabilities. adapter_disabled: the PEFT base "
                    "without its adapter (no second model); frozen_copy: a second, frozen copy of the base (ddp, "
                    "fsdp); precomputed: computed once before training, by the model before its first step, and "
                    "kept (16 bytes a pair; no reference forward during training). auto: adapter_disabled with "
                    "LoRA-like PEFT, precomputed otherwise.")
    rl: RLOptions = Field(default_factory=RLOptions, description="method.type 'reinforcement': sampling, the loss, "
                                                                 "the reference and the graders' limits.")
    eval_every_steps: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Evaluate the validation file (loss and mean token accuracy) every this many steps, whatever the "
                    "checkpoints, and after the last step (then also OpenAI's full_valid_loss); None: about four "
                    "times per run (service/domain/training.py eval_interval).")
    max_failures: int = Field(
        1, ge=0, le=100,
        description="Worker-group restarts from the latest checkpoint (after a worker fails, or the run stalls).")
    stall_timeout_s: int | None = Field(
        None, ge=5, le=7 * 86400,
        description="A run with no new training step for this long is restarted from its latest checkpoint "
                    "(then failed `stalled` once max_failures is spent); default 10× its mean step time, at least 300 s.")
    on_oom: Literal["fail", "downshift"] = Field(
        "fail",
        description="A worker that runs out of memory: fail the job (with its post-mortem), or downshift — resume "
                    "from the latest checkpoint with the planner's cheapest change that fits and keeps the global "
                    "batch and the optimizer (smaller micro-batch × more accumulation, then checkpointing, then "
                    "offload/sharding).")
    max_downshifts: int = Field(
        2, ge=1, le=8,
        description="How many times on_oom: downshift may change the job before an out-of-memory failure ends it.")
    memory_alarm: Literal["warn", "stop"] = Field(
        "warn",
        description="A rank whose measured memory departs from its step's plan by more than the strategy's measured "
                    "margin, or grows from step to step (a leak): warn (a job event naming the rank, the category and "
                    "how much), or stop — the same event, then the job ends failed (error code memory_alarm) before "
                    "it runs out of memory.")
    telemetry_every_steps: int = Field(1, ge=1, le=100_000, description="Metrics and memory sample cadence.")
    memory_trace_every_steps: int = Field(
        10, ge=1, le=100_000, description="Cadence of the exact per-category memory trace (every allocation of one step, "
                                         "recorded by the profiler: a few % of that step on CPU)."
    )


class JobSpec(Strict):
    model: str = Field(
        ...,
        min_length=1,
        max_length=512,
        description="'preset:tiny-llama', a directory under MEMFIT_MODEL_DIRS, or a hub id.",
    )
    training_file: str = Field(..., min_length=1, max_length=128, description="A file id from POST /v1/files.")
    validation_file: str | None = Field(None, max_length=128, description="A file id for eval loss.")
    suffix: str | None = Field(
        None, max_length=64,
        description="Added to the fine-tuned model's name, ft:{model}:{suffix}:{job id} (service/domain/model_names.py); "
                    "up to 64 letters, digits, '-' and '_'.")
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description="Random seed; None picks one.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs.")
    integrations: list[Integration] | None = Field(
        None, max_length=16, description="Where the run's metrics also go: W&B (OpenAI's) and MLflow (memfit's); "
                                         "workers/integrations.py."
    )
    hyperparameters: OpenAIHyperparameters | None = Field(
        None, description="Deprecated by OpenAI in favour of method.supervised.hyperparameters."
    )
    method: Method = Field(default_factory=Method)
    training: TrainingOptions = Field(default_factory=TrainingOptions)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("metadata holds at most 16 keys")
        for key, value in v.items():
            if len(key) > 64:
                raise ValueError(f"metadata key {key[:20]!r}… is longer than 64 characters")
            if len(value) > 512:
                raise ValueError(f"metadata value of {key!r} is longer than 512 characters")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        return check_suffix(v)  # what a model name can carry (service/domain/model_names.py)

    # --- derived values: what the workers and the planner actually use --------------------

    @property
    def openai_hyperparameters(self) -> OpenAIHyperparameters:
        if self.method.type == "dpo":
            return (self.method.dpo or Dpo()).hyperparameters
        if self.method.type == "reinforcement" and self.method.reinforcement is not None:
            return self.method.reinforcement.hyperparameters
        return self.hyperparameters or self.method.supervised.hyperparameters

    @property
    def method_key(self) -> str:
        """Where the method's hyperparameters live: method.supervised, method.dpo or method.reinforcement."""
        return self.method.type if self.method.type in ("dpo", "reinforcement") else "supervised"

    def resolved(self) -> "Resolved":
        """The numbers a run uses, with every 'auto' replaced. A stored spec states them (derive() made
        them explicit when the job was created); for a body not yet derived these are what derive()
        will make of it, with n_epochs 'auto' taken for a file of unknown size."""
        oh = self.openai_hyperparameters
        split = split_batch(self)
        multiplier = 1.0 if oh.learning_rate_multiplier == "auto" else float(oh.learning_rate_multiplier)
        return Resolved(
            n_epochs=auto_epochs(None) if oh.n_epochs == "auto" else int(oh.n_epochs),
            micro_batch_size=split.micro_batch_size,
            gradient_accumulation_steps=split.gradient_accumulation_steps,
            data_parallel_size=split.data_parallel_size,
            global_batch_size=split.global_batch_size,
            learning_rate=self.training.hyperparameters.learning_rate * multiplier,
            learning_rate_multiplier=multiplier,
            seed=self.seed if self.seed is not None else 42,
            pipeline_microbatches=self.training.pipeline.microbatches or split.micro_batch_size,
        )


class Resolved(Strict):
    n_epochs: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    global_batch_size: int
    learning_rate: float
    learning_rate_multiplier: float
    seed: int
    pipeline_microbatches: int = 1  # strategy pipeline: chunks per micro-batch


# --- problems: each names its field -----------------------------------------------------------


class FieldProblem(BaseModel):
    param: str
    message: str
    code: str = "invalid_value"


class SpecError(ValueError):
    """Several problems with one spec, each naming its field; raised once with all of them."""

    def __init__(self, problems: list[FieldProblem]):
        self.problems = problems
        super().__init__("; ".join(f"{p.param}: {p.message}" for p in problems))


# --- OpenAI's hyperparameters → memfit's ------------------------------------------------------
#
# A caller who speaks only OpenAI's API sets batch_size, learning_rate_multiplier and n_epochs; the
# workers need a micro-batch, an accumulation count, a learning rate and an epoch count. The rules
# live here once: split_batch and auto_epochs say how, resolved() reads them, and derive() writes
# their answers into the spec when a job is created, so the stored spec is what runs.


def _upper_bound(field: str) -> int:
    return next(m.le for m in TrainingHyperparameters.model_fields[field].metadata if getattr(m, "le", None))


DEFAULT_MICRO_BATCH = TrainingHyperparameters.model_fields["micro_batch_size"].default
MAX_MICRO_BATCH = _upper_bound("micro_batch_size")
MAX_ACCUMULATION = _upper_bound("gradient_accumulation_steps")

# OpenAI's rule for n_epochs 'auto', as its cookbook states it ("Data preparation and analysis for
# chat model fine-tuning"): 3 epochs, raised until 100 examples are seen in all, lowered until at most
# 25,000 are, never outside 1–25.
TARGET_EPOCHS, MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES, MIN_AUTO_EPOCHS, MAX_AUTO_EPOCHS = 3, 100, 25_000, 1, 25


def auto_epochs(training_examples: int | None) -> int:
    """n_epochs for 'auto' and a training file of ``training_examples`` rows (None: not known yet)."""
    if not training_examples:
        return TARGET_EPOCHS
    if training_examples * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, MIN_TARGET_EXAMPLES // training_examples)
    if training_examples * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(MIN_AUTO_EPOCHS, MAX_TARGET_EXAMPLES // training_examples)
    return TARGET_EPOCHS


@dataclass(frozen=True)
class BatchSplit:
    """global batch = micro_batch_size × gradient_accumulation_steps × data_parallel_size."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    problem: FieldProblem | None = None  # the caller's own values conflict; the numbers are then a fallback

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _micro_batch_for(share: int) -> int:
    """The micro-batch for one worker's ``share`` of the batch when the caller named neither it nor the
    accumulation: the largest divisor not over the default (memory stays where the default puts it),
    unless that needs more accumulation steps than allowed, then the smallest divisor that does not."""
    micro = max(d for d in range(1, min(DEFAULT_MICRO_BATCH, share) + 1) if share % d == 0)
    if share // micro <= MAX_ACCUMULATION:
        return micro
    return next(d for d in range(-(-share // MAX_ACCUMULATION), share + 1) if share % d == 0)


def tensor_parallel_size(t: TrainingOptions) -> int:
    """The ranks one model is split over under strategy tensor: tensor_parallel.size, or every worker."""
    return t.tensor_parallel.size or t.resources.num_workers


def split_batch(spec: JobSpec) -> BatchSplit:
    """How ``spec``'s global batch is made.

    batch_size 'auto': from training.hyperparameters (given or default) and the workers. A number B:
    each data-parallel worker takes B ÷ workers; of micro-batch and accumulation, what the caller gave
    is kept and the rest derived (neither given: see _micro_batch_for). Only values the caller gave can
    conflict — workers that cannot share B evenly, a micro-batch or accumulation that does not divide a
    worker's share, or both given and not multiplying to it — and then ``problem`` names batch_size and
    the numbers are the old rule's (accumulation = B ÷ (micro-batch × workers)), so a spec stored before
    this rule still renders.
    """
    t = spec.training
    hp = t.hyperparameters
    dp = t.resources.num_workers if t.strategy != StrategyName.pipeline else max(1, t.resources.num_workers // t.pipeline.stages)
    if t.strategy == StrategyName.tensor:
        dp = max(1, t.resources.num_workers // tensor_parallel_size(t))
    batch = spec.openai_hyperparameters.batch_size
    if batch == "auto":
        return BatchSplit(hp.micro_batch_size, hp.gradient_accumulation_steps, dp)
    given = hp.model_fields_set
    micro = hp.micro_batch_size if "micro_batch_size" in given else None
    accumulation = hp.gradient_accumulation_steps if "gradient_accumulation_steps" in given else None
    where = "hyperparameters" if spec.hyperparameters is not None else f"method.{spec.method_key}.hyperparameters"
    param = f"{where}.batch_size"
    workers = _plural(dp, "data-parallel worker")

    def refused(message: str) -> BatchSplit:
        fallback = max(1, batch // (hp.micro_batch_size * dp))
        return BatchSplit(hp.micro_batch_size, fallback, dp, FieldProblem(param=param, message=message))

    if batch % dp:
        return refused(f"batch_size {batch} cannot be shared evenly by training.resources.num_workers = {workers}; "
                       f"use a multiple of {dp}")
    share = batch // dp
    if micro is not None and accumulation is not None:
        if micro * accumulation != share:
            return refused(f"batch_size {batch} is not training.hyperparameters.micro_batch_size {micro} × "
                           f"gradient_accumulation_steps {accumulation} × {workers} = {micro * accumulation * dp}")
    elif micro is not None:
        if share % micro:
            return refused(f"batch_size {batch} is not a multiple of training.hyperparameters.micro_batch_size "
                           f"{micro} × {workers} = {micro * dp}")
        accumulation = share // micro
    elif accumulation is not None:
        if share % accumulation:
            return refused(f"batch_size {batch} is not a multiple of training.hyperparameters."
                           f"gradient_accumulation_steps {accumulation} × {workers} = {accumulation * dp}")
        micro = share // accumulation
    else:
        micro = _micro_batch_for(share)
        accumulation = share // micro
    if accumulation > MAX_ACCUMULATION:
        return refused(f"batch_size {batch} with micro_batch_size {micro} × {workers} needs {accumulation} "
                       f"gradient_accumulation_steps, over the limit of {MAX_ACCUMULATION}")
    if micro > MAX_MICRO_BATCH:
        return refused(f"batch_size {batch} with gradient_accumulation_steps {accumulation} × {workers} needs "
                       f"micro_batch_size {micro}, over the limit of {MAX_MICRO_BATCH}")
    return BatchSplit(micro, accumulation, dp)


@dataclass(frozen=True)
class Derivation:
    """One value filled in at create time; the job records it as an event (add_event's keywords)."""

    message: str
    data: dict[str, Any]
    level: str = "info"


@dataclass(frozen=True)
class Derived:
    spec: JobSpec
    derivations: list[Derivation]


def derive(spec: JobSpec, *, training_examples: int | None = None, seed: int | None = None) -> Derived:
    """Make a validated spec explicit, once, when its job is created; the stored spec then says what the
    workers run and the planner plans, and resolved() on it only reads. What is filled in:

    - the deprecated top-level ``hyperparameters`` move to method.supervised.hyperparameters;
    - batch_size → training.hyperparameters.micro_batch_size and gradient_accumulation_steps
      (split_batch). 'auto' stays 'auto': it means "whatever those and the workers make", which the
      memory pre-flight may still change (more workers, a smaller micro-batch); a number is kept;
    - learning_rate_multiplier 'auto' → 1.0; the run's rate is training.hyperparameters.learning_rate × it;
    - n_epochs 'auto' → auto_epochs(training_examples);
    - seed unset → ``seed`` (when given);
    - integrations are kept as given (they run with the job: workers/integrations.py).

    Each is a Derivation, for a job event. Raises SpecError when the caller's own values conflict
    (validate_spec has already refused those; check_rules reports the same problems).
    """
    split = split_batch(spec)
    if split.problem is not None:
        raise SpecError([split.problem])
    oh = spec.openai_hyperparameters
    hp = spec.training.hyperparameters
    out: list[Derivation] = []
    if spec.hyperparameters is not None:
        out.append(Derivation("hyperparameters (deprecated by OpenAI) read as method.supervised.hyperparameters",
                              {"derived": "method", "from": "hyperparameters"}))
    workers = _plural(split.data_parallel_size, "worker")
    how = (f"micro_batch_size {split.micro_batch_size} × gradient_accumulation_steps "
           f"{split.gradient_accumulation_steps} × {workers}")
    batch_message = (f"batch_size auto → {split.global_batch_size} = {how}" if oh.batch_size == "auto"
                     else f"batch_size {oh.batch_size} → {how}")
    out.append(Derivation(batch_message, {
        "derived": "batch_size", "batch_size": oh.batch_size, "global_batch_size": split.global_batch_size,
        "micro_batch_size": split.micro_batch_size, "gradient_accumulation_steps": split.gradient_accumulation_steps,
        "data_parallel_workers": split.data_parallel_size}))
    multiplier = 1.0 if oh.learning_rate_multiplier == "auto" else float(oh.learning_rate_multiplier)
    out.append(Derivation(
        f"learning_rate_multiplier {oh.learning_rate_multiplier} → learning_rate {hp.learning_rate * multiplier:g} "
        f"= training.hyperparameters.learning_rate {hp.learning_rate:g} × {multiplier:g}",
        {"derived": "learning_rate", "learning_rate_multiplier": multiplier, "base_learning_rate": hp.learning_rate,
         "learning_rate": hp.learning_rate * multiplier}))
    n_epochs = oh.n_epochs
    if n_epochs == "auto":
        n_epochs = auto_epochs(training_examples)
        examples = (_plural(training_examples, "training example") if training_examples
                    else "a training file of unknown size")
        capped = (f"; training.hyperparameters.max_steps {hp.max_steps} ends the run if it comes first"
                  if hp.max_steps else "")
        out.append(Derivation(
            f"n_epochs auto → {n_epochs} for {examples} (OpenAI's rule: {TARGET_EPOCHS} epochs, raised to see "
            f"{MIN_TARGET_EXAMPLES} examples or lowered to {MAX_TARGET_EXAMPLES:,}, within "
            f"{MIN_AUTO_EPOCHS}–{MAX_AUTO_EPOCHS}){capped}",
            {"derived": "n_epochs", "n_epochs": n_epochs, "training_examples": training_examples}))
    body = spec.model_dump(mode="json")
    if spec.seed is None and seed is not None:
        body["seed"] = seed
        out.append(Derivation(f"seed not given → {seed}", {"derived": "seed", "seed": seed}))
    body["hyperparameters"] = None
    written = {"n_epochs": n_epochs, "batch_size": oh.batch_size, "learning_rate_multiplier": multiplier}
    if spec.method.type == "dpo":
        written["beta"] = dpo_beta(oh.beta)
        body["method"]["dpo"] = {"hyperparameters": written}
    elif spec.method.type == "reinforcement":
        out += _derive_reinforcement(spec, body, written)
    else:
        body["method"]["supervised"]["hyperparameters"] = written
    body["training"]["hyperparameters"].update(
        micro_batch_size=split.micro_batch_size, gradient_accumulation_steps=split.gradient_accumulation_steps)
    return Derived(JobSpec.model_validate(body), out)


def _derive_reinforcement(spec: JobSpec, body: dict, written: dict) -> list[Derivation]:
    """RL's OpenAI knobs made explicit: compute_multiplier → training.rl.samples_per_prompt, eval_interval →
    training.eval_every_steps, eval_samples 'auto' → 1."""
    oh = spec.openai_hyperparameters
    rl = spec.training.rl
    out = []
    multiplier = 1.0 if oh.compute_multiplier == "auto" else float(oh.compute_multiplier)
    n = max(2, min(256, round(rl.samples_per_prompt * multiplier)))
    body["training"]["rl"]["samples_per_prompt"] = n
    out.append(Derivation(f"compute_multiplier {oh.compute_multiplier} → {n} samples per prompt "
                          f"(training.rl.samples_per_prompt {rl.samples_per_prompt} × {multiplier:g})",
                          {"derived": "samples_per_prompt", "compute_multiplier": multiplier, "samples_per_prompt": n}))
    eval_interval = oh.eval_interval
    if eval_interval != "auto":
        body["training"]["eval_every_steps"] = int(eval_interval)
    else:
        eval_interval = spec.training.eval_every_steps or "auto"
    eval_samples = 1 if oh.eval_samples == "auto" else int(oh.eval_samples)
    written.update(eval_interval=eval_interval, eval_samples=eval_samples, compute_multiplier=multiplier,
                   reasoning_effort=oh.reasoning_effort)
    body["method"]["reinforcement"]["hyperparameters"] = written
    return out


def rl_reference_mode(t: "TrainingOptions") -> str:
    """The KL term's reference: 'none' when training.rl.kl_coef is 0, else training.rl.reference with 'auto'
    worked out (adapter_disabled for LoRA-like PEFT, frozen_copy for a full fine-tune)."""
    if t.rl.kl_coef == 0:
        return "none"
    if t.rl.reference != "auto":
        return t.rl.reference
    if t.peft.method not in (PeftMethod.none, PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        return "adapter_disabled"
    return "frozen_copy"


def rl_rules(spec: JobSpec) -> list[FieldProblem]:
    """method.type 'reinforcement' with the rest of the spec (workers/rl.py runs it; service/memory/rl.py plans it)."""
    t = spec.training
    out: list[FieldProblem] = []

    def bad(param: str, message: str) -> None:
        out.append(FieldProblem(param=param, message=message))

    if spec.method.reinforcement is None:
        bad("method.reinforcement", "method.type 'reinforcement' needs method.reinforcement with its grader")
    if spec.hyperparameters is not None:
        bad("hyperparameters", "give the hyperparameters under method.reinforcement.hyperparameters")
    if t.strategy != StrategyName.ddp:
        bad("training.strategy", f"reinforcement fine-tuning runs with strategy ddp (the sampler generates with the "
                                 f"whole policy on each rank), not {t.strategy.value}")
    if t.peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning, PeftMethod.qlora):
        bad("training.peft.method", f"{t.peft.method.value} is not built into reinforcement fine-tuning's sampler; "
                                    "use lora, ia3, loha, lokr or none")
    for name, on in (("loss_chunk_tokens", t.loss_chunk_tokens is not None), ("hyperparameters.packing",
                     t.hyperparameters.packing), ("qat.enabled", t.qat.enabled),
                     ("activation_offload", t.activation_offload)):
        if on:
            bad(f"training.{name}", f"training.{name} is not built into reinforcement fine-tuning; leave it unset")
    mode = rl_reference_mode(t)
    if mode == "adapter_disabled" and t.peft.method == PeftMethod.none:
        bad("training.rl.reference", "adapter_disabled needs a PEFT method (the base without the adapter is the "
                                     "reference); use frozen_copy for a full fine-tune, or kl_coef 0")
    if t.rl.max_completion_tokens >= t.hyperparameters.max_seq_length:
        bad("training.rl.max_completion_tokens", f"max_completion_tokens ({t.rl.max_completion_tokens}) leaves no "
                                                 f"room for the prompt within training.hyperparameters.max_seq_length "
                                                 f"({t.hyperparameters.max_seq_length})")
    return out


# --- cross-field rules ------------------------------------------------------------------------


def check_rules(spec: JobSpec, known_gpus: set[str] | None = None) -> list[FieldProblem]:
    """Every rule that involves more than one field. Returns all problems, empty when the spec is fine."""
    t = spec.training
    problems: list[FieldProblem] = []

    def bad(param: str, message: str, code: str = "invalid_value") -> None:
        problems.append(FieldProblem(param=f"training.{param}", message=message, code=code))

    on_gpu = t.resources.gpus_per_worker > 0
    ds = t.deepspeed
    peft = t.peft.method

    if spec.method.type == "reinforcement":
        problems += rl_rules(spec)
    if spec.method.type == "dpo":
        problems += dpo_rules(spec)
    for other in ("dpo", "reinforcement"):
        if getattr(spec.method, other) is not None and spec.method.type != other:
            problems.append(FieldProblem(param=f"method.{other}",
                                         message=f"method.{other} belongs to method.type {other!r}"))
    if spec.hyperparameters is not None and spec.method.supervised.hyperparameters != OpenAIHyperparameters():
        problems.append(
            FieldProblem(
                param="hyperparameters",
                message="give hyperparameters either at the top level or under method.supervised, not both",
            )
        )
    if ds.offload_param != "none" and not (t.strategy == StrategyName.deepspeed and ds.zero_stage == 3):
        bad("deepspeed.offload_param", "offload_param needs strategy 'deepspeed' with zero_stage 3")
    nvme = "nvme" in (ds.offload_optimizer, ds.offload_param)
    if ds.offload_optimizer == "nvme" and ds.zero_stage != 3:
        bad("deepspeed.offload_optimizer", "offload_optimizer 'nvme' (ZeRO-Infinity) needs zero_stage 3")
    if nvme and not ds.nvme_path:
        bad("deepspeed.nvme_path", "nvme offload needs nvme_path: a directory on a local disk of every node")
    if ds.nvme_path and not ds.nvme_path.startswith("/"):
        bad("deepspeed.nvme_path", f"nvme_path must be an absolute path, not {ds.nvme_path!r}")
    if ds.nvme_path and not nvme:
        bad("deepspeed.nvme_path", "nvme_path is only read with offload_optimizer or offload_param 'nvme'")
    if ds.offload_optimizer == "cpu" and t.strategy == StrategyName.deepspeed and ds.zero_stage == 0:
        bad("deepspeed.offload_optimizer", "offload_optimizer needs zero_stage 1, 2 or 3")
    if t.strategy != StrategyName.deepspeed and ds.offload_optimizer != "none":
        bad("deepspeed.offload_optimizer", "deepspeed options need strategy 'deepspeed'")
    if t.strategy != StrategyName.fsdp and t.fsdp.cpu_offload:
        bad("fsdp.cpu_offload", "cpu_offload needs strategy 'fsdp'")
    if t.precision == Precision.fp16 and not on_gpu:
        bad("precision", "fp16 needs GPUs (resources.gpus_per_worker > 0); use bf16 on CPU workers")
    if peft == PeftMethod.qlora and t.strategy == StrategyName.fsdp and t.fsdp.cpu_offload:
        bad("fsdp.cpu_offload", "qlora with fsdp does not offload: memfit has not run FSDP2's CPU offload on a "
                                "4-bit base, whose quantisation constants sit outside the parameters FSDP2 moves; "
                                "set fsdp.cpu_offload to false")
    if peft == PeftMethod.qlora and t.strategy == StrategyName.deepspeed:
        bad("peft.method", "qlora runs with strategy 'ddp' or 'fsdp': DeepSpeed's ZeRO flattens parameters into 16/32-bit "
                           "buffers and cannot hold the 4-bit base (use lora with deepspeed)")
    if peft == PeftMethod.qlora and t.strategy == StrategyName.pipeline:
        bad("peft.method", "qlora runs with strategy 'ddp' or 'fsdp': the pipeline strategy's stages are not built for the "
                           "4-bit base (use lora with pipeline)")
    if peft != PeftMethod.none and peft.value not in MERGEABLE_PEFT and t.peft.merge and "merge" in t.peft.model_fields_set:
        bad("peft.merge", f"{peft.value} adapters cannot be merged into the model; set merge to false")
    if peft == PeftMethod.prefix_tuning and t.gradient_checkpointing:
        # peft/peft_model.py: _setup_prompt_encoder raises "PREFIX_TUNING does not work with gradient checkpointing"
        bad("gradient_checkpointing", "prefix_tuning does not work with gradient checkpointing (peft refuses the "
                                      "pair: its cached prefix keys and values cannot be recomputed); set "
                                      "gradient_checkpointing to false, or use prompt_tuning or lora")
    if peft in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning) and t.strategy == StrategyName.pipeline:
        bad("peft.method", f"{peft.value} adds virtual tokens in front of the first stage's input; it cannot be "
                           "split into pipeline stages (use lora, ia3, loha or lokr)")
    if t.strategy == StrategyName.pipeline:
        stages, workers = t.pipeline.stages, t.resources.num_workers
        if workers % stages:
            bad("pipeline.stages", f"resources.num_workers ({workers}) must be a multiple of pipeline stages "
                                   f"({stages}): each data-parallel replica runs the whole pipeline")
        if t.precision == Precision.fp16:
            bad("precision", "the pipeline strategy runs in fp32 or bf16 (fp16's loss scaling would span stages)")
        micro = split_batch(spec).micro_batch_size
        chunks = t.pipeline.microbatches or micro
        if micro % chunks:
            bad("pipeline.microbatches", f"pipeline.microbatches ({chunks}) must divide the micro-batch of "
                                         f"{micro} rows (training.hyperparameters.micro_batch_size)")
        elif t.pipeline.schedule == "interleaved_1f1b" and chunks % max(1, chunks // stages):
            bad("pipeline.microbatches", f"the interleaved_1f1b schedule runs its {chunks} chunks per micro-batch in "
                                         f"rounds of {chunks // stages} (torch.distributed.pipelining: ScheduleInterleaved1F1B "
                                         f"needs the count a multiple of them): use a multiple of stages ({stages}) or "
                                         "fewer chunks than stages")
        elif t.pipeline.schedule == "1f1b" and chunks < stages:
            bad("pipeline.microbatches", f"the 1f1b schedule needs at least as many chunks per micro-batch as "
                                         f"stages ({chunks} < {stages}): raise micro_batch_size or "
                                         "pipeline.microbatches, or use schedule 'gpipe'")
    if t.hyperparameters.packing and t.strategy in (StrategyName.pipeline, StrategyName.tensor):
        bad("hyperparameters.packing", f"packing keeps examples apart by position ids, which the {t.strategy.value} "
                                       f"strategy does not pass on (or is not tested to); set packing to false with "
                                       f"strategy '{t.strategy.value}'")
    if t.hyperparameters.packing and peft in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        bad("hyperparameters.packing", f"packing keeps examples apart by position ids, which {peft.value} does not "
                                       "pass to the model; set packing to false, or use lora")
    if t.pipeline.virtual_stages is not None and t.pipeline.schedule != "interleaved_1f1b":
        bad("pipeline.virtual_stages", "virtual_stages needs pipeline.schedule 'interleaved_1f1b'")
    if t.strategy == StrategyName.tensor:
        problems += tensor_rules(t)
    elif t.tensor_parallel.size is not None:
        bad("tensor_parallel.size", "tensor_parallel options need strategy 'tensor'")
    if t.loss_chunk_tokens is not None and t.strategy == StrategyName.pipeline:
        bad("loss_chunk_tokens", "chunked cross-entropy is not built into the pipeline strategy's last stage; "
                                 "leave loss_chunk_tokens unset with strategy 'pipeline'")
    if t.activation_offload and not on_gpu:
        bad("activation_offload", "activation_offload needs GPUs (resources.gpus_per_worker > 0): on a CPU worker "
                                  "the host is the same memory, so offloading would save nothing")
    if t.activation_offload and t.strategy == StrategyName.pipeline:
        bad("activation_offload", "activation_offload is not built into the pipeline strategy's stages; use ddp, "
                                  "fsdp or deepspeed")
    if t.qat.enabled and peft != PeftMethod.none:
        bad("qat.enabled", "QAT trains the full model; it cannot be combined with peft")
    if t.qat.enabled and t.strategy != StrategyName.ddp:
        bad("qat.enabled", "QAT is supported with strategy 'ddp'")
    if t.resources.gpu_type is not None:
        if not on_gpu:
            bad("resources.gpu_type", "gpu_type needs resources.gpus_per_worker > 0")
        if known_gpus is not None and t.resources.gpu_type not in known_gpus:
            bad("resources.gpu_type", f"unknown GPU {t.resources.gpu_type!r}; known: {', '.join(sorted(known_gpus))}")
    if on_gpu and t.resources.gpus_per_worker != int(t.resources.gpus_per_worker) and t.resources.gpus_per_worker > 1:
        bad("resources.gpus_per_worker", "more than one GPU per worker must be a whole number")
    if t.resources.min_workers is not None:
        elastic_problem = _min_workers_problem(t)
        if elastic_problem:
            bad("resources.min_workers", elastic_problem)
    if t.resources.host_memory_budget_bytes is not None and on_gpu:
        bad("resources.host_memory_budget_bytes", "a host memory budget applies to CPU workers only")
    split = split_batch(spec)
    if split.problem is not None:
        problems.append(split.problem)
    return problems


def dpo_rules(spec: JobSpec) -> list[FieldProblem]:
    """method.type 'dpo' with the rest of the spec (workers/dpo.py runs it; service/memory/dpo.py plans it)."""
    t = spec.training
    out: list[FieldProblem] = []

    def bad(param: str, message: str) -> None:
        out.append(FieldProblem(param=param, message=message))

    if spec.hyperparameters is not None:
        bad("hyperparameters", "give DPO's hyperparameters under method.dpo.hyperparameters")
    if t.strategy not in (StrategyName.ddp, StrategyName.fsdp, StrategyName.deepspeed):
        bad("training.strategy", f"DPO runs with strategy ddp, fsdp or deepspeed, not {t.strategy.value}")
    if t.loss_chunk_tokens is not None:
        bad("training.loss_chunk_tokens", "DPO sums each sequence's log-probabilities from the logits; leave "
                                          "loss_chunk_tokens unset")
    if t.hyperparameters.packing:
        bad("training.hyperparameters.packing", "DPO compares two whole sequences per example: packing is off")
    if t.qat.enabled:
        bad("training.qat.enabled", "QAT is not built into DPO")
    if t.activation_offload:
        bad("training.activation_offload", "activation offload is not built into DPO")
    reference = t.dpo_reference
    peft = t.peft.method != PeftMethod.none
    if reference == "adapter_disabled" and not peft:
        bad("training.dpo_reference", "adapter_disabled needs a PEFT method (the base without the adapter is the "
                                      "reference); use frozen_copy or precomputed for a full fine-tune")
    if reference == "adapter_disabled" and t.peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        bad("training.dpo_reference", f"{t.peft.method.value} cannot be disabled per forward; use precomputed")
    if reference == "frozen_copy" and t.strategy == StrategyName.deepspeed:
        bad("training.dpo_reference", "a frozen reference copy is not built into the deepspeed strategy; use "
                                      "precomputed (or a PEFT method and adapter_disabled)")
    return out


def dpo_reference_mode(t: "TrainingOptions") -> str:
    """The reference DPO runs with: training.dpo_reference, 'auto' worked out — the base with the adapter
    disabled for LoRA-like PEFT (no second model), log-probs precomputed once otherwise (no second model
    either: the policy is the reference before its first step)."""
    if t.dpo_reference != "auto":
        return t.dpo_reference
    if t.peft.method not in (PeftMethod.none, PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        return "adapter_disabled"
    return "precomputed"


def _min_workers_problem(t: TrainingOptions) -> str | None:
    """Why ``resources.min_workers`` cannot be used with these options, or None."""
    least, most = t.resources.min_workers, t.resources.num_workers
    if least > most:
        return f"min_workers ({least}) must not exceed resources.num_workers ({most})"
    if t.strategy == StrategyName.pipeline and least % t.pipeline.stages:
        return f"min_workers ({least}) must be a multiple of pipeline.stages ({t.pipeline.stages})"
    if t.strategy == StrategyName.tensor and least < most:
        return ("an elastic range of workers is not built into the tensor strategy (its dp × tp mesh is fixed); "
                "leave min_workers unset (or equal to num_workers) with strategy 'tensor'")
    if t.strategy == StrategyName.deepspeed and least < most:
        return ("a deepspeed checkpoint resumes only on the world size that wrote it; use ddp or fsdp for a range "
                "of worker counts")
    return None


def tensor_rules(t: TrainingOptions) -> list[FieldProblem]:
    """Strategy tensor's cross-field rules (workers/strategies/tensor.py); the model's head and MLP
    counts are checked by the planner, which reads the model's shape."""
    out: list[FieldProblem] = []

    def bad(param: str, message: str) -> None:
        out.append(FieldProblem(param=f"training.{param}", message=message))

    size, workers = tensor_parallel_size(t), t.resources.num_workers
    if size < 2:
        bad("tensor_parallel.size", f"tensor parallelism splits each layer over at least 2 ranks; set "
                                    f"resources.num_workers (now {workers}) or tensor_parallel.size to 2 or more")
    elif workers % size:
        bad("tensor_parallel.size", f"resources.num_workers ({workers}) must be a multiple of tensor_parallel.size "
                                    f"({size}): the rest of the workers are data-parallel replicas")
    if t.precision == Precision.fp16:
        bad("precision", "the tensor strategy runs in fp32 or bf16 (fp16's loss scaling is not built into it)")
    if t.peft.method.value not in TENSOR_PEFT:
        bad("peft.method", f"the tensor strategy splits LoRA adapters with their base layers; {t.peft.method.value} is "
                           "not built into it (use lora, or none for a full fine-tune)")
    if t.loss_chunk_tokens is not None:
        bad("loss_chunk_tokens", "chunked cross-entropy is not built into the tensor strategy; leave "
                                 "loss_chunk_tokens unset with strategy 'tensor'")
    if t.activation_offload:
        bad("activation_offload", "activation_offload is not built into the tensor strategy; use ddp, fsdp or "
                                  "deepspeed")
    return out


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the union branch ('int', "literal['auto']", 'list[str]') in an error's loc; drop
    those, but not field names that merely start the same way ('strategy')."""
    if not isinstance(part, str):
        return False
    return part in ("int", "float", "bool", "str", "none") or part.startswith(
        ("literal[", "list[", "dict[", "function-", "constrained-", "nullable[")
    )


def validate_spec(body: dict[str, Any], known_gpus: set[str] | None = None) -> JobSpec:
    """Parse and check a body. Raises SpecError listing every problem (field and cross-field)."""
    from pydantic import ValidationError

    try:
        spec = JobSpec.model_validate(body)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
            code = "unknown_field" if err["type"] == "extra_forbidden" else "invalid_value"
            message = "unknown field" if code == "unknown_field" else err["msg"]
            problems.append(FieldProblem(param=loc or "body", message=message, code=code))
        # A union ('auto' | int) reports one error per branch at the same location: merge them.
        merged: dict[str, FieldProblem] = {}
        for p in problems:
            if p.param in merged:
                merged[p.param].message += f", or {p.message[0].lower()}{p.message[1:]}"
            else:
                merged[p.param] = p
        raise SpecError(list(merged.values())) from None
    problems = check_rules(spec, known_gpus)
    if problems:
        raise SpecError(problems)
    return spec


class RunRequest(Strict):
    """What the scheduler hands a Ray job: a validated spec plus everything resolved on the server side."""

    job_id: str
    attempt: int = Field(1, ge=1)
    spec: JobSpec
    training_path: str = Field(..., description="Local path of the training JSONL as the workers see it.")
    validation_path: str | None = None
    model_path: str | None = Field(None, description="Resolved local model dir, if the model is not a preset/hub id.")
    output_dir: str = Field(..., description="Job storage: checkpoints and final artifacts land here.")
    resume_from: str | None = Field(
        None, description="Checkpoint folder to start from when Ray Train has none of this attempt's own: the "
                          "latest checkpoint an earlier attempt recorded, staged into this attempt's folder.")
    object_store: ObjectStore | None = Field(
        None, description="MEMFIT_STORAGE_URL's bucket (no credentials): the uploads named by the paths above "
                          "(s3:// URIs), Ray Train's checkpoints and the exports are there (service/domain/storage.py).")
    output_uri: str | None = Field(
        None, description="On object storage: the s3:// URI mirroring output_dir, where the attempt's checkpoints "
                          "(<output_uri>/ray) and exports go; output_dir keeps the run's own files (failure records).")
    ingest_url: str | None = Field(None, description="API ingest endpoint for metrics; None writes JSON lines only.")
    ingest_token: str | None = None
    metrics_path: str | None = Field(None, description="JSON-lines sink path (always written when set).")
    plan: dict[str, Any] | None = Field(None, description="The planner's prediction, echoed into telemetry.")
    world_sizes: list[WorldPlan] | None = Field(
        None, description="resources.min_workers: the re-plan for each smaller world size Ray Train may start "
                          "(service/memory/elastic.py), which the workers apply to the world size they get.")
