"""What workers send to the API's ingest endpoint: one batch of typed records.

The Ray job's metrics sink posts `IngestBatch` JSON to POST /v1/internal/jobs/{job_id}/ingest with
the job's ingest token. Every record carries the attempt it belongs to; the store ignores a record
whose (job, attempt, rank, step, kind[, phase]) it already holds, so a retried post never
duplicates a row, and rejects records for an attempt that is not the job's current one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _not_a_boolean(value: Any) -> Any:
    # JSON's true/false are not numbers: pydantic's lax mode would store `"step": false` as step 0
    # (found by schemathesis, tests/test_schemathesis.py). Numbers stay lax (a worker's 64.0 is 64).
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]


def _kind_required(schema: dict[str, Any]) -> None:
    # `kind` has a default (so a record can be built without naming it), but a batch's records are
    # told apart by it: the API's JSON schema must say a posted record needs it.
    schema["required"] = sorted({*schema.get("required", []), "kind"})


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_kind_required)
    attempt: Int = Field(..., ge=1)
    time: Float = Field(..., description="Unix seconds when the worker produced it.")


class MetricsRecord(_Record):
    kind: Literal["metrics"] = "metrics"
    rank: Int = Field(..., ge=0)
    step: Int = Field(..., ge=0, description="Optimizer steps completed.")
    total_steps: Int | None = None
    epoch: Float | None = None
    loss: Float | None = None
    eval_loss: Float | None = None
    mean_token_accuracy: Float | None = Field(None, description="The step's label tokens predicted right (argmax), "
                                              "across ranks: OpenAI's train_mean_token_accuracy.")
    eval_mean_token_accuracy: Float | None = Field(None, description="OpenAI's valid_mean_token_accuracy.")
    full_eval_loss: Float | None = Field(None, description="After the last step: OpenAI's full_valid_loss.")
    full_eval_mean_token_accuracy: Float | None = Field(None, description="OpenAI's full_valid_mean_token_accuracy.")
    # DPO (workers/dpo.py): the step's mean rewards β·(log π − log π_ref) over its pairs, across ranks
    reward_margin: Float | None = Field(None, description="DPO: mean chosen minus rejected reward.")
    preference_accuracy: Float | None = Field(None, description="DPO: share of pairs whose chosen reward is higher.")
    chosen_reward: Float | None = None
    rejected_reward: Float | None = None
    eval_reward_margin: Float | None = None
    eval_preference_accuracy: Float | None = None
    # reinforcement (workers/rl.py): the step's samples' rewards from the grader, across ranks
    mean_reward: Float | None = Field(None, description="RL: mean reward of the step's samples.")
    reward_std: Float | None = Field(None, description="RL: their standard deviation.")
    grader_rewards: dict[str, Float] | None = Field(None, description="RL: mean reward per grader (a multi grader's "
                                                                     "parts too), by the grader's name.")
    kl: Float | None = Field(None, description="RL: mean per-token KL to the reference (k3), where one is held.")
    mean_completion_tokens: Float | None = Field(None, description="RL: mean sampled completion length in tokens.")
    grader_error_rate: Float | None = Field(None, description="RL: share of samples a grader could not score (0).")
    eval_mean_reward: Float | None = Field(None, description="RL: mean reward on the validation prompts.")
    learning_rate: Float | None = None
    grad_norm: Float | None = None
    tokens_per_s: Float | None = None
    trained_tokens: Int | None = Field(None, description="Tokens this rank has trained on so far.")
    step_time_s: Float | None = None


class MemoryRecord(_Record):
    """One per-rank memory sample. Bytes are live tensor bytes on the training device unless named host_."""

    kind: Literal["memory"] = "memory"
    rank: Int = Field(..., ge=0)
    step: Int = Field(..., ge=0)
    # step, forward, backward, optimizer: a training step's (workers/telemetry.py StepTelemetry); load, eval,
    # checkpoint, export: a whole phase of the job outside the step (PhaseMeter: its host peak in
    # process_rss_bytes, its device peak and window in ``device``)
    phase: Literal["step", "forward", "backward", "optimizer", "load", "eval", "checkpoint", "export",
                   "sample"] = "step"
    source: str = Field("counters", description="counters | memtracker | profiler | cuda")
    parameters_bytes: Int | None = None
    gradients_bytes: Int | None = None
    optimizer_bytes: Int | None = None
    activations_bytes: Int | None = None
    temporary_bytes: Int | None = None
    other_bytes: Int | None = None
    peak_bytes: Int | None = None
    host_parameters_bytes: Int | None = None
    host_gradients_bytes: Int | None = None
    host_optimizer_bytes: Int | None = None
    process_rss_bytes: Int | None = None
    device: dict[str, Any] = Field(default_factory=dict, description="CUDA allocator view when on GPU.")


class CheckpointRecord(_Record):
    kind: Literal["checkpoint"] = "checkpoint"
    step: Int = Field(..., ge=0)
    path: str
    metrics: dict[str, Any] = Field(default_factory=dict)


class EventRecord(_Record):
    kind: Literal["event"] = "event"
    level: Literal["info", "warn", "error"] = "info"
    message: str = Field(..., max_length=4000)
    data: dict[str, Any] | None = None
    dedupe: str | None = Field(None, max_length=200, description="Identical dedupe keys are stored once.")


class ResultRecord(_Record):
    kind: Literal["result"] = "result"
    fine_tuned_model: str
    artifacts: dict[str, str] = Field(default_factory=dict, description="name -> path under the job storage.")
    trained_tokens: Int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)


class FailureRecord(_Record):
    kind: Literal["failure"] = "failure"
    code: str = Field(..., description="out_of_memory | worker_error | data_error | …")
    message: str = Field(..., max_length=8000)
    param: str | None = Field(None, description="The spec field at fault, e.g. model for model_unavailable.")
    rank: Int | None = None
    step: Int | None = None
    phase: str | None = None
    details: dict[str, Any] = Field(default_factory=dict, description="breakdown, dominant category, suggestions…")


Record = Annotated[
    Union[MetricsRecord, MemoryRecord, CheckpointRecord, EventRecord, ResultRecord, FailureRecord],
    Field(discriminator="kind"),
]


class IngestBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A run's sink posts at most 200 records at a time (workers/sink_http.py).
    records: list[Record] = Field(..., max_length=1000)


# A step's metrics under the names a job's events (and W&B, MLflow: workers/integrations.py) give them:
# OpenAI's where it has one (train_loss, valid_loss, train/valid_mean_token_accuracy, full_valid_*), memfit's
# otherwise. The one rule for the names: the ingest path's metrics events and the integrations both use it.
METRIC_NAMES = {
    "loss": "train_loss", "eval_loss": "valid_loss", "mean_token_accuracy": "train_mean_token_accuracy",
    "eval_mean_token_accuracy": "valid_mean_token_accuracy", "full_eval_loss": "full_valid_loss",
    "full_eval_mean_token_accuracy": "full_valid_mean_token_accuracy", "learning_rate": "learning_rate",
    "grad_norm": "grad_norm", "tokens_per_s": "tokens_per_s", "trained_tokens": "trained_tokens",
    "step_time_s": "step_time_s", "epoch": "epoch", "reward_margin": "reward_margin",
    "preference_accuracy": "preference_accuracy", "chosen_reward": "chosen_reward", "rejected_reward": "rejected_reward",
    "eval_reward_margin": "valid_reward_margin", "eval_preference_accuracy": "valid_preference_accuracy",
    "mean_reward": "train_reward_mean", "reward_std": "train_reward_std", "kl": "train_kl",
    "mean_completion_tokens": "train_sample_tokens_mean", "grader_error_rate": "train_grader_error_rate",
    "eval_mean_reward": "valid_reward_mean",
}


def named_metrics(record: MetricsRecord | dict[str, Any]) -> dict[str, float]:
    """The measured values of a metrics record (a MetricsRecord or its dict) under METRIC_NAMES' names."""
    get = record.get if isinstance(record, dict) else lambda k: getattr(record, k, None)
    out = {theirs: get(ours) for ours, theirs in METRIC_NAMES.items() if get(ours) is not None}
    for grader, value in (get("grader_rewards") or {}).items():  # RL: one train_reward_mean/<grader> each
        out[f"{GRADER_REWARD_PREFIX}{grader}"] = value
    return out


GRADER_REWARD_PREFIX = "train_reward_mean/"
