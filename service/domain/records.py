"""What workers send to the API's ingest endpoint: one batch of typed records.

The Ray job's metrics sink posts `IngestBatch` JSON to POST /v1/internal/jobs/{job_id}/ingest with
the job's ingest token. Every record carries the attempt it belongs to; the store ignores a record
whose (job, attempt, rank, step, kind[, phase]) it already holds, so a retried post never
duplicates a row, and rejects records for an attempt that is not the job's current one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


def _kind_required(schema: dict[str, Any]) -> None:
    # `kind` has a default (so a record can be built without naming it), but a batch's records are
    # told apart by it: the API's JSON schema must say a posted record needs it.
    schema["required"] = sorted({*schema.get("required", []), "kind"})


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_kind_required)
    attempt: int = Field(..., ge=1)
    time: float = Field(..., description="Unix seconds when the worker produced it.")


class MetricsRecord(_Record):
    kind: Literal["metrics"] = "metrics"
    rank: int = Field(..., ge=0)
    step: int = Field(..., ge=0, description="Optimizer steps completed.")
    total_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    trained_tokens: int | None = Field(None, description="Tokens this rank has trained on so far.")
    step_time_s: float | None = None


class MemoryRecord(_Record):
    """One per-rank memory sample. Bytes are live tensor bytes on the training device unless named host_."""

    kind: Literal["memory"] = "memory"
    rank: int = Field(..., ge=0)
    step: int = Field(..., ge=0)
    phase: Literal["step", "forward", "backward", "optimizer"] = "step"
    source: str = Field("counters", description="counters | memtracker | profiler | cuda")
    parameters_bytes: int | None = None
    gradients_bytes: int | None = None
    optimizer_bytes: int | None = None
    activations_bytes: int | None = None
    temporary_bytes: int | None = None
    other_bytes: int | None = None
    peak_bytes: int | None = None
    host_parameters_bytes: int | None = None
    host_gradients_bytes: int | None = None
    host_optimizer_bytes: int | None = None
    process_rss_bytes: int | None = None
    device: dict[str, Any] = Field(default_factory=dict, description="CUDA allocator view when on GPU.")


class CheckpointRecord(_Record):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int = Field(..., ge=0)
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
    trained_tokens: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)


class FailureRecord(_Record):
    kind: Literal["failure"] = "failure"
    code: str = Field(..., description="out_of_memory | worker_error | data_error | …")
    message: str = Field(..., max_length=8000)
    param: str | None = Field(None, description="The spec field at fault, e.g. model for model_unavailable.")
    rank: int | None = None
    step: int | None = None
    phase: str | None = None
    details: dict[str, Any] = Field(default_factory=dict, description="breakdown, dominant category, suggestions…")


Record = Annotated[
    Union[MetricsRecord, MemoryRecord, CheckpointRecord, EventRecord, ResultRecord, FailureRecord],
    Field(discriminator="kind"),
]


class IngestBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    records: list[Record] = Field(..., max_length=5000)
