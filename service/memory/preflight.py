"""The plan a job is submitted with, and the memory policy applied to it. The arithmetic is the
planner's (service/memory/planner.py); this module decides *which* model shape and *which* capacity a
job is planned against, and what ``memory_policy`` does with the answer. Predicted against measured is
service/memory/compare.py; an OOM's post-mortem is service/memory/oom.py.

- :func:`resolve_shape` — a spec's ``model``, resolved by service/domain/model_ref.py, → its shape: a
  preset's config dict, a directory under ``MEMFIT_MODEL_DIRS`` → its ``config.json``, a hub id → the
  planner's known shapes. Anything else is :class:`UnknownModelShape`: the job still runs and its memory
  is only measured.
- :func:`plan_for_spec` — the typed plan (service/domain/plan.py; ``POST /v1/memory/plan``, stored
  as ``jobs.plan``). Given the training file, the plan is for that data: the rows are tokenized as
  the workers will (service/memory/data.py) and the widest micro-batch the sampler can form — its
  longest row, padded — is planned; ``at_max_seq_length`` keeps the bound (every row padded to
  ``max_seq_length``) beside it, and ``data`` says how the rows were measured or why they were not.
  ``fits`` (and so ``memory_policy``) uses the data's worst case.
  Capacity: the named GPU (the ``gpu`` override, else ``training.resources.gpu_type``); with no GPU
  named (CPU workers) only ``host_memory_budget_bytes`` is a capacity, and without one the plan is
  informative: it always fits and ``capacity_bytes`` is null.
- :func:`preflight` — ``memory_policy`` applied at job creation (and again by the scheduler's
  validation): ``reject`` raises :class:`DoesNotFit` (422 ``insufficient_memory`` with the breakdown
  and the ranked changes that fit), ``auto`` applies the cheapest change that fits and says so in a job
  event, ``ignore`` runs as given with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.domain.errors import DoesNotFit, UnprocessableEntity
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.plan import BoundPlan, ModelInfo, Plan, Suggestion
from service.domain.spec import (
    JobSpec,
    MemoryPolicy,
    SpecError,
    check_rules,
    validate_spec,
)
from service.domain.units import gib
from service.settings import Settings

MAX_SUGGESTIONS = 6
PLAN_TRAINING_FILE = "file-plan-only"  # what POST /v1/memory/plan puts in a body without training_file


class UnknownModelShape(ValueError):
    """The planner cannot read the model's shape; the worker measures its memory instead."""


# --- the model's shape ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedShape:
    shape: Any  # service.memory.shape.ModelShape
    source: str  # preset | local | hub


def resolve_shape(spec: JobSpec, settings: Settings, model_path: str | None = None) -> ResolvedShape:
    """The shape of ``spec.model``, resolved by service/domain/model_ref.py (``model_path``: a directory
    the scheduler already resolved); raises UnknownModelShape saying why when the planner cannot read it."""
    from service.memory.shape import UnsupportedModel, shape_for_model

    try:
        ref = resolve_model(spec.model, settings.model_dirs, model_path=model_path)
        return ResolvedShape(shape_for_model(ref), ref.kind)
    except (ModelRefError, UnsupportedModel) as exc:
        raise UnknownModelShape(f"unknown model shape for {spec.model!r}: {exc}") from None


# --- the plan ---------------------------------------------------------------------------------


def _gpu_for(spec: JobSpec, gpu: str | None) -> str | None:
    if gpu:
        return gpu
    res = spec.training.resources
    return res.gpu_type if res.gpus_per_worker > 0 else None


def _plan(spec: JobSpec, settings: Settings, gpu: str | None, model_path: str | None = None,
          training_path: str | None = None):
    """(the plan, its suggestions as the planner's Changes). Raises UnknownModelShape, UnknownGPU.

    With ``training_path`` the plan is for that data (service/memory/data.py): its rows' longest
    tokenized length is the planned width, and ``at_max_seq_length`` is the bound beside it."""
    from service.memory import dpo, planner, rl
    from service.memory.data import data_shape
    from service.memory.gpus import get_gpu
    from service.memory.nodes import cluster_nodes

    resolved = resolve_shape(spec, settings, model_path)
    gpu = _gpu_for(spec, gpu)
    if gpu:
        gpu = get_gpu(gpu).name  # UnknownGPU names the catalogue
    margin = settings.memory_safety_margin
    nodes = cluster_nodes(settings)  # the host-memory check per node (service/memory/host.py)
    data = data_shape(spec, training_path, settings.model_dirs, model_path)
    seq = data.planned_seq_length if data.measured else None
    # DPO's plan composes the supervised one (service/memory/dpo.py: twice the rows, and its reference)
    # and RL's (service/memory/rl.py: m × n rows, the sampler's KV cache, the reference)
    plan_for = {"dpo": dpo.plan, "reinforcement": rl.plan}.get(spec.method.type, planner.plan)
    p = plan_for(spec, resolved.shape, gpu, safety_margin=margin, seq_length=seq, padded=data.padded, nodes=nodes)
    # rows filling max_seq_length: the worst case for any data (packed rows of several examples are masked)
    bound = p if seq is None else plan_for(spec, resolved.shape, gpu, safety_margin=margin, nodes=nodes,
                                           padded=spec.training.hyperparameters.packing)
    # step by step: the run's worst step decides where its steps can be enumerated (service/memory/steps.py)
    steps, worst = _steps(spec, resolved.shape, gpu, margin, nodes, data, training_path, settings, model_path)
    if worst is not None:
        p, peak = worst, steps.peak
        data = data.model_copy(update={"planned_seq_length": peak.width, "padded": peak.padded, "reason": (
            f"{data.reason}; the run's worst step is step {peak.step} on rank {peak.rank}: rows of "
            f"{', '.join(str(n) for n in sorted(peak.row_tokens, reverse=True))} tokens, padded to {peak.width}")})
    update: dict[str, Any] = {
        "model": ModelInfo(name=spec.model, source=resolved.source, **resolved.shape.to_dict()), "data": data}
    if steps is not None:
        update["steps"] = steps
    informative = p.gpu is None and spec.training.resources.host_memory_budget_bytes is None
    if informative:
        why = ("no GPU named and no host memory budget: the plan is informative (nothing to fit "
               "into), the job is never refused" if not (p.host_memory and p.host_memory.checked) else
               "no GPU named and no host memory budget: nothing to fit into per rank; the node's memory "
               "is checked (host_memory)")
        update.update(fits=p.host_memory is None or p.host_memory.fits is not False, capacity_bytes=None,
                      usable_bytes=None, margin_bytes=None, assumptions=[*p.assumptions, why])
    update["at_max_seq_length"] = BoundPlan(
        seq_length=spec.training.hyperparameters.max_seq_length, fits=update.get("fits", bound.fits),
        peak_bytes=bound.peak_bytes, need_bytes=bound.need_bytes,
        margin_bytes=None if informative else bound.margin_bytes, peak_phase=bound.peak_phase,
        per_rank=bound.per_rank, activations_saved_bytes=bound.activations_saved_bytes)
    p = p.model_copy(update=update)
    changes = []
    if not p.fits and spec.method.type == "reinforcement":  # the knobs RL users turn
        changes = [c for c in rl.suggestions(spec, resolved.shape, gpu, safety_margin=margin, seq_length=seq, nodes=nodes)
                   if c.plan.fits and not check_rules(c.spec)][:MAX_SUGGESTIONS]
    if not p.fits and spec.method.type == "supervised":  # the planner's changes are a supervised job's
        changes = [s for s in planner.suggest(spec, resolved.shape, gpu, safety_margin=margin, limit=12, seq_length=seq,
                                                  padded=data.padded, nodes=nodes)
                   if s.plan.fits and not check_rules(s.spec)][:MAX_SUGGESTIONS]
    p.suggestions = [_suggestion(i + 1, spec, c) for i, c in enumerate(changes)]
    return p, changes


def _steps(spec: JobSpec, shape, gpu: str | None, margin: float, nodes, data, training_path: str | None,
           settings: Settings, model_path: str | None):
    """(the run's StepsPlan, the plan of its worst micro-batch) for a job whose data was measured; (None, None)
    without data, and (a StepsPlan saying why, None) for a run the planner does not enumerate."""
    from service.memory.data import training_rows
    from service.memory.steps import StepPlanner, predict_run

    if not data.measured or not training_path or spec.method.type != "supervised":
        return None, None
    rows, examples = training_rows(spec, training_path, settings.model_dirs, model_path)
    masked = spec.training.hyperparameters.packing and data.padded  # packed rows of several examples
    return predict_run(StepPlanner(spec, shape, gpu, margin, nodes), rows, examples, masked=masked)


def _suggestion(rank: int, spec: JobSpec, c) -> Suggestion:
    """A planner Change (change, description, cost, plan, spec) as the plan's Suggestion: its
    predicted peak and the spec fields it changes."""
    return Suggestion(
        rank=rank, change=c.change, description=c.description, cost=c.cost, fits=c.plan.fits,
        predicted_peak_bytes=c.plan.peak_bytes, usable_bytes=c.plan.usable_bytes,
        device_total_bytes=c.plan.device.total, host_total_bytes=c.plan.host.total,
        spec_changes=_diff(spec.model_dump(mode="json"), c.spec.model_dump(mode="json")))


def _diff(a: Any, b: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths whose value differs from ``a`` to ``b``, with the new value."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: dict[str, Any] = {}
        for k in sorted(set(a) | set(b)):
            out.update(_diff(a.get(k), b.get(k), f"{prefix}{k}."))
        return out
    return {} if a == b else {prefix.rstrip("."): b}


def plan_for_spec(spec: JobSpec, settings: Settings, gpu: str | None = None, *,
                  model_path: str | None = None, training_path: str | None = None) -> Plan:
    """The plan of ``spec`` (service/domain/plan.py): ``fits``, parameter counts, per-rank ``device``/``host`` bytes by
    category with ``total``, capacity, margin, assumptions, the data it was planned for and the bound at
    max_seq_length, and (when it does not fit) the ranked ``suggestions`` that fit, each with its
    predicted peak and the spec fields it changes."""
    return _plan(spec, settings, gpu, model_path, training_path)[0]


def plan_request(body: Any, settings: Settings, *, gpu: str | None = None,
                 known_gpus: set[str] | None = None, training_path=None) -> Plan:
    """``POST /v1/memory/plan``: a create body (``training_file`` optional) → the plan. Raises
    SpecInvalid naming each bad field, UnprocessableEntity for an unknown GPU or model shape.
    ``training_path``: a callable from the body's training file id to its stored path (the caller
    checks the file is the tenant's), or None when the body has none."""
    from service.domain.errors import BadRequest, SpecInvalid
    from service.memory.gpus import UnknownGPU

    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object", code="invalid_json")
    body = {"training_file": PLAN_TRAINING_FILE, **body}
    try:
        spec = validate_spec(body, known_gpus)
    except SpecError as exc:
        raise SpecInvalid([p.model_dump() for p in exc.problems]) from None
    path = training_path(spec.training_file) if training_path and spec.training_file != PLAN_TRAINING_FILE else None
    try:
        return plan_for_spec(spec, settings, gpu, training_path=path)
    except UnknownGPU as exc:
        raise UnprocessableEntity(str(exc), param="gpu", code="unknown_gpu") from None
    except UnknownModelShape as exc:
        raise UnprocessableEntity(str(exc), param="model", code="unknown_model_shape") from None


# --- pre-flight -------------------------------------------------------------------------------


@dataclass
class PreflightOutcome:
    spec: JobSpec  # the spec to run: the submitted one, or auto's patched one
    plan: dict[str, Any] | None  # what jobs.plan stores, Plan.model_dump(mode="json") (None: model shape unknown)
    events: list[dict[str, Any]] = field(default_factory=list)  # add_event keyword dicts
    applied: dict[str, Any] | None = None  # auto: the suggestion applied


def nvme_problems(spec: JobSpec, plan) -> None:
    """ZeRO-Infinity's offload to a local disk, refused (422) where DeepSpeed's async_io op cannot build, or where
    the disk at nvme_path cannot hold what the node's ranks swap to it (service/memory/nvme.py)."""
    from service.domain.errors import SpecInvalid
    from service.memory import nvme

    if not nvme.wanted(spec):
        return
    problem = nvme.async_io_problem()
    if problem:
        field = "offload_optimizer" if spec.training.deepspeed.offload_optimizer == "nvme" else "offload_param"
        raise SpecInvalid([{"param": f"training.deepspeed.{field}", "message": problem, "code": "nvme_unavailable"}])
    disk = plan.disk
    if disk is not None and disk.fits is False:
        raise SpecInvalid([{"param": "training.deepspeed.nvme_path", "code": "insufficient_disk", "message": (
            f"offload to nvme writes {gib(disk.node_bytes)} per node ({disk.ranks_on_node} rank(s) × "
            f"{gib(disk.per_rank_bytes)}) under {disk.path}, which has {gib(disk.free_bytes)} free")}])


def preflight(spec: JobSpec, settings: Settings, *, model_path: str | None = None,
              training_path: str | None = None) -> PreflightOutcome:
    """Apply ``training.memory_policy`` to the plan of ``spec`` (see the module docstring); with
    ``training_path`` (the stored training file) the plan, and so the decision, is for that data."""
    from service.domain.errors import SpecInvalid
    from service.domain.training import peft_family_problem
    from service.memory.gpus import UnknownGPU

    try:
        plan, options = _plan(spec, settings, None, model_path, training_path)
    except UnknownGPU as exc:
        raise SpecInvalid([{"param": "training.resources.gpu_type", "message": str(exc),
                            "code": "invalid_value"}]) from None
    except UnknownModelShape as exc:
        _size_unknown(spec, settings, exc)  # a hub model of unknown size is refused under a size cap
        return PreflightOutcome(spec, None, [{
            "message": f"memory pre-flight: {exc}; memory will be measured in the worker, not predicted",
            "level": "warn", "data": {"memory_preflight": "unknown_model_shape"}}])
    _size_cap(plan, settings)
    problem = peft_family_problem(plan.model.family, spec.training.peft.method.value) if plan.model else None
    if problem:
        raise SpecInvalid([{"param": "training.peft.method", "message": problem, "code": "unsupported_peft_method"}])
    nvme_problems(spec, plan)
    stored = plan.model_dump(mode="json")  # what jobs.plan keeps
    if plan.fits:
        return PreflightOutcome(spec, stored)
    policy = spec.training.memory_policy
    if policy == MemoryPolicy.reject:
        raise DoesNotFit(plan)
    if policy == MemoryPolicy.ignore:
        return PreflightOutcome(spec, stored, [{
            "message": f"memory pre-flight: predicted peak {gib(plan.peak_bytes)} per rank exceeds the usable "
                       f"{gib(plan.usable_bytes)} of {plan.gpu or 'the host memory budget'}; running anyway "
                       "(memory_policy=ignore)",
            "level": "warn",
            "data": {"memory_preflight": "ignored", "peak_bytes": plan.peak_bytes,
                     "usable_bytes": plan.usable_bytes, "suggestions": stored["suggestions"]}}])
    if not options:  # auto, and nothing fits
        raise DoesNotFit(plan, reason=" (memory_policy=auto had nothing to apply)")
    chosen, applied = options[0], plan.suggestions[0]
    new_plan, _ = _plan(chosen.spec, settings, None, model_path, training_path)
    changes = ", ".join(f"{k}={v}" for k, v in applied.spec_changes.items())
    return PreflightOutcome(chosen.spec, new_plan.model_dump(mode="json"), [{
        "message": f"memory pre-flight: applied {applied.change} ({applied.description}; {changes}): "
                   f"predicted peak {gib(plan.peak_bytes)} → {gib(new_plan.peak_bytes)} per rank, "
                   f"{gib(new_plan.usable_bytes)} usable",
        "data": {"memory_preflight": "auto", "applied": stored["suggestions"][0], "before_peak_bytes": plan.peak_bytes,
                 "after_peak_bytes": new_plan.peak_bytes}}], stored["suggestions"][0])



# --- the model-size cap (MEMFIT_MAX_MODEL_BYTES) --------------------------------------------------

BYTES_PER_STORED_PARAMETER = 2  # the 16-bit weights a checkpoint on the Hub (or a local folder) holds


def _size_cap(plan, settings: Settings) -> None:
    """Admission refuses a model whose weights would pass MEMFIT_MAX_MODEL_BYTES on the shared volume
    (a download, a cached copy, a merged export): 422 ``model_too_large`` naming ``model``."""
    from service.domain.errors import SpecInvalid

    cap = settings.max_model_bytes
    size = plan.parameter_count * BYTES_PER_STORED_PARAMETER
    if cap and size > cap:
        raise SpecInvalid([{"param": "model", "code": "model_too_large",
                            "message": f"the model has {plan.parameter_count:,} parameters, about {gib(size)} of weights; "
                                       f"the limit is {gib(cap)} (MEMFIT_MAX_MODEL_BYTES)"}])


def _size_unknown(spec: JobSpec, settings: Settings, exc: Exception) -> None:
    """A hub model whose shape (so size) cannot be read is not admitted while a size cap is set and
    the jobs may download (HF_HUB_OFFLINE=0, as the scheduler passes it to them; unset is offline): it
    would be downloaded onto the shared volume whatever its size. Offline, such a model fails in the
    worker as ``model_unavailable`` without a download; presets and local folders (placed by the
    operator under MEMFIT_MODEL_DIRS) keep the warning."""
    import os

    from service.domain.errors import SpecInvalid

    downloads = os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() in ("0", "false", "no", "off")
    if not settings.max_model_bytes or not downloads:
        return
    try:
        kind = resolve_model(spec.model, settings.model_dirs).kind
    except ModelRefError:
        return
    if kind == "hub":
        raise SpecInvalid([{"param": "model", "code": "model_size_unknown",
                            "message": f"the size of {spec.model!r} cannot be read ({exc}); with MEMFIT_MAX_MODEL_BYTES set, "
                                       "a hub model is admitted only once its config says how large it is"}])
