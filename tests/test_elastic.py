"""Elastic re-plan (issue 12, item 6): ``resources.min_workers``, the split that keeps the global batch on
each world size, the planner's verdict for it, and what a worker group started on fewer workers runs.
No Ray here; the Ray test is tests/test_multinode.py's elastic one."""

from __future__ import annotations

import pytest

from service.domain.spec import JobSpec, RunRequest, SpecError, validate_spec
from service.memory.elastic import resplit, world_plans, world_sizes
from service.settings import Settings

BASE = {"model": "preset:tiny-llama", "training_file": "file-1"}


def _spec(**training) -> JobSpec:
    return validate_spec({**BASE, "training": training})


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    root = tmp_path_factory.mktemp("elastic")
    return Settings(database_url=f"sqlite:///{root}/memfit.db", storage_dir=root / "storage", model_dirs=[root])


def _problems(training) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as exc:
        validate_spec({**BASE, "training": training})
    return [(p.param, p.message) for p in exc.value.problems]


def test_min_workers_is_bounded_and_named():
    [(param, message)] = _problems({"resources": {"num_workers": 2, "min_workers": 3}})
    assert param == "training.resources.min_workers" and "must not exceed" in message
    [(param, message)] = _problems({"strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 2},
                                    "hyperparameters": {"micro_batch_size": 2},
                                    "resources": {"num_workers": 4, "min_workers": 3}})
    assert param == "training.resources.min_workers" and "multiple of pipeline.stages" in message
    [(param, _)] = _problems({"strategy": "deepspeed", "resources": {"num_workers": 2, "min_workers": 1}})
    assert param == "training.resources.min_workers"
    [(param, _)] = _problems({"resources": {"num_workers": 2, "min_workers": 0}})
    assert param == "training.resources.min_workers"
    assert _spec(resources={"num_workers": 2, "min_workers": 2}).training.resources.min_workers == 2


def test_fewer_workers_keep_the_global_batch_with_more_accumulation():
    spec = _spec(hyperparameters={"micro_batch_size": 2, "gradient_accumulation_steps": 2},
                 resources={"num_workers": 4, "min_workers": 1})
    assert world_sizes(spec) == [3, 2, 1]
    assert spec.resolved().global_batch_size == 16
    got = {}
    for w in (3, 2, 1):
        candidate, split = resplit(spec, w)
        got[w] = (split.micro_batch_size, split.gradient_accumulation_steps, split.problem is None)
        if candidate is not None:
            r = candidate.resolved()
            assert (r.global_batch_size, r.data_parallel_size, candidate.training.resources.num_workers) == (16, w, w)
    # 3 cannot share 16 rows evenly: refused, not another batch
    assert got == {3: (2, 2, False), 2: (2, 4, True), 1: (2, 8, True)}
    assert "cannot be split evenly over 3" in resplit(spec, 3)[1].problem


def test_the_micro_batch_shrinks_to_a_divisor_of_the_share_when_it_must():
    # global 12 = 4 × 1 × 3; on 2 workers each takes 6 rows: micro-batch 4 does not divide 6 → 3 × 2
    spec = _spec(hyperparameters={"micro_batch_size": 4}, resources={"num_workers": 3, "min_workers": 2})
    candidate, split = resplit(spec, 2)
    assert (split.micro_batch_size, split.gradient_accumulation_steps, split.global_batch_size) == (3, 2, 12)
    assert candidate.resolved().global_batch_size == 12


def test_a_pipeline_replans_on_whole_replicas():
    spec = _spec(strategy="pipeline", pipeline={"stages": 2, "schedule": "gpipe"},
                 hyperparameters={"micro_batch_size": 2}, resources={"num_workers": 4, "min_workers": 2})
    assert world_sizes(spec) == [2]
    candidate, split = resplit(spec, 2)
    assert (split.data_parallel_size, split.micro_batch_size, split.gradient_accumulation_steps) == (1, 2, 2)
    assert candidate.resolved().global_batch_size == spec.resolved().global_batch_size == 4


def test_each_world_size_is_planned_and_one_that_does_not_fit_says_so(settings):
    # CPU workers with a host budget: the plan of 1 worker holds the whole micro-batch's accumulation the
    # same, so take an fsdp job whose per-rank state grows as the world shrinks (shards of 1/w)
    spec = _spec(strategy="fsdp", hyperparameters={"micro_batch_size": 1, "max_seq_length": 64},
                 resources={"num_workers": 4, "min_workers": 1})
    plans = {p.world_size: p for p in world_plans(spec, settings)}
    assert sorted(plans) == [1, 2, 3] and plans[3].problem and plans[3].code == "elastic_world_size"
    assert plans[2].fits and plans[1].fits  # no capacity named: informative plans fit
    assert plans[1].need_bytes > plans[2].need_bytes  # one rank holds the whole model state
    budget = (plans[1].need_bytes + plans[2].need_bytes) // 2 + 1
    tight = _spec(strategy="fsdp", hyperparameters={"micro_batch_size": 1, "max_seq_length": 64},
                  resources={"num_workers": 4, "min_workers": 1, "host_memory_budget_bytes": int(budget / 0.9)})
    plans = {p.world_size: p for p in world_plans(tight, settings)}
    assert plans[2].fits and plans[2].problem is None
    assert plans[1].fits is False and plans[1].code == "insufficient_memory" and "on 1 workers the plan needs" in plans[1].problem
    assert world_plans(_spec(resources={"num_workers": 2}), settings) is None


def _request(spec: JobSpec, settings) -> RunRequest:
    return RunRequest(job_id="ftjob-1", spec=spec, training_path="/x", output_dir="/y",
                      world_sizes=world_plans(spec, settings))


def test_a_worker_group_on_fewer_workers_runs_the_replanned_split_and_says_so(settings):
    from workers.elastic import ElasticRefused, apply_world_size

    spec = _spec(hyperparameters={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "max_seq_length": 64},
                 resources={"num_workers": 2, "min_workers": 1})
    req = _request(spec, settings)
    same, events = apply_world_size(req, 2)
    assert same is req and events == []
    run, [event] = apply_world_size(req, 1)
    r = run.spec.resolved()
    assert (r.micro_batch_size, r.gradient_accumulation_steps, r.data_parallel_size, r.global_batch_size) == (2, 6, 1, 12)
    assert event["data"]["before"]["gradient_accumulation_steps"] == 3 and event["data"]["after"]["gradient_accumulation_steps"] == 6
    assert "global batch 12 kept" in event["message"]
    # a world size nobody planned (min_workers moved under a stored request) is refused, with its reason
    with pytest.raises(ElasticRefused) as exc:
        apply_world_size(req.model_copy(update={"world_sizes": []}), 1)
    assert exc.value.error["code"] == "elastic_world_size" and exc.value.error["param"] == "training.resources.min_workers"


def test_a_world_size_whose_plan_does_not_fit_fails_with_the_plan(settings):
    from workers.elastic import ElasticRefused, apply_world_size

    spec = _spec(hyperparameters={"micro_batch_size": 1, "max_seq_length": 64}, strategy="fsdp",
                 resources={"num_workers": 2, "min_workers": 1})
    req = _request(spec, settings)
    [one] = req.world_sizes
    squeezed = one.model_copy(update={"fits": False, "code": "insufficient_memory", "problem": "on 1 workers …"})
    with pytest.raises(ElasticRefused) as exc:
        apply_world_size(req.model_copy(update={"world_sizes": [squeezed]}), 1)
    assert exc.value.error["code"] == "insufficient_memory"
    assert exc.value.error["details"]["plan"]["fits"] is False


# --- on a real Ray head: asked for 2 workers, room for 1 ----------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_that_gets_one_of_two_workers_trains_with_double_accumulation_and_the_same_global_batch(
        new_database, ray_head, tmp_path_factory):
    """The session's head has 8 CPUs: at 4.5 CPUs a worker, Ray Train V2's elastic group
    (num_workers=(1, 2)) has room for one worker only and starts it; the job asked for 2 × micro-batch 2."""
    from tests.stack import Stack

    with new_database() as url:
        stack = Stack(url, tmp_path_factory.mktemp("elastic-storage"), ray_head)
        stack.start_scheduler()
        try:
            job_id = stack.create(hyperparameters={"max_steps": 4, "micro_batch_size": 2},
                                  resources={"num_workers": 2, "min_workers": 1, "cpus_per_worker": 4.5},
                                  checkpoint_every_steps=2)
            job = stack.wait(job_id, ("succeeded",), timeout=400)
            events = stack.events(job_id)
        finally:
            stack.close()
    [elastic] = [e for e in events if e["message"].startswith("Elastic: Ray Train started 1 of the 2 workers")]
    data = elastic["data"]
    assert data["before"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "data_parallel_size": 2,
                              "global_batch_size": 4}
    assert data["after"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "data_parallel_size": 1,
                             "global_batch_size": 4}
    assert data["plan"]["fits"] is True and data["world_size"] == 1
    ranks = {e["data"]["rank"] for e in events if e["type"] == "metrics"}
    assert ranks == {0}  # one worker trained
    steps = sorted(e["data"]["step"] for e in events if e["type"] == "metrics")
    assert steps == [1, 2, 3, 4] and job["fine_tuned_model"]
