"""The planner page's form: knobs → a job spec → the memory planner's answer, ready to render.

The page (api/routes/pages.py, ``/ui/planner``) and ``memfit plan`` without a server both call
:func:`plan_body`. The arithmetic is the planner's (service/memory/planner.py, issue "Memory"); this module
only turns form fields into the spec the planner takes and its answer into rows.
"""

from __future__ import annotations

from typing import Any

from service.domain.plan import CHARTED, LABELS, Plan
from service.domain.presets import PRESETS
from service.views.dashboard import plan_capacity, suggestion_rows

DEFAULTS = {
    "model": "preset:small-llama", "gpu": "a100-40gb", "strategy": "ddp", "peft": "none", "lora_r": "16",
    "precision": "bf16", "gradient_checkpointing": "", "micro_batch_size": "4", "max_seq_length": "512",
    "num_workers": "1", "zero_stage": "2", "offload": "none",
}
STRATEGIES = ("ddp", "fsdp", "deepspeed", "pipeline", "tensor")
PEFTS = ("none", "lora", "qlora")
PRECISIONS = ("fp32", "bf16", "fp16")


class PlannerUnavailable(RuntimeError):
    pass


def form_to_body(form: dict[str, str]) -> dict[str, Any]:
    f = {**DEFAULTS, **{k: v for k, v in form.items() if v is not None}}
    gpu = f["gpu"].strip()
    training: dict[str, Any] = {
        "strategy": f["strategy"],
        "precision": f["precision"],
        "gradient_checkpointing": f.get("gradient_checkpointing") in ("on", "true", "1", "yes"),
        "hyperparameters": {"micro_batch_size": int(f["micro_batch_size"]), "max_seq_length": int(f["max_seq_length"])},
        "resources": {"num_workers": int(f["num_workers"]), **({"gpus_per_worker": 1, "gpu_type": gpu} if gpu else {})},
    }
    if f["peft"] != "none":
        training["peft"] = {"method": f["peft"], "r": int(f["lora_r"])}
    if f["strategy"] == "deepspeed":
        training["deepspeed"] = {"zero_stage": int(f["zero_stage"]),
                                 "offload_optimizer": "cpu" if f["offload"] in ("optimizer", "both") else "none",
                                 "offload_param": "cpu" if f["offload"] in ("param", "both") else "none"}
    if f["strategy"] == "fsdp" and f["offload"] != "none":
        training["fsdp"] = {"cpu_offload": True}
    return {"model": f["model"].strip(), "training_file": "file-planner", "training": training}


def plan_body(body: dict[str, Any], gpu: str | None = None, settings=None, training_path: str | None = None) -> Plan:
    """The planner's answer for a create body (``training_file`` optional): service.memory's
    plan_for_spec, the same as ``POST /v1/memory/plan``; ``training_path``: a local JSONL file to plan
    the data of (``memfit plan`` offline). Raises PlannerUnavailable when the planner is not part of this
    build, SpecError for a bad body, ValueError for an unknown GPU or model shape."""
    try:
        from service.memory.preflight import plan_for_spec
    except ImportError as exc:
        raise PlannerUnavailable("the memory planner (service/memory/) is not part of this build") from exc
    from service.domain.spec import validate_spec
    from service.settings import get_settings

    spec = validate_spec({"training_file": "file-plan-only", **body}, None)
    try:
        return plan_for_spec(spec, settings or get_settings(), gpu or None, training_path=training_path)
    except KeyError as exc:  # UnknownGPU
        raise ValueError(str(exc)) from None


def evaluate(form: dict[str, str] | None, *, known_gpus: set[str] | None = None, settings=None) -> dict[str, Any]:
    """Template context: the form (defaults filled), and for a submitted form the plan rows or errors."""
    values = {**DEFAULTS, **(form or {})}
    ctx: dict[str, Any] = {
        "form": values, "presets": sorted(PRESETS), "gpus": sorted(known_gpus or []),
        "strategies": STRATEGIES, "pefts": PEFTS, "precisions": PRECISIONS,
        "result": None, "errors": [], "unavailable": None,
    }
    if form is None:
        return ctx
    try:
        body = form_to_body(values)
        plan = plan_body(body, values.get("gpu") or None, settings)
    except PlannerUnavailable as exc:
        ctx["unavailable"] = str(exc)
        return ctx
    except ValueError as exc:
        problems = getattr(exc, "problems", None)
        ctx["errors"] = [f"{p.param}: {p.message}" for p in problems] if problems else [str(exc)]
        return ctx
    breakdown = plan.charted()
    host = plan.per_rank.host
    capacity, label = plan_capacity(plan)
    ctx["result"] = {
        "fits": plan.fits,
        "parameter_count": plan.parameter_count,
        "trainable_parameter_count": plan.trainable_parameter_count,
        "rows": [{"category": c, "label": LABELS[c], "bytes": breakdown[c],
                  "host_bytes": getattr(host, c) if c != "other" else host.temporary + host.overhead,
                  "share": breakdown[c] / capacity if capacity else None} for c in CHARTED],
        "host_total_bytes": host.total,
        "used_share": breakdown["total"] / capacity if capacity else None,
        "total_bytes": breakdown["total"], "capacity_bytes": capacity, "capacity_label": label,
        "suggestions": suggestion_rows(plan.suggestions), "plan": plan.model_dump(mode="json"),
    }
    return ctx
