"""The job spec: one pydantic model that the API validates, the store keeps and the workers run.

The body is OpenAI's fine-tuning create body (``model``, ``training_file``, ``method`` …) plus one
extension object, ``training``, that carries every memfit knob. Every field has a default, a
description and bounds; rules that involve several fields are collected by :func:`check_rules`
and raised together as :class:`SpecError`, each naming its field with a dotted path.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """Base for every spec object: unknown fields are rejected, not ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)


Auto = Literal["auto"]


# --- OpenAI's create body ---------------------------------------------------------------------


class OpenAIHyperparameters(Strict):
    n_epochs: Union[Auto, int] = Field("auto", description="Passes over the training file.")
    batch_size: Union[Auto, int] = Field(
        "auto",
        description="Global batch in examples per optimizer step: micro_batch_size × "
        "gradient_accumulation_steps × num_workers. 'auto' derives it from `training`.",
    )
    learning_rate_multiplier: Union[Auto, float] = Field(
        "auto", description="Multiplies training.hyperparameters.learning_rate."
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


class Method(Strict):
    type: Literal["supervised"] = Field(
        "supervised", description="Only supervised fine-tuning is offered; dpo and reinforcement are not."
    )
    supervised: Supervised = Field(default_factory=Supervised)


# --- memfit's extension: `training` -----------------------------------------------------------


class StrategyName(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"
    deepspeed = "deepspeed"
    pipeline = "pipeline"


class PeftMethod(str, Enum):
    none = "none"
    lora = "lora"
    qlora = "qlora"
    ia3 = "ia3"
    loha = "loha"
    lokr = "lokr"
    prefix_tuning = "prefix_tuning"
    prompt_tuning = "prompt_tuning"


MERGEABLE_PEFT = {PeftMethod.lora, PeftMethod.qlora, PeftMethod.ia3, PeftMethod.loha, PeftMethod.lokr}


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
    packing: bool = Field(False, description="Pack several examples into each max_seq_length row.")


class FSDPOptions(Strict):
    reshard_after_forward: bool = Field(
        True,
        description="True: full sharding (params re-gathered for backward, like ZeRO-3). "
        "False: keep params gathered through backward (like ZeRO-2).",
    )
    cpu_offload: bool = Field(False, description="Keep sharded params, grads and optimizer states in host memory.")


class DeepSpeedOptions(Strict):
    zero_stage: int = Field(2, ge=0, le=3, description="ZeRO stage: 0 none, 1 optimizer, 2 +grads, 3 +params.")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="Optimizer states to host memory.")
    offload_param: Literal["none", "cpu"] = Field("none", description="Parameters to host memory (stage 3 only).")
    reduce_bucket_elements: int | None = Field(
        None,
        ge=1,
        description="Reduce bucket size in elements; None uses hidden², not DeepSpeed's 5e8 default.",
    )


class PipelineOptions(Strict):
    stages: int = Field(2, ge=2, le=128, description="Pipeline stages; one per worker.")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="Pipeline schedule.")
    microbatches: int = Field(4, ge=1, le=1024, description="Micro-batches in flight per step.")


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


class TrainingOptions(Strict):
    hyperparameters: TrainingHyperparameters = Field(default_factory=TrainingHyperparameters)
    strategy: StrategyName = Field(StrategyName.ddp, description="How model state is split across workers.")
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    pipeline: PipelineOptions = Field(default_factory=PipelineOptions)
    peft: PeftOptions = Field(default_factory=PeftOptions)
    precision: Precision = Field(Precision.fp32, description="fp32, bf16 autocast, or fp16 with a grad scaler (GPU only).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward instead of keeping them.")
    attention: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel; eager keeps the s² score matrix.")
    qat: QATOptions = Field(default_factory=QATOptions)
    resources: Resources = Field(default_factory=Resources)
    memory_policy: MemoryPolicy = Field(
        MemoryPolicy.reject, description="A job predicted not to fit: reject it, auto-fix it, or ignore."
    )
    checkpoint_every_steps: int = Field(50, ge=1, le=1_000_000, description="Ray Train checkpoint cadence.")
    max_failures: int = Field(1, ge=0, le=100, description="Worker-group restarts from the latest checkpoint.")
    telemetry_every_steps: int = Field(1, ge=1, le=100_000, description="Metrics and memory sample cadence.")
    memory_trace_every_steps: int = Field(
        10, ge=1, le=100_000, description="Cadence of the exact (≈2× step cost) per-category memory trace."
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
    suffix: str | None = Field(None, max_length=64, description="Added to the fine-tuned model's name.")
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description="Random seed; None picks one.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs.")
    integrations: list[dict[str, Any]] | None = Field(None, description="Accepted for compatibility; unused.")
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
        if v is not None and not all(c.isalnum() or c in "-_" for c in v):
            raise ValueError("suffix may hold only letters, digits, '-' and '_'")
        return v

    # --- derived values: what the workers and the planner actually use --------------------

    @property
    def openai_hyperparameters(self) -> OpenAIHyperparameters:
        return self.hyperparameters or self.method.supervised.hyperparameters

    def resolved(self) -> "Resolved":
        """The numbers a run uses, with every 'auto' replaced."""
        oh = self.openai_hyperparameters
        t = self.training
        hp = t.hyperparameters
        data_parallel = t.resources.num_workers if t.strategy != StrategyName.pipeline else 1
        accumulation = hp.gradient_accumulation_steps
        if oh.batch_size != "auto":
            accumulation = max(1, oh.batch_size // (hp.micro_batch_size * data_parallel))
        multiplier = 1.0 if oh.learning_rate_multiplier == "auto" else float(oh.learning_rate_multiplier)
        return Resolved(
            n_epochs=1 if oh.n_epochs == "auto" else int(oh.n_epochs),
            micro_batch_size=hp.micro_batch_size,
            gradient_accumulation_steps=accumulation,
            data_parallel_size=data_parallel,
            global_batch_size=hp.micro_batch_size * accumulation * data_parallel,
            learning_rate=hp.learning_rate * multiplier,
            learning_rate_multiplier=multiplier,
            seed=self.seed if self.seed is not None else 42,
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


# --- cross-field rules ------------------------------------------------------------------------


class FieldProblem(BaseModel):
    param: str
    message: str
    code: str = "invalid_value"


class SpecError(ValueError):
    """Several problems with one spec, each naming its field; raised once with all of them."""

    def __init__(self, problems: list[FieldProblem]):
        self.problems = problems
        super().__init__("; ".join(f"{p.param}: {p.message}" for p in problems))


def check_rules(spec: JobSpec, known_gpus: set[str] | None = None) -> list[FieldProblem]:
    """Every rule that involves more than one field. Returns all problems, empty when the spec is fine."""
    t = spec.training
    problems: list[FieldProblem] = []

    def bad(param: str, message: str, code: str = "invalid_value") -> None:
        problems.append(FieldProblem(param=f"training.{param}", message=message, code=code))

    on_gpu = t.resources.gpus_per_worker > 0
    ds = t.deepspeed
    peft = t.peft.method
    oh = spec.openai_hyperparameters

    if spec.hyperparameters is not None and spec.method.supervised.hyperparameters != OpenAIHyperparameters():
        problems.append(
            FieldProblem(
                param="hyperparameters",
                message="give hyperparameters either at the top level or under method.supervised, not both",
            )
        )
    if ds.offload_param == "cpu" and not (t.strategy == StrategyName.deepspeed and ds.zero_stage == 3):
        bad("deepspeed.offload_param", "offload_param needs strategy 'deepspeed' with zero_stage 3")
    if ds.offload_optimizer == "cpu" and t.strategy == StrategyName.deepspeed and ds.zero_stage == 0:
        bad("deepspeed.offload_optimizer", "offload_optimizer needs zero_stage 1, 2 or 3")
    if t.strategy != StrategyName.deepspeed and ds.offload_optimizer != "none":
        bad("deepspeed.offload_optimizer", "deepspeed options need strategy 'deepspeed'")
    if t.strategy != StrategyName.fsdp and t.fsdp.cpu_offload:
        bad("fsdp.cpu_offload", "cpu_offload needs strategy 'fsdp'")
    if t.precision == Precision.fp16 and not on_gpu:
        bad("precision", "fp16 needs GPUs (resources.gpus_per_worker > 0); use bf16 on CPU workers")
    if peft == PeftMethod.qlora and not on_gpu:
        bad("peft.method", "qlora needs GPUs (resources.gpus_per_worker > 0); use lora on CPU workers")
    if peft == PeftMethod.qlora and t.strategy in (StrategyName.deepspeed, StrategyName.pipeline):
        bad("peft.method", "qlora runs with strategy 'ddp' or 'fsdp'")
    if peft in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning) and t.peft.merge and "merge" in t.peft.model_fields_set:
        bad("peft.merge", f"{peft.value} adapters cannot be merged into the model; set merge to false")
    if peft in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning) and t.strategy == StrategyName.pipeline:
        bad("peft.method", f"{peft.value} cannot be split into pipeline stages")
    if t.strategy == StrategyName.pipeline:
        if t.pipeline.stages != t.resources.num_workers:
            bad("pipeline.stages", f"pipeline stages ({t.pipeline.stages}) must equal resources.num_workers ({t.resources.num_workers})")
        if t.peft.method != PeftMethod.none:
            bad("peft.method", "the pipeline strategy trains the full model; peft is not supported with it")
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
    if t.resources.host_memory_budget_bytes is not None and on_gpu:
        bad("resources.host_memory_budget_bytes", "a host memory budget applies to CPU workers only")
    if oh.batch_size != "auto":
        dp = t.resources.num_workers if t.strategy != StrategyName.pipeline else 1
        per_step = t.hyperparameters.micro_batch_size * dp
        if oh.batch_size % per_step:
            problems.append(
                FieldProblem(
                    param="method.supervised.hyperparameters.batch_size",
                    message=f"batch_size {oh.batch_size} is not a multiple of micro_batch_size × data-parallel workers = {per_step}",
                )
            )
        elif "gradient_accumulation_steps" in t.hyperparameters.model_fields_set:
            implied = oh.batch_size // per_step
            if implied != t.hyperparameters.gradient_accumulation_steps:
                problems.append(
                    FieldProblem(
                        param="method.supervised.hyperparameters.batch_size",
                        message=f"batch_size {oh.batch_size} implies gradient_accumulation_steps {implied}, "
                        f"but training.hyperparameters.gradient_accumulation_steps is {t.hyperparameters.gradient_accumulation_steps}",
                    )
                )
    return problems


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
    ingest_url: str | None = Field(None, description="API ingest endpoint for metrics; None writes JSON lines only.")
    ingest_token: str | None = None
    metrics_path: str | None = Field(None, description="JSON-lines sink path (always written when set).")
    plan: dict[str, Any] | None = Field(None, description="The planner's prediction, echoed into telemetry.")
