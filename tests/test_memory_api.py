"""Memory truth over HTTP (issue 5): POST /v1/memory/plan, the pre-flight at job creation
(memory_policy reject → 422 with the breakdown and the ranked fixes, auto → the fix applied and an
event, ignore → created as given), GET /v1/fine_tuning/jobs/{id}/memory with samples ingested through
the real ingest endpoint, tenant isolation, and an out-of-memory post-mortem end to end (real
scheduler, real Ray, a CPU job given a host memory budget it cannot meet)."""

from __future__ import annotations

import time

import pytest

LLAMA_7B = "meta-llama/Llama-2-7b-hf"
A100 = {"gpus_per_worker": 1, "gpu_type": "a100-40gb"}
GiB = 2**30
CATS = ("parameters", "gradients", "optimizer_states", "activations", "temporary", "overhead", "total")


def plan(client, tenant, body, **params):
    return client.post("/v1/memory/plan", json=body, params=params, headers=tenant.headers)


def full_7b(**training):
    return {"model": LLAMA_7B, "training": {"resources": dict(A100), **training}}


def lora_7b():
    return {"model": LLAMA_7B, "training": {"peft": {"method": "lora", "r": 16}, "precision": "bf16",
                                            "gradient_checkpointing": True}}


# --- POST /v1/memory/plan -------------------------------------------------------------------------


def test_7b_full_fp32_adamw_does_not_fit_an_a100_40gb(client, tenant):
    r = plan(client, tenant, {"model": LLAMA_7B}, gpu="a100-40gb")
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["fits"] is False and p["gpu"] == "a100-40gb"
    assert p["parameter_count"] == p["trainable_parameter_count"] == 6_738_415_616
    for where in ("device", "host"):
        assert set(p["per_rank"][where]) == set(CATS)
        assert p["per_rank"][where]["total"] == sum(p["per_rank"][where][c] for c in CATS[:-1])
    # fp32 AdamW: 4 (weights) + 4 (gradients) + 8 (two moments) bytes per parameter of model state.
    states = p["model_states"]["device"]
    assert states["parameters"] + states["gradients"] + states["optimizer_states"] == 16 * p["parameter_count"]
    assert p["capacity_bytes"] == 40536 * 2**20 and p["usable_bytes"] == int(p["capacity_bytes"] * 0.9)
    assert p["peak_bytes"] > p["capacity_bytes"] and p["margin_bytes"] < 0
    # The ranked changes: every one fits, cheapest first, each with its predicted peak and its change.
    sug = p["suggestions"]
    assert sug and [s["rank"] for s in sug] == list(range(1, len(sug) + 1))
    assert all(s["fits"] and s["predicted_peak_bytes"] <= p["usable_bytes"] for s in sug)
    assert [(s["cost"], s["predicted_peak_bytes"]) for s in sug] == sorted((s["cost"], s["predicted_peak_bytes"]) for s in sug)
    assert all(s["spec_changes"] for s in sug)
    # The same GPU named in the body gives the same plan.
    same = plan(client, tenant, full_7b()).json()
    assert same["peak_bytes"] == p["peak_bytes"] and same["suggestions"] == sug


def test_7b_lora_bf16_checkpointing_fits_an_a100_40gb(client, tenant):
    r = plan(client, tenant, lora_7b(), gpu="a100-40gb")
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["fits"] is True and p["suggestions"] == []
    assert 0 < p["trainable_parameter_count"] < p["parameter_count"] // 100
    assert p["peak_bytes"] <= p["usable_bytes"] and p["margin_bytes"] == p["usable_bytes"] - p["need_bytes"] >= 0
    assert p["per_rank"]["device"]["total"] == p["peak_bytes"]


def test_cpu_plan_is_informative_without_a_budget_and_a_capacity_with_one(client, tenant):
    p = plan(client, tenant, {"model": "preset:tiny-llama"}).json()
    assert p["fits"] is True and p["capacity_bytes"] is None and p["gpu"] is None
    tight = plan(client, tenant, {"model": "preset:tiny-llama", "training": {
        "resources": {"host_memory_budget_bytes": 64 * 2**20}}}).json()
    assert tight["fits"] is False and tight["capacity_bytes"] == 64 * 2**20


def test_plan_errors_name_the_field(client, tenant, make_tenant):
    r = plan(client, tenant, {"model": LLAMA_7B}, gpu="voodoo-5")
    assert r.status_code == 422 and r.json()["code"] == "unknown_gpu" and r.json()["param"] == "gpu"
    r = plan(client, tenant, {"model": "someorg/some-model"})
    assert r.status_code == 422 and r.json()["code"] == "unknown_model_shape" and r.json()["param"] == "model"
    r = plan(client, tenant, {"model": LLAMA_7B, "training": {"lora_rank": 8}})
    assert r.status_code == 422 and r.json()["param"] == "training.lora_rank"
    assert client.post("/v1/memory/plan", json={"model": LLAMA_7B}).status_code == 401


def test_memfit_plan_answers_offline_for_the_examples(monkeypatch):
    """`memfit plan SPEC --gpu a100-40gb` with no server: the same service.memory plan."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from service.cli.main import app as cli

    examples = Path(__file__).resolve().parent.parent / "examples"
    env = {"MEMFIT_API_URL": "", "MEMFIT_API_KEY": ""}
    full = CliRunner().invoke(cli, ["plan", str(examples / "llama2-7b-full-a100.yaml"), "--gpu", "a100-40gb",
                                    "--json"], env=env)
    assert full.exit_code == 0, full.output
    p = json.loads(full.output)
    assert p["fits"] is False and p["parameter_count"] == 6_738_415_616 and p["suggestions"]
    states = p["model_states"]["device"]
    assert (states["parameters"] + states["gradients"] + states["optimizer_states"]) / p["parameter_count"] == 16
    lora = CliRunner().invoke(cli, ["plan", str(examples / "llama2-7b-lora-a100.yaml"), "--gpu", "a100-40gb"], env=env)
    assert lora.exit_code == 0, lora.output
    assert "fits" in lora.output and "does not fit" not in lora.output and "activations" in lora.output


# --- the pre-flight at creation -------------------------------------------------------------------


def test_reject_answers_422_with_the_breakdown_and_the_ranked_fixes(client, tenant, create_job, upload_file):
    training_file = upload_file(tenant).json()["id"]
    r = create_job(tenant, training_file=training_file, **full_7b())
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    # the plan endpoint given the same file: a hub model's tokenizer is not read here, so both are the bound
    expected_plan = plan(client, tenant, {**full_7b(), "training_file": training_file}).json()
    assert not expected_plan["data"]["measured"] and "hub model" in expected_plan["data"]["reason"]
    sug = expected_plan["suggestions"]
    detail = (f"predicted peak {expected_plan['peak_bytes'] / GiB:.2f} GiB per rank does not fit a100-40gb: "
              f"{expected_plan['usable_bytes'] / GiB:.2f} GiB usable of {expected_plan['capacity_bytes'] / GiB:.2f} GiB "
              f"(safety margin 10%); {len(sug)} change(s) that fit are in `suggestions`, cheapest first")
    assert body == {
        "type": "https://memfit.dev/problems/insufficient_memory",
        "title": "Insufficient memory",
        "status": 422,
        "detail": detail,
        "instance": "/v1/fine_tuning/jobs",
        "code": "insufficient_memory",
        "param": "training",
        "errors": [],
        "error": {"message": detail, "type": "invalid_request_error", "param": "training",
                  "code": "insufficient_memory"},
        "breakdown": expected_plan["per_rank"],
        "suggestions": sug,
        "plan": expected_plan,
    }
    assert client.get("/v1/fine_tuning/jobs", headers=tenant.headers).json()["data"] == []  # nothing created


def events_of(client, tenant, job_id):
    return client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=tenant.headers).json()["data"]


def test_auto_creates_the_job_with_the_cheapest_fix_applied_and_an_event(client, tenant, create_job):
    first = plan(client, tenant, full_7b()).json()["suggestions"][0]
    r = create_job(tenant, **full_7b(memory_policy="auto"))
    assert r.status_code == 200, r.text
    job = r.json()
    assert first["spec_changes"]
    for dotted, value in first["spec_changes"].items():
        node = {"training": job["training"]}
        for key in dotted.split("."):
            node = node[key]
        assert node == value, dotted
    assert job["memory"]["fits"] is True and job["memory"]["predicted_peak_bytes"] == first["predicted_peak_bytes"]
    [event] = [e for e in events_of(client, tenant, job["id"]) if e["message"].startswith("memory pre-flight: applied")]
    assert event["message"].startswith(f"memory pre-flight: applied {first['change']} (")
    assert event["data"]["applied"] == first
    stored = client.get(f"/v1/fine_tuning/jobs/{job['id']}/memory", headers=tenant.headers).json()["plan"]
    assert stored["fits"] is True and stored["peak_bytes"] == first["predicted_peak_bytes"]  # the fixed spec's plan


def test_ignore_creates_the_job_as_given_with_a_warning(client, tenant, create_job):
    r = create_job(tenant, **full_7b(memory_policy="ignore"))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["training"]["strategy"] == "ddp" and job["training"]["peft"]["method"] == "none"
    assert job["training"]["precision"] == "fp32" and job["memory"]["fits"] is False
    [warn] = [e for e in events_of(client, tenant, job["id"]) if e["message"].startswith("memory pre-flight")]
    assert warn["level"] == "warn" and "memory_policy=ignore" in warn["message"]
    stored = client.get(f"/v1/fine_tuning/jobs/{job['id']}/memory", headers=tenant.headers).json()
    assert stored["plan"]["fits"] is False and stored["plan"]["suggestions"] and stored["samples"] == {}


def test_a_job_that_fits_is_created_with_its_plan_and_no_extra_event(client, tenant, create_job):
    r = create_job(tenant, **lora_7b())
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["memory"]["fits"] is True and job["memory"]["measured_peak_bytes"] is None
    events = events_of(client, tenant, job["id"])  # create's own: the file check and the derived hyperparameters
    assert [e["message"] for e in events if "derived" not in (e.get("data") or {})] == [
        f"Validating training file: {job['training_file']}"]


# --- predicted vs measured ------------------------------------------------------------------------


def claimed(api_app, job_id: str) -> str:
    """Move a new job to running, attempt 1, the way the scheduler's claim does; return its ingest token."""
    from service.store.db import session_scope
    from service.store.tokens import new_ingest_token
    from service.store.transitions import transition

    token, token_hash = new_ingest_token()
    with session_scope(api_app.state.sessions) as s:
        transition(s, job_id, "queued")
        transition(s, job_id, "running", attempt=1, ingest_token_hash=token_hash)
    return token


def test_memory_view_compares_each_category_and_is_tenant_scoped(client, api_app, tenant, make_tenant, create_job,
                                                                upload_file):
    # Rows longer than max_seq_length (cut to it): the plan is the one at max_seq_length, whose peak has activations.
    long_rows = upload_file(tenant, '{"text": "' + "memory " * 700 + '"}\n').json()["id"]
    job = create_job(tenant, model="preset:small-llama", training_file=long_rows,
                     training={"resources": {"num_workers": 2}}).json()
    job_id = job["id"]
    token = claimed(api_app, job_id)
    p = client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=tenant.headers).json()["plan"]
    states = p["model_states"]
    pred = {c: states["device"][c] + states["host"][c] for c in ("parameters", "gradients", "optimizer_states")}
    pred["activations"] = p["per_rank"]["device"]["activations"] + p["per_rank"]["host"]["activations"]
    pred["total"] = p["peak_bytes"]  # CPU: no GPU overhead to take away
    pred["temporary"] = pred["total"] - sum(pred[c] for c in ("parameters", "gradients", "optimizer_states", "activations"))

    # What the workers send: counters every step, the profiler's peak and activations on traced steps.
    def sample(rank, step, scale, traced):
        s = {"kind": "memory", "attempt": 1, "time": time.time(), "rank": rank, "step": step,
             "source": "profiler" if traced else "counters",
             "parameters_bytes": pred["parameters"], "gradients_bytes": pred["gradients"],
             "optimizer_bytes": int(pred["optimizer_states"] * (1.0 if step > 1 else 0.0)), "other_bytes": 4096,
             "host_parameters_bytes": 0, "host_gradients_bytes": 0, "host_optimizer_bytes": 0,
             "process_rss_bytes": 900 * 2**20}
        if traced:
            s.update(activations_bytes=int(pred["activations"] * scale), peak_bytes=int(pred["total"] * scale * 1.02),
                     temporary_bytes=int(pred["temporary"] * scale))
        return s

    records = []
    for rank, scale in ((0, 1.10), (1, 0.95)):
        records += [sample(rank, 1, 3.0, True),  # a warm-up step's peak: not steady state, left out
                    sample(rank, 2, 1.0, False), sample(rank, 3, scale, True), sample(rank, 4, 1.0, False)]
    r = client.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": records},
                    headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text

    view = client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=tenant.headers).json()
    assert view["object"] == "fine_tuning.job.memory" and view["has_plan"] and view["predicted"] == pred
    assert p["data"]["measured"] and p["data"]["planned_seq_length"] == p["data"]["max_seq_length"] == 512
    assert view["predicted_at_max_seq_length"] == pred["total"]  # rows fill max_seq_length: the data plan is the bound
    assert [s["step"] for s in view["samples"]["0"]] == [1, 2, 3, 4] and set(view["samples"]) == {"0", "1"}
    for rank, scale in (("0", 1.10), ("1", 0.95)):
        m = view["measured_peaks"][rank]
        assert m == {"parameters": pred["parameters"], "gradients": pred["gradients"],
                     "optimizer_states": pred["optimizer_states"], "activations": int(pred["activations"] * scale),
                     "temporary": int(pred["temporary"] * scale) + 4096, "total": int(pred["total"] * scale * 1.02)}
        for c in m:
            assert view["errors"][rank][c] == pytest.approx((pred[c] - m[c]) / m[c])
        assert view["errors"][rank]["parameters"] == 0.0
        assert [row["category"] for row in view["per_rank"][rank]] == list(m)
    assert view["errors"]["0"]["total"] == pytest.approx(1 / (1.10 * 1.02) - 1)

    summary = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=tenant.headers).json()["memory"]
    steady_peak = int(pred["total"] * 1.10 * 1.02)
    assert summary["measured_peak_bytes"] == steady_peak and summary["measured_rank"] == 0
    assert summary["measured_step"] == 3 and summary["predicted_peak_bytes"] == p["peak_bytes"]
    assert summary["error"] == pytest.approx((pred["total"] - steady_peak) / steady_peak)

    other = make_tenant()
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=other.headers).status_code == 404
    assert client.get("/v1/fine_tuning/jobs/ftjob-nope/memory", headers=tenant.headers).status_code == 404


# --- out of memory, end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory):
    from tests.stack import Stack

    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("oom-storage"), ray_head)
        s.start_scheduler()
        yield s
        s.close()


@pytest.mark.ray
@pytest.mark.slow
def test_a_cpu_job_over_its_host_memory_budget_fails_out_of_memory_with_a_post_mortem(stack, artifacts_dir):
    budget = 100 * 2**20  # far below a torch worker's RSS: the first phase mark trips it
    job_id = stack.create(resources={"num_workers": 1, "host_memory_budget_bytes": budget},
                          memory_policy="ignore", max_failures=0)
    job = stack.wait(job_id, ("failed",), timeout=540)  # a loaded CPU: Ray worker start-up dominates
    error = job["error"]
    import json

    (artifacts_dir / "oom-post-mortem.json").write_text(json.dumps(error, indent=1))  # what a user sees
    assert error["code"] == "out_of_memory", error
    assert error["rank"] == 0 and error["step"] == 1 and error["phase"] in ("forward", "backward", "optimizer")
    d = error["details"]
    assert d["limit_bytes"] == budget and d["used_bytes"] > budget
    assert d["breakdown"]["parameters_bytes"] > 0 and d["breakdown"]["process_rss_bytes"] > budget
    assert d["dominant_category"] in d["categories_bytes"]
    assert "largest category: " + d["dominant_category"] in error["message"]
    assert d["predicted"]["fits"] is False and d["predicted"]["capacity_bytes"] == budget
    assert d["suggestions"] and all(s["predicted_peak_bytes"] < d["predicted"]["peak_bytes"] for s in d["suggestions"])
    assert "plan" not in d  # the plan is on the job and in GET …/memory, not copied into the error
    messages = [e["message"] for e in stack.events(job_id)]
    assert any(m.startswith("memory pre-flight: predicted peak") for m in messages)
    view = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=stack.auth).json()
    assert view["has_plan"] and view["plan"]["capacity_bytes"] == budget


def test_a_pipeline_with_more_stages_than_blocks_is_a_422_naming_stages(client, tenant):
    r = plan(client, tenant, {"model": "preset:tiny-llama", "training": {
        "strategy": "pipeline", "pipeline": {"stages": 4}, "resources": {"num_workers": 4}}})
    assert r.status_code == 422, r.text
    assert r.json()["param"] == "training.pipeline.stages" and "2" in r.json()["errors"][0]["message"]
