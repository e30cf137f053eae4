"""The typed plan (service/domain/plan.py): the JSON it dumps is the one stored and served before it
existed, key for key, for the specs in tests/data/plans_before_typed_plan.json (captured from the old
dict-building code); stored plans read back unchanged; one list of categories; one structured error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from service.domain.errors import DoesNotFit, ErrorInfo, FailureInfo, ValidationFailed
from service.domain.plan import (
    ADDED_FIELDS,
    CATEGORIES,
    CHARTED,
    COMPARED,
    LABELS,
    Breakdown,
    Plan,
    read_plan,
)
from service.domain.spec import validate_spec
from service.memory.preflight import plan_for_spec, preflight
from service.settings import Settings

CASES = json.loads((Path(__file__).parent / "data" / "plans_before_typed_plan.json").read_text())
# One captured value was updated with host memory per node (service/memory/host.py, tested in
# tests/test_host_memory.py): the fsdp_offload suggestion's host_total_bytes of fsdp_2_workers_l4 now
# counts the pinned shards' power-of-two rounding. fsdp_2_workers_l4's plan was updated with FSDP2's root
# reduce-scatter instant (service/memory/planner.py: fsdp_root_reduce), now its peak: only that case changed.
# Then deepspeed_zero2_4_workers's phases (a checkpointed block's recomputation: a gated MLP's backward holds
# three T × intermediate gradients; the recomputation's own forward, a phase of its own) and the second
# suggestion of fsdp_2_workers_l4 (LoRA with checkpointing: the first block's input needs a gradient), neither peak.
# And the two CPU cases' optimizer states by 4 bytes a trainable tensor (AdamW's 0-dim fp32 ``step``).
# And fsdp_2_workers_l4's suggestions: FSDP2 now holds a PEFT method's frozen base in 16 bits (service/domain/
# training.py regime), so LoRA with checkpointing fits without a smaller micro-batch and ranks first.


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-schema")
    return Settings(database_url=f"sqlite:///{root}/memfit.db", storage_dir=root / "storage",
                    model_dirs=[root / "models"])


def as_captured(dumped: dict) -> dict:
    """A plan's JSON as the captured (older) code wrote it. Later additions are taken out, and checked
    on their own: ``host_memory`` (tests/test_host_memory.py), what plans that know the data added
    (``data``, ``at_max_seq_length``: the captured bodies have no training file, so the plan is the
    bound) and the planner's measured error for the strategy,
    which ``need_bytes`` now includes (service/memory/accuracy.py) and one assumption line states."""
    out = {k: v for k, v in dumped.items() if k not in ADDED_FIELDS}
    extra = dumped.get("accuracy_margin_bytes", 0)
    out["need_bytes"] -= extra
    if out["margin_bytes"] is not None:
        out["margin_bytes"] += extra
    out["assumptions"] = [a for a in out["assumptions"] if not a.startswith("plus the planner's measured")]
    out["plan"] = as_captured(out["plan"]) if isinstance(out.get("plan"), dict) else out.get("plan")
    if out["plan"] is None:
        del out["plan"]
    return out


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_planner_produces_todays_plan_json(case, settings):
    assert settings.memory_safety_margin == case["margin"]
    plan = plan_for_spec(validate_spec(case["body"], None), settings, case["gpu"])
    assert isinstance(plan, Plan)
    dumped = plan.model_dump(mode="json")
    assert as_captured(dumped) == case["plan"]
    # No training file: the plan is the bound, and says so; the bound beside it is the plan itself.
    assert plan.data is not None and not plan.data.measured and plan.data.reason.startswith("no training file")
    assert plan.data.planned_seq_length == plan.data.max_seq_length
    bound = plan.at_max_seq_length
    assert (bound.peak_bytes, bound.need_bytes, bound.per_rank, bound.fits) == (
        plan.peak_bytes, plan.need_bytes, plan.per_rank, plan.fits)
    assert plan.accuracy_margin_bytes == math.ceil(plan.peak_bytes * plan.accuracy_margin)
    assert plan.need_bytes == case["plan"]["need_bytes"] + plan.accuracy_margin_bytes


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_stored_plan_reads_back_unchanged(case):
    stored = case["plan"]
    plan = Plan.model_validate(stored)
    assert as_captured(plan.model_dump(mode="json")) == stored and plan.host_memory is None
    assert plan.device is plan.per_rank.device and plan.device.total == stored["device"]["total"]
    assert [s.rank for s in plan.suggestions] == list(range(1, len(stored["suggestions"]) + 1))


def test_the_cases_cover_what_the_plan_can_say():
    plans = {c["name"]: c["plan"] for c in CASES}
    assert plans["cpu_informative"]["capacity_bytes"] is None and plans["cpu_informative"]["margin_bytes"] is None
    assert plans["7b_fp32_does_not_fit"]["suggestions"] and not plans["7b_fp32_does_not_fit"]["fits"]
    assert plans["cpu_budget_short"]["gpu"] is None and plans["cpu_budget_short"]["suggestions"]
    assert plans["deepspeed_zero2_4_workers"]["world_size"] == 4
    assert {c["plan"]["model"]["source"] for c in CASES} == {"preset", "hub"}


def test_breakdown_total_is_the_sum_of_its_categories():
    b = Breakdown(parameters=1, gradients=2, optimizer_states=3, activations=4, temporary=5, overhead=6)
    assert b.total == 21 and b.model_dump()["total"] == 21
    b.activations = 10  # the planner fills categories in place
    assert b.total == 27
    with pytest.raises(ValueError):
        b.temporary = 1.5  # bytes are whole
    # a stored total is recomputed, so a plan cannot disagree with itself
    assert Breakdown.model_validate({"parameters": 7, "total": 99}).total == 7


def test_read_plan_refuses_what_is_not_a_plan():
    assert read_plan(None) is None
    assert read_plan({"code": "invalid_spec", "message": "no"}) is None
    assert read_plan(CASES[0]["plan"]).fits is True


def test_one_list_of_categories():
    from service.memory import compare, planner
    from service.views import dashboard

    assert tuple(Breakdown.model_fields) == CATEGORIES
    assert planner.Breakdown is Breakdown
    assert compare.COMPARED is COMPARED
    assert dashboard.CATEGORIES is CHARTED
    assert dashboard.CATEGORY_LABELS == {"parameters": "parameters", "gradients": "gradients",
                                         "optimizer_states": "optimizer states", "activations": "activations",
                                         "other": "temporary / other"}
    assert dashboard.COMPARED_LABELS == {c: LABELS[c] for c in COMPARED}
    assert dashboard.COMPARED_LABELS["total"] == "total (step peak)"
    plan = Plan.model_validate(CASES[0]["plan"])
    charted = plan.charted()
    assert set(charted) == {*CHARTED, "total"}
    d = CASES[0]["plan"]["per_rank"]["device"]
    assert charted["other"] == d["temporary"] + d["overhead"] and charted["total"] == d["total"]


def test_does_not_fit_carries_one_structured_error(settings):
    case = next(c for c in CASES if c["name"] == "7b_fp32_does_not_fit")
    with pytest.raises(DoesNotFit) as raised:
        preflight(validate_spec(case["body"], None), settings)
    exc = raised.value
    assert isinstance(exc.error, ErrorInfo)
    stored = exc.error.model_dump(mode="json")
    assert set(stored) == {"code", "message", "param", "details"}
    assert stored["code"] == "insufficient_memory" and stored["param"] == "training"
    assert {**stored["details"], "plan": as_captured(stored["details"]["plan"])} == {
        "breakdown": case["plan"]["per_rank"], "suggestions": case["plan"]["suggestions"], "plan": case["plan"]}
    assert exc.extensions == stored["details"]


def test_validation_failed_stores_error_info_json(settings):
    from service.scheduler.validate import memory_preflight

    assert ValidationFailed("file_missing", "gone", "training_file").error == {
        "code": "file_missing", "message": "gone", "param": "training_file", "details": {}}
    case = next(c for c in CASES if c["name"] == "7b_fp32_does_not_fit")
    with pytest.raises(ValidationFailed) as raised:
        memory_preflight(validate_spec(case["body"], None), settings, None)
    assert raised.value.error["code"] == "insufficient_memory"
    assert as_captured(raised.value.error["details"]["plan"]) == case["plan"]
    fits = next(c for c in CASES if c["name"] == "fits_gpu_bf16")
    assert as_captured(memory_preflight(validate_spec(fits["body"], None), settings, None)) == fits["plan"]


def test_failure_info_adds_where():
    f = FailureInfo(code="out_of_memory", message="oom", rank=1, step=3, phase="backward")
    assert f.model_dump(mode="json") == {"code": "out_of_memory", "message": "oom", "param": None, "details": {},
                                         "rank": 1, "step": 3, "phase": "backward"}


def test_planner_page_rows_come_from_the_typed_plan(settings):
    from service.views.plan_page import evaluate

    ctx = evaluate({"model": "preset:small-llama", "gpu": "a100-40gb", "peft": "lora"}, settings=settings)
    result = ctx["result"]
    assert not ctx["errors"] and result["fits"] is True and result["capacity_label"] == "a100-40gb"
    assert [r["category"] for r in result["rows"]] == list(CHARTED)
    plan = Plan.model_validate(result["plan"])
    d = plan.per_rank.device
    by_cat = {r["category"]: r["bytes"] for r in result["rows"]}
    assert by_cat["parameters"] == d.parameters and by_cat["other"] == d.temporary + d.overhead
    assert result["total_bytes"] == d.total and result["used_share"] == d.total / plan.capacity_bytes

    ctx = evaluate({"model": "meta-llama/Llama-2-7b-hf", "gpu": "a100-40gb", "precision": "fp32",
                    "micro_batch_size": "1"}, settings=settings)
    result = ctx["result"]
    assert result["fits"] is False and result["suggestions"]
    served = Plan.model_validate(result["plan"]).suggestions
    assert [s["change"] for s in result["suggestions"]] == [s.description for s in served]
    assert all(s["fits"] for s in result["suggestions"])


def test_job_page_suggestions_read_from_the_error_or_the_plan(settings):
    from service.views.dashboard import error_suggestions, suggestion_rows

    case = next(c for c in CASES if c["name"] == "7b_fp32_does_not_fit")
    with pytest.raises(DoesNotFit) as raised:
        preflight(validate_spec(case["body"], None), settings)
    error = raised.value.error.model_dump(mode="json")
    rows = suggestion_rows(error_suggestions(error))
    assert rows == [{"change": s["description"], "predicted_peak_bytes": s["predicted_peak_bytes"], "fits": True}
                    for s in case["plan"]["suggestions"]]
    assert error_suggestions({"code": "worker_error", "message": "x", "details": {}}) == []
    assert error_suggestions(None) == []


@pytest.mark.parametrize("name", ["7b_fp32_does_not_fit", "cpu_informative"])
def test_the_plan_table_renders_served_plans(name):
    from rich.console import Console

    from service.views.plan_table import render

    plan = Plan.model_validate(next(c["plan"] for c in CASES if c["name"] == name))
    console = Console(record=True, width=160)
    render(plan, console)
    text = console.export_text()
    assert plan.model.name in text and "total" in text
    if plan.fits:
        assert "nothing to fit into" in text
    else:
        assert "does not fit" in text and "changes that would fit" in text


def test_the_planner_page_shows_the_plan(client, tenant):
    """/ui/planner renders the typed plan's rows (the browser test does the same through chromium)."""
    import re

    r = client.post("/ui/planner", headers=tenant.headers, data={"model": "meta-llama/Llama-2-7b-hf",
                    "gpu": "a100-40gb", "precision": "fp32", "peft": "none", "micro_batch_size": "1"})
    assert r.status_code == 200, r.text[:500]
    rows = dict(re.findall(r'class="plan-row[^"]*" data-category="(\w+)" data-bytes="(\d*)"', r.text))
    assert list(rows) == [*CHARTED, "total"]
    body = {"model": "meta-llama/Llama-2-7b-hf", "training": {"precision": "fp32", "hyperparameters": {
        "micro_batch_size": 1, "max_seq_length": 512}, "resources": {"gpus_per_worker": 1, "gpu_type": "a100-40gb"}}}
    served = Plan.model_validate(client.post("/v1/memory/plan", headers=tenant.headers, json=body).json())
    charted = served.charted()
    assert {c: int(b) for c, b in rows.items()} == charted
    listed = r.text.split('<ol id="suggestions">')[1].split("</ol>")[0]
    assert "does not fit" in r.text and listed.count("<li>") == len(served.suggestions) > 0


def test_the_job_page_reads_the_stored_plan(client, tenant, create_job):
    """A job created over its memory (memory_policy=ignore) stores the plan; its page data shows the
    stored plan, its predicted categories and its suggestions."""
    r = create_job(tenant, model="meta-llama/Llama-2-7b-hf", training={
        "memory_policy": "ignore", "precision": "fp32",
        "hyperparameters": {"micro_batch_size": 1, "max_seq_length": 512},
        "resources": {"gpus_per_worker": 1, "gpu_type": "a100-40gb"}})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    stored = client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=tenant.headers).json()
    view = client.get(f"/ui/jobs/{job_id}/view.json", headers=tenant.headers).json()
    assert view["plan"] == stored["plan"] and Plan.model_validate(view["plan"]).fits is False
    assert view["comparison"]["has_plan"] is True and view["comparison"]["plan_source"] == "stored"
    assert view["comparison"]["predicted"] == stored["predicted"]
    assert view["memory"]["capacity_label"] == "a100-40gb capacity"
    assert view["memory"]["categories"] == list(CHARTED)
    assert view["suggestions"] == [{"change": s["description"], "predicted_peak_bytes": s["predicted_peak_bytes"],
                                    "fits": s["fits"]} for s in stored["plan"]["suggestions"]]
    assert view["suggestions"]
