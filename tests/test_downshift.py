"""training.on_oom: downshift (service/memory/downshift.py, service/scheduler/loop.py: _downshift).

- the ladder and the choice, from the planner alone (no torch);
- a job whose attempts keep running out of memory fails ``out_of_memory`` once training.max_downshifts
  are spent, with the worker's post-mortem and the reason (the real ingest and scheduler, no Ray);
- end to end over HTTP and Ray: a CPU job whose worker goes over ``host_memory_budget_bytes`` at step 2
  resumes from the checkpoint of step 1 with a smaller micro-batch and more accumulation, succeeds, says
  what it ran with — and its losses equal an uninterrupted run of the downshifted configuration.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from service.domain.spec import JobSpec
from service.memory import downshift
from service.settings import Settings

MiB = 2**20


def _spec(**training) -> JobSpec:
    return JobSpec.model_validate({"model": "preset:small-llama", "training_file": "file-1", "training": training})


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    root = tmp_path_factory.mktemp("downshift")
    return Settings(database_url=f"sqlite:///{root}/memfit.db", storage_dir=root / "storage", model_dirs=[root])


# --- the ladder and the choice ----------------------------------------------------------------------


def test_the_ladder_keeps_the_global_batch_and_goes_micro_batch_then_checkpointing_then_offload():
    spec = _spec(strategy="deepspeed", deepspeed={"zero_stage": 3}, resources={"num_workers": 2},
                 hyperparameters={"micro_batch_size": 4, "gradient_accumulation_steps": 2})
    rungs = downshift.ladder(spec)
    assert [name for name, _, _ in rungs] == [
        "micro_batch_2", "micro_batch_1",
        "gradient_checkpointing", "gradient_checkpointing+micro_batch_2", "gradient_checkpointing+micro_batch_1",
        "gradient_checkpointing+offload_optimizer", "gradient_checkpointing+offload_optimizer+micro_batch_2",
        "gradient_checkpointing+offload_optimizer+micro_batch_1",
        "gradient_checkpointing+offload_optimizer+offload_param",
        "gradient_checkpointing+offload_optimizer+offload_param+micro_batch_2",
        "gradient_checkpointing+offload_optimizer+offload_param+micro_batch_1"]
    for _, _, patch in rungs:
        r = downshift.patched_spec(spec, patch).resolved()
        assert r.global_batch_size == spec.resolved().global_batch_size == 16
        assert r.learning_rate == spec.resolved().learning_rate
    # ddp over several workers may shard (FSDP2 resumes ddp's checkpoint); a lone ddp worker cannot;
    # ZeRO-2 never becomes ZeRO-3 (the checkpoint layouts differ); nothing is left at the bottom.
    assert downshift.ladder(_spec(resources={"num_workers": 2}, gradient_checkpointing=True,
                                  hyperparameters={"micro_batch_size": 1})) == [
        ("fsdp", "FSDP2 sharding over the 2 workers", {"training.strategy": "fsdp"})]
    assert not any("zero_stage" in str(p) for _, _, p in downshift.ladder(_spec(strategy="deepspeed")))
    assert downshift.ladder(_spec(gradient_checkpointing=True, hyperparameters={"micro_batch_size": 1})) == []


def test_the_first_rung_whose_corrected_plan_fits_is_chosen(settings):
    budget = 1100 * MiB
    spec = _spec(hyperparameters={"micro_batch_size": 4, "max_seq_length": 1024},
                 resources={"host_memory_budget_bytes": budget})
    choice = downshift.choose(spec, settings, {"details": {"limit_bytes": budget}})
    assert isinstance(choice, downshift.Downshift)
    # micro-batch 2 is still planned over the usable 990 MiB, micro-batch 1 fits
    assert [(t["change"], t["fits"]) for t in choice.tried] == [("micro_batch_2", False), ("micro_batch_1", True)]
    assert choice.change == "micro_batch_1" and choice.miss == 1.0
    assert choice.spec_changes == {"training.hyperparameters.micro_batch_size": 1,
                                   "training.hyperparameters.gradient_accumulation_steps": 4}
    assert choice.after.need_bytes <= choice.after.usable_bytes < choice.before.need_bytes
    # A plan the worker proved low — it planned 1.35 GiB, yet the worker ran out of 1.56 GiB: low by ≥ ×1.16 —
    # scales every candidate's need by that factor before comparing.
    proved_low = _spec(hyperparameters={"micro_batch_size": 4, "max_seq_length": 1024},
                       resources={"host_memory_budget_bytes": 1600 * MiB})
    scaled = downshift.choose(proved_low, settings, {"details": {"limit_bytes": 1600 * MiB}})
    assert scaled.change == "micro_batch_2" and scaled.miss == pytest.approx(1600 * MiB / scaled.before.need_bytes)
    [tried] = scaled.tried
    assert tried["corrected_need_bytes"] == int(tried["need_bytes"] * scaled.miss) > tried["need_bytes"]
    # Under 700 MiB (the process itself takes ~600) nothing on the ladder fits: no downshift, and why.
    tight = _spec(hyperparameters={"micro_batch_size": 4, "max_seq_length": 1024},
                  resources={"host_memory_budget_bytes": 700 * MiB})
    none = downshift.choose(tight, settings, {"details": {"limit_bytes": 700 * MiB}})
    assert isinstance(none, downshift.NoDownshift) and "gradient_checkpointing+micro_batch_1" in none.why
    assert len(none.tried) == 5 and not any(t["fits"] for t in none.tried)


def test_on_oom_and_max_downshifts_are_bounded_fields():
    from service.domain.spec import SpecError, validate_spec

    assert _spec().training.on_oom == "fail" and _spec().training.max_downshifts == 2
    for bad in ({"on_oom": "retry"}, {"max_downshifts": 0}, {"max_downshifts": 9}):
        with pytest.raises(SpecError) as exc:
            validate_spec({"model": "preset:tiny-llama", "training_file": "f", "training": bad})
        assert exc.value.problems[0].param == f"training.{next(iter(bad))}"


# --- the requeue and its bound: the real ingest and scheduler, no Ray ---------------------------------


@pytest.fixture(scope="module")
def no_ray(new_database, tmp_path_factory):
    from tests.scheduler_support import app_without_ray

    with app_without_ray(new_database, tmp_path_factory.mktemp("downshift-no-ray")) as stack:
        yield stack


def _oom(attempt: int, step: int = 2) -> dict:
    import time

    return {"kind": "failure", "attempt": attempt, "time": time.time(), "code": "out_of_memory",
            "message": f"HostMemoryExceeded: process memory over the budget (attempt {attempt})", "rank": 0,
            "step": step, "phase": "forward", "details": {"limit_bytes": 1600 * MiB, "used_bytes": 1650 * MiB,
                                                          "categories_bytes": {"activations": 500 * MiB}}}


def test_each_oom_is_a_fenced_requeue_with_a_new_spec_until_max_downshifts_then_out_of_memory(no_ray):
    from service.scheduler.paths import submission_id
    from tests.factories import create_job, new_key, upload

    app, client, sched = no_ray
    key = new_key(app.state.sessions)
    auth = {"Authorization": f"Bearer {key}"}
    training = {"hyperparameters": {"micro_batch_size": 4, "max_seq_length": 1024},
                "resources": {"host_memory_budget_bytes": 1600 * MiB}, "memory_policy": "ignore",
                "on_oom": "downshift", "max_downshifts": 2}
    job_id = create_job(client, key, upload(client, key), training, model="preset:small-llama")["id"]
    fail_fast = create_job(client, key, upload(client, key), {**training, "on_oom": "fail"},
                           model="preset:small-llama")["id"]
    sched.validate_pending()
    micro = []
    for attempt in (1, 2, 3):
        tokens = {j: t for j, a, t in sched.claim(limit=100)}
        assert job_id in tokens, client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["error"]
        r = client.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": [_oom(attempt)]},
                        headers={"Authorization": f"Bearer {tokens[job_id]}"})
        assert r.status_code == 200, r.text
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
        assert job["status"] == "running" and job["error"] is None  # held back for the scheduler
        micro.append(job["training"]["hyperparameters"]["micro_batch_size"])
        error = sched._pending_oom(job_id, attempt)
        assert error["code"] == "out_of_memory" and error["step"] == 2
        sched._downshift(job_id, attempt, submission_id(job_id, attempt), error)
        # a stale call (an attempt that is not the job's any more) changes nothing
        sched._downshift(job_id, attempt - 1 or 99, submission_id(job_id, attempt), error)
        if attempt == 1:
            other = client.get(f"/v1/fine_tuning/jobs/{fail_fast}", headers=auth).json()
            assert other["status"] == "running"
            r = client.post(f"/v1/internal/jobs/{fail_fast}/ingest", json={"records": [_oom(1)]},
                            headers={"Authorization": f"Bearer {tokens[fail_fast]}"})
            assert client.get(f"/v1/fine_tuning/jobs/{fail_fast}", headers=auth).json()["status"] == "failed"
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    # Each out-of-memory proves the plan of the spec that ran low (1.35 GiB planned, then 1.03 GiB, each
    # out of 1.56 GiB): the next rung is chosen with that factor, 4 → 2 → 1 rows, 1 → 2 → 4 accumulation.
    assert micro == [4, 2, 1]
    assert job["training"]["hyperparameters"]["gradient_accumulation_steps"] == 4
    assert job["status"] == "failed" and job["error"]["code"] == "out_of_memory"
    assert "not downshifted: training.max_downshifts (2) already spent" in job["error"]["message"]
    assert job["error"]["details"]["categories_bytes"] == {"activations": 500 * MiB}  # the post-mortem kept
    shifts = [e for e in client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth).json()["data"]
              if e["message"].startswith("Downshift ")]
    assert sorted(e["data"]["downshift"] for e in shifts) == [1, 2]
    shifts.sort(key=lambda e: e["data"]["downshift"])
    assert [e["data"]["change"] for e in shifts] == ["micro_batch_2", "micro_batch_1"]
    assert 1 < shifts[0]["data"]["miss_factor"] < shifts[1]["data"]["miss_factor"]
    assert shifts[1]["data"]["before"]["need_bytes"] == shifts[0]["data"]["after"]["need_bytes"]


def test_a_ddp_optimizer_state_is_rekeyed_by_name_as_fsdp2_reads_it():
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from workers.checkpoint import _keyed_by_name

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # frozen parameters are not the optimizer's
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    keyed = _keyed_by_name(opt.state_dict(), model)
    reference = get_optimizer_state_dict(model, opt)  # what torch.distributed.checkpoint keys by name
    assert list(keyed["state"]) == list(reference["state"]) == ["0.weight", "2.weight", "2.bias"]
    for name, state in reference["state"].items():
        for k, v in state.items():
            assert torch.equal(keyed["state"][name][k], v)
    assert keyed["param_groups"][0]["params"] == reference["param_groups"][0]["params"]
    assert _keyed_by_name(keyed, model) is keyed  # already by name: as it is


@pytest.mark.gpu
def test_a_cuda_out_of_memory_is_an_out_of_memory_failure_the_downshift_reads(tmp_path, settings):
    """On a GPU the worker's OutOfMemoryError is written as out_of_memory with the limit it hit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workers.args import TrainArgs
    from workers.local import run_local

    os.environ.setdefault("MEMFIT_PRESET_CACHE", str(tmp_path / "presets"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _training_rows()))
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(300 * MiB / total)  # the model fits, 8 × 1024 rows do not
    try:
        args = TrainArgs(job_id="ftjob-cuda-oom", output_dir=str(tmp_path / "out"), training_path=str(path),
                         model="preset:small-llama", micro_batch_size=8, max_steps=2, max_seq_length=SEQ,
                         memory_trace_every_steps=1000)
        with pytest.raises(torch.OutOfMemoryError):
            run_local(args, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    failure = json.loads((tmp_path / "out" / "failure-rank0.json").read_text())
    assert failure["code"] == "out_of_memory" and failure["phase"] in ("forward", "backward", "optimizer")
    assert failure["details"]["limit_bytes"] and failure["details"]["used_bytes"] > 0


# --- end to end over HTTP and Ray -------------------------------------------------------------------

# small-llama (vocab 8000) at 1024 tokens: four full rows in one micro-batch hold ~300 MiB more than one row
# at a time (mostly the fp32 logits and their log-softmax, b·s·V each). The worker's budget check counts
# RSS once malloc's free heap pages are handed back (workers/telemetry.py: mark), and on 2026-12-06 its
# marks measured, in the Ray worker: the resumed 1 × 4 attempt at most 839 MiB (916 MiB before the
# release), 4 × 1 at 1156 MiB in forward (1222 before). Without the release a CI run's 1 × 4 attempt
# reached 1171 MiB, over the old 1150 MiB budget. 1010 MiB sits ~150 MiB inside both ends, and the
# planner, which must pick 1 × 4, sees micro-batch 2 over the usable 90% (1059 > 909 MiB) and 1 fit (883).
SEQ, ROWS, SEED = 1024, 16, 7
BUDGET = int(os.environ.get("MEMFIT_TEST_DOWNSHIFT_BUDGET", 1010 * MiB))


def _dicts(value):
    """Every dict inside a JSON value."""
    if isinstance(value, dict):
        yield value
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            yield from _dicts(v)


def _training_rows() -> list[dict]:
    """16 text rows: short ones, except the four the sampler gives optimizer step 2 (one worker, 4 × 1),
    which fill max_seq_length — so step 1 fits, is checkpointed, and step 2 runs out of memory."""
    from workers.data import StepSampler

    long_rows = {i for m in StepSampler(ROWS, 4, 1, 1, SEED).micro_batches(1, 0) for i in m}
    rnd = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    return [{"text": " ".join(f"{rnd.choice(words)}{rnd.randint(0, 999)}" for _ in range(2600 if i in long_rows else 8))}
            for i in range(ROWS)]


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory):
    from tests.stack import Stack

    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("downshift-storage"), ray_head)
        s.start_scheduler()
        yield s
        s.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_over_its_host_budget_downshifts_once_and_trains_as_the_downshifted_run(stack, tmp_path):
    from tests.factories import create_job, upload

    rows = _training_rows()
    file_id = upload(stack.http, stack.key, rows)
    hp = {"max_steps": 2, "micro_batch_size": 4, "max_seq_length": SEQ, "learning_rate": 1e-3}
    job = create_job(stack.http, stack.key, file_id, {
        "hyperparameters": hp, "resources": {"num_workers": 1, "host_memory_budget_bytes": BUDGET},
        "checkpoint_every_steps": 1, "memory_trace_every_steps": 1000, "on_oom": "downshift",
        # the planner already sees micro-batch 4 over the budget: run it anyway, so that it runs out
        "memory_policy": "ignore", "max_failures": 0}, model="preset:small-llama", seed=SEED)
    job = stack.wait(job["id"], ("succeeded",), timeout=720)
    events = stack.events(job["id"])
    messages = [e["message"] for e in events]

    # One downshift, as a job event with the plans before and after; the run then resumed from step 1.
    shifts = [e for e in events if e["message"].startswith("Downshift ")]
    # The budget sits ~150 MiB inside the window between the two configs' RSS (see BUDGET): if micro-batch 4
    # ever stays under it, say by how much (the memory view holds each step's measured process RSS).
    if len(shifts) != 1:
        memory = stack.http.get(f"/v1/fine_tuning/jobs/{job['id']}/memory", headers=stack.auth).json()
        pytest.fail(f"{len(shifts)} downshifts with a budget of {BUDGET / MiB:.0f} MiB; measured process RSS (MiB) "
                    f"by step: {sorted({(x.get('step'), round(x['rss'] / MiB)) for x in _dicts(memory) if x.get('rss')})}")
    d = shifts[0]["data"]
    assert d["downshift"] == 1 and d["attempt"] == 1 and d["change"] == "micro_batch_1"
    assert d["spec_changes"] == {"training.hyperparameters.micro_batch_size": 1,
                                 "training.hyperparameters.gradient_accumulation_steps": 4}
    assert d["before_values"] == {"training.hyperparameters.micro_batch_size": 4,
                                  "training.hyperparameters.gradient_accumulation_steps": 1}
    assert d["out_of_memory"]["code"] == "out_of_memory" and d["out_of_memory"]["step"] == 2
    assert d["before"]["need_bytes"] > d["after"]["need_bytes"] and d["after"]["fits"]
    assert any(m.startswith("Attempt 2 resumes from the checkpoint of step 1") for m in messages), messages
    assert job["attempt"] == 2 and job["error"] is None
    # What it ran with: the stored spec (GET …/jobs/{id}) and the result file both say so.
    assert job["training"]["hyperparameters"]["micro_batch_size"] == 1
    assert job["training"]["hyperparameters"]["gradient_accumulation_steps"] == 4
    result = stack.results(job)
    assert result["training"]["hyperparameters"]["micro_batch_size"] == 1
    assert [x["change"] for x in result["downshifts"]] == ["micro_batch_1"]

    # The losses equal an uninterrupted run of the downshifted configuration (1 × 4 from the start).
    losses = {e["data"]["step"]: e["data"]["train_loss"] for e in events if e["type"] == "metrics"}
    reference = _reference_losses(tmp_path, rows, hp)
    assert sorted(losses) == [1, 2]
    for step, ref in enumerate(reference, start=1):
        # fp32: the same sums in another order (one 4-row matmul vs four 1-row ones) differ by rounding
        # only: 4 × 1 against 1 × 4 measured 6e-8 relative at step 1, 0 at step 2. A changed trajectory
        # is far outside 1e-5: half the batch (1 × 2) moves step 1 by 9e-4 and step 2 by 1e-2.
        assert losses[step] == pytest.approx(ref, rel=1e-5), (step, losses[step], ref)


def _reference_losses(tmp_path: Path, rows: list[dict], hp: dict) -> list[float]:
    from workers.args import TrainArgs
    from workers.local import run_local

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = TrainArgs(job_id="ftjob-reference", output_dir=str(tmp_path / "out"), training_path=str(path),
                     model="preset:small-llama", micro_batch_size=1, accumulation=4, max_steps=hp["max_steps"],
                     max_seq_length=SEQ, learning_rate=hp["learning_rate"], seed=SEED, checkpoint_every_steps=100,
                     memory_trace_every_steps=1000)
    [rank0] = run_local(args)
    return [r["loss"] for r in rank0["reports"] if r.get("kind") == "metrics"]
