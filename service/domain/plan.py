"""The memory plan as one typed contract, and the one list of memory categories.

The planner (service/memory/planner.py) produces a :class:`Plan`; the pre-flight
(service/memory/preflight.py) completes it (the model, the informative case, the ranked
suggestions); ``jobs.plan`` stores ``plan.model_dump(mode="json")``; ``POST /v1/memory/plan``
declares it as its response model; the dashboard, the planner page and the CLI read a stored or
served plan back with ``Plan.model_validate``. The JSON is the one stored before this model existed,
key for key (tests/test_plan_schema.py compares it with plans captured from the old code), so stored
plans and clients keep working.

Why here and not in service/memory/: the plan is a contract that several packages read — the job
store keeps it, views and the CLI render it, the API serves it, a DoesNotFit error carries it — the
way the job spec is (service/domain/spec.py). It holds no arithmetic, so those readers need not
import the planner to read a plan.

Categories. The planner predicts bytes in :data:`CATEGORIES`; what the workers' telemetry can
measure is compared in :data:`COMPARED` (the GPU overhead is outside the allocator's tensors, the
total is the step's peak); the dashboard charts samples in :data:`CHARTED` (``other`` = temporary +
other known buffers of a sample, temporary + overhead of a plan). :data:`LABELS` names each for
people.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_serializer

from service.domain.spec import MemoryPolicy

MODEL_STATES = ("parameters", "gradients", "optimizer_states")
CATEGORIES = (*MODEL_STATES, "activations", "temporary", "overhead")  # what the planner predicts
COMPARED = (*MODEL_STATES, "activations", "temporary", "total")  # predicted vs measured
CHARTED = (*MODEL_STATES, "activations", "other")  # the dashboard's memory charts
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "temporary": "temporary / other",
    "overhead": "overhead",
    "other": "temporary / other",
    "total": "total (step peak)",
}


class Breakdown(BaseModel):
    """Bytes on one rank by category at the predicted peak instant; ``total`` is their sum.

    The planner fills the categories in place as it goes; ``total`` is always their sum (a stored
    ``total`` is recomputed on reading, and equals it)."""

    model_config = ConfigDict(validate_assignment=True)  # the planner's assignments stay whole bytes

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    temporary: int = 0
    overhead: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)


class PerRank(BaseModel):
    """One rank's bytes: on the device (GPU memory, or a CPU worker's RAM) and in host memory."""

    device: Breakdown = Field(default_factory=Breakdown)
    host: Breakdown = Field(default_factory=Breakdown)


class ModelStates(BaseModel):
    """The model states at their full size, whatever instant the peak is (e.g. all gradients)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0


class ModelStatesPerRank(BaseModel):
    device: ModelStates = Field(default_factory=ModelStates)
    host: ModelStates = Field(default_factory=ModelStates)


class ModelInfo(BaseModel):
    """The model planned: its name in the spec, where its shape came from, and the shape
    (service/memory/shape.py ModelShape.to_dict)."""

    model_config = ConfigDict(extra="allow")  # a shape field added later is kept, not refused

    name: str
    source: str | None = None  # preset | local | hub
    family: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    norm: str
    mlp: str
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    learned_positions: int = 0
    extra: dict[str, Any] = Field(default_factory=dict)
    parameter_count: int


class Suggestion(BaseModel):
    """One change that makes the job fit, ranked cheapest first, with its predicted peak and the
    spec fields it changes (dotted path → new value)."""

    rank: int
    change: str
    description: str
    cost: int = Field(description="Lower is cheaper: the speed or quality given up.")
    fits: bool
    predicted_peak_bytes: int
    usable_bytes: int | None
    device_total_bytes: int
    host_total_bytes: int
    spec_changes: dict[str, Any] = Field(default_factory=dict)


class DataShape(BaseModel):
    """The training data as the plan saw it (service/memory/data.py): the rows' lengths after
    tokenization and truncation (or packing), and the width of the widest micro-batch planned."""

    measured: bool = Field(description="True: the rows were tokenized and the plan is for this data; "
                                       "False: every row is planned padded to max_seq_length (reason says why).")
    reason: str = Field(description="How the rows were measured, or why they were not.")
    training_file: str | None = None
    examples: int | None = None
    rows: int | None = Field(None, description="Training rows after truncation or packing.")
    longest_row_tokens: int | None = None
    mean_row_tokens: float | None = None
    truncated_examples: int | None = Field(None, description="Examples longer than max_seq_length (cut).")
    max_seq_length: int
    planned_seq_length: int = Field(description="The padded width of the widest micro-batch: the plan's sequence length.")
    packing: bool = False
    padded: bool = Field(False, description="The widest micro-batch can hold rows shorter than it (padding: "
                                            "attention runs with a mask).")


class BoundPlan(BaseModel):
    """The same job with every row padded to max_seq_length: the worst case for any data."""

    seq_length: int
    fits: bool
    peak_bytes: int
    need_bytes: int
    margin_bytes: int | None
    peak_phase: str
    per_rank: PerRank
    activations_saved_bytes: int = 0


class HostPlan(BaseModel):
    """Host memory per rank and on the fullest node (service/memory/host.py): what offloading, loading,
    checkpointing and exporting hold in the node's RAM, against the node's memory where it is known."""

    per_rank_bytes: dict[str, int] = Field(default_factory=dict, description=(
        "One rank's host bytes at each instant: load, step, checkpoint, export (export: rank 0)."))
    rank0_export_extra_bytes: int = 0
    runtime_bytes: int = Field(0, description="The worker process itself, counted in every instant.")
    checked: bool = Field(False, description="Whether the node's memory was known and compared.")
    fits: bool | None = Field(None, description="None: not checked.")
    source: str | None = Field(None, description="Where the node's memory came from: ray | settings.")
    node_id: str | None = None
    ranks_on_node: int | None = None
    node_instants_bytes: dict[str, int] = Field(default_factory=dict)
    node_need_bytes: int | None = None
    node_peak_instant: str | None = None
    node_memory_bytes: int | None = None
    node_usable_bytes: int | None = None
    node_margin_bytes: int | None = Field(None, description="usable − need on the fullest node; negative: short.")
    notes: list[str] = Field(default_factory=list)


class DiskPlan(BaseModel):
    """What ZeRO-Infinity's offload to a local disk writes (service/memory/nvme.py): per rank and per node, and the
    node's free space at ``path`` where this host can see it."""

    path: str
    per_rank_bytes: int = Field(description="The offloaded states one rank swaps to the disk.")
    ranks_on_node: int = Field(description="Ranks that share one node's disk (its GPUs or CPUs, at most the job's).")
    node_bytes: int
    free_bytes: int | None = Field(None, description="Free space at path on the API's host (None: not seen here).")
    checked: bool = False
    fits: bool | None = None
    host_buffer_bytes: int = Field(0, description="A rank's host swap buffers (part of the plan's host column).")
    notes: list[str] = Field(default_factory=list)


JOB_PHASES = ("load", "step", "eval", "checkpoint", "export")  # the phases of a job a rank can run out of memory in


class PhasePeak(BaseModel):
    """One rank's predicted peak in one phase of the job (service/memory/phases.py)."""

    device_bytes: int | None = Field(None, description="GPU memory at the phase's peak (allocator overhead "
                                                       "included); None on a CPU worker, whose device is its host.")
    host_bytes: int = Field(description="Host memory of the rank's process at the phase's peak (the process itself "
                                        "included); rank 0's for the export.")
    fits: bool | None = Field(None, description="Whether the phase fits the rank's capacity (None: not known).")
    note: str = ""


class JobPhases(BaseModel):
    """Per rank, the predicted peak of each phase of the job — loading the weights, the training step, an
    evaluation, saving a checkpoint, the export — and which phase is the highest, on the device and on the host."""

    phases: dict[str, PhasePeak] = Field(default_factory=dict)
    device_peak_phase: str | None = None
    host_peak_phase: str | None = None
    fits: bool | None = Field(None, description="Every phase fits (None: some capacity is not known).")
class StepPeak(BaseModel):
    """One rank's micro-batch at one step, as the planner predicts it (service/memory/steps.py): which rows the
    shared order (service/domain/sampling.py) deals it, how wide collate pads them, and the plan of that
    micro-batch."""

    step: int = Field(description="Optimizer step, counted from 1 as the telemetry reports it.")
    rank: int
    micro_batch: int = Field(description="Which micro-batch of the step (accumulation), from 0.")
    rows: list[int] = Field(description="The training rows it holds (indices into the file's rows after truncation "
                                        "or packing).")
    row_tokens: list[int] = Field(description="Each row's tokens.")
    width: int = Field(description="The padded width: its longest row.")
    padded: bool = Field(description="It holds rows shorter than its width (attention runs with a padding mask).")
    predicted_peak_bytes: int = Field(description="The plan of this micro-batch's step: its peak_bytes.")
    predicted_live_bytes: int = Field(description="The same, as the telemetry measures it (the GPU overhead taken "
                                                  "out): the figure a measured step is compared with.")


class RankRunPeak(BaseModel):
    rank: int
    step: int
    predicted_live_bytes: int


class StepsPlan(BaseModel):
    """Every step of the run, per rank, before it runs: the run's peak with its step and rows."""

    planned: bool = Field(description="False: the steps were not enumerated (reason says why) and the plan is the "
                                      "data's worst micro-batch.")
    reason: str
    total_steps: int | None = None
    ranks: int | None = Field(None, description="Ranks predicted (every worker).")
    peak: StepPeak | None = Field(None, description="The run's worst step, the first when several tie.")
    steps_at_peak: int | None = Field(None, description="(step, rank) pairs predicted at the run's peak.")
    per_rank: list[RankRunPeak] = Field(default_factory=list, description="Each rank's worst step.")


class Plan(BaseModel):
    """A job's predicted per-rank memory (the fullest rank's where ranks differ).

    With a training file the plan is for that data (``data.measured``): rows padded to the longest
    row, as the workers' collate pads them; ``at_max_seq_length`` is the same job at the bound. ``fits``,
    ``peak_bytes`` and the breakdown are always the plan's own (the data's when it was measured)."""

    fits: bool
    parameter_count: int
    trainable_parameter_count: int
    world_size: int
    gpu: str | None = Field(description="Catalogue name planned against; None: a CPU worker.")
    capacity_bytes: int | None = Field(description="None: a CPU worker with no host budget (informative plan).")
    usable_bytes: int | None = Field(description="capacity × (1 − safety_margin).")
    safety_margin: float
    peak_bytes: int = Field(description="The device peak per rank; on CPU workers host bytes are added.")
    peak_phase: str
    per_rank: PerRank
    phases: dict[str, int] = Field(description="Live bytes at each candidate instant of a step.")
    runtime_bytes: int = Field(0, description="CPU workers: process memory that is not tensors.")
    model_states: ModelStatesPerRank = Field(default_factory=ModelStatesPerRank)
    activations_saved_bytes: int = Field(0, description="What forward keeps for backward, at its end.")
    assumptions: list[str] = Field(default_factory=list)
    model: ModelInfo | None = None
    margin_bytes: int | None = Field(None, description="usable − need; negative: short by that much. "
                                                       "None for an informative plan.")
    need_bytes: int = Field(description="What must fit in usable_bytes.")
    memory_policy: MemoryPolicy
    suggestions: list[Suggestion] = Field(default_factory=list)
    # Added with plans that know the data; None on plans stored before.
    data: DataShape | None = None
    at_max_seq_length: BoundPlan | None = Field(None, description="The plan with every row padded to max_seq_length.")
    accuracy_margin: float = Field(0.0, description="The planner's measured under-prediction for this strategy "
                                                    "(service/memory/accuracy.py), as a fraction of the peak.")
    accuracy_margin_bytes: int = Field(0, description="peak × accuracy_margin, included in need_bytes.")
    accuracy_source: str | None = Field(None, description="Where accuracy_margin was measured.")
    # Added with host memory per node (service/memory/host.py); None on plans stored before.
    host_memory: HostPlan | None = Field(None, description="Host memory per rank and on the fullest node.")
    # Added with memory by phase (service/memory/phases.py); None on plans stored before.
    job_phases: JobPhases | None = Field(None, description="Per rank, the peak of each phase of the job (load, "
                                                           "step, eval, checkpoint, export) and which is highest.")
    disk: DiskPlan | None = Field(None, description="ZeRO-Infinity's offload to a local disk (nvme), when asked.")
    # Added with step-by-step plans (service/memory/steps.py); None on plans stored before and without data.
    steps: StepsPlan | None = Field(None, description="Each step's peak per rank, the run's peak step and rows.")

    @model_serializer(mode="wrap")
    def _without_unset_additions(self, handler):
        """Fields added after plans were first stored are left out of the JSON while they hold their default,
        so a stored plan reads back and dumps key for key as it was stored (tests/test_plan_schema.py)."""
        out = handler(self)
        for name in ADDED_FIELDS:
            if name in out and out[name] == type(self).model_fields[name].default:
                del out[name]
        return out

    # ``device`` and ``host`` repeat ``per_rank`` at the top level (the JSON has always had both).
    @computed_field  # type: ignore[prop-decorator]
    @property
    def device(self) -> Breakdown:
        return self.per_rank.device

    @computed_field  # type: ignore[prop-decorator]
    @property
    def host(self) -> Breakdown:
        return self.per_rank.host

    def charted(self) -> dict[str, int]:
        """The device bytes in :data:`CHARTED` (``other`` = temporary + overhead) and ``total``."""
        d = self.per_rank.device
        out = {c: getattr(d, c) for c in CHARTED if c != "other"}
        out["other"] = d.temporary + d.overhead
        out["total"] = d.total
        return out


ADDED_FIELDS = ("data", "at_max_seq_length", "accuracy_margin", "accuracy_margin_bytes", "accuracy_source",
                "host_memory", "steps", "job_phases", "disk")


def read_plan(value: Any) -> Plan | None:
    """A stored or served plan (a dict), typed; None for no plan or something that is not one."""
    if isinstance(value, Plan):
        return value
    if not isinstance(value, dict):
        return None
    try:
        return Plan.model_validate(value)
    except ValueError:  # pydantic's ValidationError: not a plan (e.g. an error body)
        return None
