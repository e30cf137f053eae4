"""Response models (`*Public`): the shapes of OpenAI's fine-tuning API plus memfit's extensions.

Route handlers turn store rows into these with the ``*_public`` functions below; nothing else in
``api/`` knows the row layout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field
from sqlalchemy import Row

from service.domain.model_names import checkpoint_model_name
from service.domain.spec import JobSpec, dpo_beta
from service.jobs.crud import JOB_ROW, event_public_id, spec_version
from service.store.models import Checkpoint, File, Job, JobEvent

T = TypeVar("T")


def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


class ListPublic(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


def page_public(items: list[Any], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "has_more": has_more,
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
    }


def _absent_when_none(value: Any) -> bool:
    return value is None


# OpenAI's schema (tests/data/openai_openapi_subset.json) types some optional members without null: a
# string, an object, a number, an array. Such a member is left out when it has no value, never sent as
# null (a client generated from the schema refuses null there): ``Field(exclude_if=_absent_when_none)``.
Absent = dict(default=None, exclude_if=_absent_when_none)


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = Field(**Absent, description="Left out unless the file has some (OpenAI: a string).")
    format: str | None = Field(**Absent, description="memfit: chat | prompt_completion | text | preference")
    rows: int | None = Field(**Absent, description="memfit: examples in the file")


def file_public(f: File) -> FilePublic:
    return FilePublic(
        id=f.id, bytes=f.bytes, created_at=ts(f.created_at), filename=f.filename, purpose=f.purpose,
        status=f.status, format=f.format, rows=f.rows,
    )


class FileDeletedPublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class HyperparametersPublic(BaseModel):
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


class JobErrorPublic(BaseModel):
    code: str
    message: str
    param: str | None = None
    rank: int | None = None
    step: int | None = None
    phase: str | None = None
    details: dict[str, Any] | None = None


class JobPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    estimated_finish: int | None
    model: str
    fine_tuned_model: str | None
    organization_id: str
    training_file: str
    validation_file: str | None
    result_files: list[str]
    seed: int | None
    suffix: str | None
    trained_tokens: int | None
    hyperparameters: HyperparametersPublic
    method: dict[str, Any]
    metadata: dict[str, str] | None
    integrations: list[dict[str, Any]] | None
    status: str = Field(..., description="OpenAI's statuses plus 'paused'")
    error: JobErrorPublic | None
    training: dict[str, Any] = Field(..., description="memfit: the resolved `training` extension of the spec")
    attempt: int = Field(..., description="memfit: run attempt, incremented on each scheduler claim")
    desired_state: str | None = Field(None, description="memfit: a pending 'pause' or 'cancel' request")
    memory: dict[str, Any] | None = Field(None, description="memfit: predicted and measured memory summary")


@dataclass(frozen=True)
class SpecView:
    """What a job's public view takes from its spec, resolved ('auto' worked out), and the same
    serialized once (``json``: hyperparameters, method, integrations, training)."""

    hyperparameters: HyperparametersPublic
    integrations: list[dict[str, Any]] | None
    training: dict[str, Any]
    json: dict[str, orjson.Fragment]
    method: dict[str, Any] = None  # OpenAI's method object (method_public)

    @classmethod
    def of(cls, spec: JobSpec) -> SpecView:
        r = spec.resolved()
        hp = HyperparametersPublic(
            n_epochs=r.n_epochs, batch_size=r.global_batch_size, learning_rate_multiplier=r.learning_rate_multiplier
        )
        integrations = integrations_public(spec)
        training = spec.training.model_dump(mode="json")
        method = method_public(hp, spec)
        parts = {"hyperparameters": hp.model_dump(), "method": method, "integrations": integrations,
                 "training": training}
        return cls(hp, integrations, training, {k: orjson.Fragment(orjson.dumps(v)) for k, v in parts.items()}, method)


class SpecViews:
    """job id → SpecView for the most recently seen ``max_entries`` jobs. A job's spec changes at most
    with its spec_version (service/jobs/crud.py), so its view is worked out once per version per process, and reads
    need not fetch the spec again (service.jobs.crud.read_job's ``with_spec``). Thread-safe."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._views: OrderedDict[str, tuple[tuple[int, bool] | None, SpecView]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        """A job id known at any version, or (job id, spec_version) known at that version."""
        if isinstance(key, tuple):
            job_id, version = key
            known = self._views.get(job_id)
            return known is not None and known[0] == version
        return key in self._views

    def get(self, job_id: str, spec: str | dict | None = None, version: tuple[int, bool] | None = None) -> SpecView | None:
        """The job's view; worked out from ``spec`` (its JSON text or dict) when not known yet, or
        known for another ``version`` (None: any); None when not known and no spec is given."""
        with self._lock:
            known = self._views.get(job_id)
            if known is not None and (version is None or known[0] == version):
                self._views.move_to_end(job_id)
                return known[1]
        if spec is None:
            return None
        view = SpecView.of(JobSpec.model_validate_json(spec) if isinstance(spec, str) else JobSpec.model_validate(spec))
        with self._lock:
            self._views[job_id] = (version, view)
            while len(self._views) > self.max_entries:
                self._views.popitem(last=False)
        return view


SPEC_VIEWS = SpecViews()


def method_public(hp: HyperparametersPublic, spec: JobSpec | None = None) -> dict[str, Any]:
    """OpenAI's `method`, with the numbers used where the body said 'auto' (as OpenAI answers it): the
    method's own object under its type's key, and no other (OpenAI's schema types ``supervised``,
    ``dpo`` and ``reinforcement`` as objects, never null, so the ones a job does not use are left out)."""
    if spec is not None and spec.method.type == "dpo":
        beta = dpo_beta(spec.openai_hyperparameters.beta)
        return {"type": "dpo", "dpo": {"hyperparameters": {**hp.model_dump(), "beta": beta}}}
    if spec is not None and spec.method.type == "reinforcement" and spec.method.reinforcement is not None:
        rl = spec.method.reinforcement
        extra = rl.hyperparameters.model_dump(mode="json", include={"eval_interval", "eval_samples",
                                                                    "compute_multiplier", "reasoning_effort"})
        return {"type": "reinforcement", "reinforcement": {
            "grader": rl.grader.model_dump(mode="json", exclude_none=True),
            "hyperparameters": {**hp.model_dump(), **extra}}}
    return {"type": "supervised", "supervised": {"hyperparameters": hp.model_dump()}}


def integrations_public(spec: JobSpec) -> list[dict[str, Any]] | None:
    """The job's integrations as given, members without a value left out (OpenAI: ``wandb.tags`` is an
    array, never null)."""
    if spec.integrations is None:
        return None
    return [i.model_dump(mode="json", exclude_none=True) for i in spec.integrations]


def job_public(job: Job) -> JobPublic:
    view = SPEC_VIEWS.get(job.id, job.spec, spec_version(job.attempt, job.status))
    memory = job.memory_summary
    if memory is None and job.plan is not None:
        memory = {"plan": job.plan}
    return JobPublic(
        id=job.id,
        created_at=ts(job.created_at),
        finished_at=ts(job.finished_at),
        estimated_finish=ts(job.estimated_finish),
        model=job.model,
        fine_tuned_model=job.fine_tuned_model,
        organization_id=job.tenant_id,
        training_file=job.training_file,
        validation_file=job.validation_file,
        result_files=list(job.result_files or []),
        seed=job.seed,
        suffix=job.suffix,
        trained_tokens=job.trained_tokens,
        hyperparameters=view.hyperparameters,
        method=view.method,
        metadata=job.metadata_,
        integrations=view.integrations,
        status=job.status,
        error=JobErrorPublic.model_validate(job.error) if job.error else None,
        training=view.training,
        attempt=job.attempt,
        desired_state=job.desired_state,
        memory=memory,
    )


# --- GET job and the job list: a row of service.jobs.crud.JOB_ROW straight to JSON bytes ----------
# One orjson pass builds the answer: the spec's parts are the view's fragments, the JSON columns the
# database's own text. It is JobPublic's shape, key for key (tests/test_job_json.py holds it to
# job_public on jobs of every status), so the OpenAPI document keeps JobPublic as the response model.


def _json_text(text: str | None) -> orjson.Fragment | None:
    """A JSON column's text as it goes into the answer; SQL NULL and JSON null are both null."""
    return None if text is None or text == "null" else orjson.Fragment(text)


def _error(text: str | None) -> dict[str, Any] | None:
    error = orjson.loads(text) if text else None  # only failed jobs have one: parsed to get JobErrorPublic's keys
    return JobErrorPublic.model_validate(error).model_dump(mode="json") if error else None


def job_document(row: Row, view: SpecView) -> dict[str, Any]:
    """The JobPublic document of a JOB_ROW row, for orjson to serialize."""
    # Unpacked in JOB_ROW's order: a Row's attribute (or mapping) access costs several times as much,
    # and this runs for every job listed.
    (job_id, tenant_id, status, model, training_file, validation_file, suffix, seed, attempt, desired_state,
     created_at, finished_at, estimated_finish, fine_tuned_model, trained_tokens, metadata_json, result_files_json,
     error_json, memory_summary_json, plan_json, *_spec_json) = row
    memory = _json_text(memory_summary_json)
    if memory is None and _json_text(plan_json) is not None:
        memory = orjson.Fragment('{"plan":' + plan_json + "}")
    spec = view.json
    return {
        "id": job_id,
        "object": "fine_tuning.job",
        "created_at": ts(created_at),
        "finished_at": ts(finished_at),
        "estimated_finish": ts(estimated_finish),
        "model": model,
        "fine_tuned_model": fine_tuned_model,
        "organization_id": tenant_id,
        "training_file": training_file,
        "validation_file": validation_file,
        "result_files": _json_text(result_files_json) or _EMPTY_LIST,
        "seed": seed,
        "suffix": suffix,
        "trained_tokens": trained_tokens,
        "hyperparameters": spec["hyperparameters"],
        "method": spec["method"],
        "metadata": _json_text(metadata_json),
        "integrations": spec["integrations"],
        "status": status,
        "error": _error(error_json),
        "training": spec["training"],
        "attempt": attempt,
        "desired_state": desired_state,
        "memory": memory,
    }


_EMPTY_LIST = orjson.Fragment(b"[]")


class RenderedJobs:
    """job id → its last answer: the JOB_ROW fields it was rendered from, the view, and the bytes.
    A read whose row and view are the ones last rendered for that job answers the same bytes without
    building the document again (most of a list page's cost: a page lists mostly jobs whose row has
    not changed since the last poll). Every field the document is made of is compared, so a changed
    row always renders anew. For the ``max_entries`` most recently rendered jobs; used on the event
    loop only (the GET and list routes)."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._docs: OrderedDict[str, tuple[tuple, SpecView, bytes]] = OrderedDict()

    def render(self, row: Row, view: SpecView) -> bytes:
        fields = tuple(row[:JOB_FIELDS])  # not spec_json: the view stands for the spec
        hit = self._docs.get(fields[0])
        if hit is not None and hit[1] is view and hit[0] == fields:
            return hit[2]
        data = orjson.dumps(job_document(row, view))
        self._docs[fields[0]] = (fields, view, data)
        self._docs.move_to_end(fields[0])
        while len(self._docs) > self.max_entries:
            self._docs.popitem(last=False)
        return data


JOB_FIELDS = len(JOB_ROW)  # the columns job_document unpacks; spec_json may follow
RENDERED_JOBS = RenderedJobs()


class RenderedPages:
    """(tenant, after, limit) → the row versions an unfiltered list page was last rendered from and
    its bytes. A poll whose page holds the same rows at the same versions (a Postgres row version —
    xmin and ctid — changes with every UPDATE, and the spec, the status and everything else a job's
    document is made of are columns of that row) is answered those bytes without looking at a row
    (service.jobs.crud read_page_versions: one small statement). Rendered rows are never older than
    the versions they are kept under (read_jobs reads each row at that version or later), so a row
    updated while its page was read is only rendered anew on the next poll. Bounded by ``max_bytes``,
    least recently answered first out; used on the event loop only (the list route)."""

    def __init__(self, max_bytes: int = 32 << 20):
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._pages: OrderedDict[tuple, tuple[tuple, bytes]] = OrderedDict()

    def get(self, key: tuple, versions: tuple) -> bytes | None:
        hit = self._pages.get(key)
        if hit is None or hit[0] != versions:
            return None
        self._pages.move_to_end(key)
        return hit[1]

    def put(self, key: tuple, versions: tuple, data: bytes) -> None:
        old = self._pages.pop(key, None)
        if old is not None:
            self.held_bytes -= len(old[1])
        self._pages[key] = (versions, data)
        self.held_bytes += len(data)
        while self.held_bytes > self.max_bytes and self._pages:
            self.held_bytes -= len(self._pages.popitem(last=False)[1][1])


RENDERED_PAGES = RenderedPages()


def job_json(row: Row, view: SpecView) -> bytes:
    return RENDERED_JOBS.render(row, view)


def jobs_page_json(rows: list[Row], views: list[SpecView], has_more: bool) -> bytes:
    """ListPublic[JobPublic] of a page of JOB_ROW rows (``views`` in the same order)."""
    return orjson.dumps({
        "object": "list",
        "data": [orjson.Fragment(RENDERED_JOBS.render(row, view)) for row, view in zip(rows, views)],
        "has_more": has_more,
        "first_id": rows[0].id if rows else None,
        "last_id": rows[-1].id if rows else None,
    })


def job_public_dict(job: Job) -> dict[str, Any]:
    return job_public(job).model_dump(mode="json")


class EventPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = Field(**Absent, description="Left out when the event has none (OpenAI: an object).")
    attempt: int | None = Field(**Absent, description="memfit: the run attempt the event belongs to")


def event_public(e: JobEvent) -> EventPublic:
    return EventPublic(
        id=event_public_id(e.id), created_at=ts(e.created_at), level=e.level, message=e.message, type=e.type,
        data=e.data, attempt=e.attempt,
    )


class CheckpointPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(
        ..., description="The checkpoint's model name: ft:{model}:{suffix}:{job id}:ckpt-step-{N} (service/domain/model_names.py)")
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, Any]
    attempt: int = Field(..., description="memfit: the run attempt that wrote it")
    path: str = Field(..., description="memfit: where the checkpoint folder is stored (what resume and the artefacts read)")


# The metrics OpenAI's checkpoint object declares (FineTuningJobCheckpoint.Metrics), each a number: the
# ones a checkpoint has no value for are left out, not null (OpenAI's schema types them as numbers). The
# workers report `loss` and `eval_loss`; OpenAI calls them train_loss and valid_loss.
CHECKPOINT_METRICS = ("step", "train_loss", "train_mean_token_accuracy", "valid_loss", "valid_mean_token_accuracy",
                      "full_valid_loss", "full_valid_mean_token_accuracy")
_OPENAI_NAMES = {"loss": "train_loss", "eval_loss": "valid_loss", "mean_token_accuracy": "train_mean_token_accuracy",
                 "eval_mean_token_accuracy": "valid_mean_token_accuracy", "full_eval_loss": "full_valid_loss",
                 "full_eval_mean_token_accuracy": "full_valid_mean_token_accuracy"}


def checkpoint_metrics(step: int, measured: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in (measured or {}).items() if v is not None}
    for ours, theirs in _OPENAI_NAMES.items():
        if theirs not in out and out.get(ours) is not None:
            out[theirs] = out[ours]
    out["step"] = step
    return out


def checkpoint_public(c: Checkpoint, job: Job) -> CheckpointPublic:
    return CheckpointPublic(
        id=c.id, created_at=ts(c.created_at), fine_tuning_job_id=c.job_id,
        fine_tuned_model_checkpoint=checkpoint_model_name(job.model, job.suffix, job.id, c.step),
        step_number=c.step, metrics=checkpoint_metrics(c.step, c.metrics), attempt=c.attempt, path=c.path,
    )
