"""Reinforcement fine-tuning (method.type 'reinforcement') end to end: the official openai client creates a job in
OpenAI's shape — a string_check grader, OpenAI's RFT rows (examples/data/reinforcement.jsonl: a prompt and the
field the grader reads) — on the tiny-llama preset, over HTTP, on the session's stack (tests/conftest.py
shared_stack); the job succeeds, its mean reward rises over the run, the result CSV has the reward columns and the
memory page compares the sampling phase's plan with what each rank measured. Refusals before any training are
checked too (a row lacking the grader's field, 400 naming the line)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import openai
import pytest

from tests.factories import upload

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
GRADER = {"type": "string_check", "name": "says_a", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "ilike"}
STEPS = 12
pytestmark = pytest.mark.ray  # the session's stack: one xdist worker with the Ray head (tests/conftest.py)


def rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "reinforcement.jsonl").read_text().splitlines() if line.strip()]


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=f"http://127.0.0.1:{stack.port}/v1", max_retries=0, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reinforcement_job_over_the_openai_client_raises_its_mean_reward(shared_stack):
    from openai.types.fine_tuning import FineTuningJob

    from tests.test_openai_client import assert_conforms

    stack = shared_stack
    oai = client(stack)
    train = upload(stack.http, stack.key, rows(), name="reinforcement.jsonl")
    created = oai.fine_tuning.jobs.with_raw_response.create(
        model="preset:tiny-llama", training_file=train, suffix="rft", seed=3,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
            "batch_size": 4, "n_epochs": 3, "compute_multiplier": 1}}},
        # memfit's knobs: a short run a tiny model learns in, on this loaded machine
        extra_body={"training": {
            "hyperparameters": {"max_steps": STEPS, "micro_batch_size": 4, "max_seq_length": 128,
                                "learning_rate": 0.01},
            "peft": {"method": "lora", "r": 8}, "checkpoint_every_steps": STEPS, "memory_trace_every_steps": 1000,
            "rl": {"samples_per_prompt": 4, "max_completion_tokens": 3}}}).http_response.json()
    assert_conforms(FineTuningJob, created, "create")
    assert created["method"]["type"] == "reinforcement"
    assert created["method"]["reinforcement"]["grader"] == GRADER
    assert created["method"]["reinforcement"]["hyperparameters"]["compute_multiplier"] == 1.0
    job = stack.wait(created["id"], ("succeeded",), timeout=480)
    assert_conforms(FineTuningJob, job, "succeeded")
    assert job["fine_tuned_model"] == f"ft:preset:tiny-llama:rft:{created['id']}"

    events = stack.events(created["id"])
    steps = {e["data"]["step"]: e["data"] for e in events if e["type"] == "metrics" and e["data"]["rank"] == 0}
    assert sorted(steps) == list(range(1, STEPS + 1))
    reward = [steps[s]["train_reward_mean"] for s in sorted(steps)]
    assert all(steps[s][f"train_reward_mean/{GRADER['name']}"] == steps[s]["train_reward_mean"] for s in steps)
    assert all(0 < steps[s]["train_sample_tokens_mean"] <= 3 and steps[s]["train_grader_error_rate"] == 0
               for s in steps)
    # robustly: the last third's mean reward well above the first third's (4 steps of 16 samples each; here
    # 0.45 → 0.77 with seed 3)
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    print(f"mean reward by step: {[round(r, 3) for r in reward]}; first 4 {first:.3f}, last 4 {last:.3f}")
    assert last > first + 0.15, reward

    result = oai.files.content(job["result_files"][0]).text
    table = list(csv.DictReader(io.StringIO(result)))
    assert [float(r["train_reward_mean"]) for r in table] == pytest.approx(reward)
    assert f"train_reward_mean/{GRADER['name']}" in table[0]

    # the memory page: the sampling phase planned (its KV cache) and measured on the rank
    memory = stack.http.get(f"/v1/fine_tuning/jobs/{created['id']}/memory", headers=stack.auth).json()
    phases = memory["phases"]
    assert "sample" in phases["phases"]
    planned, measured = phases["planned"]["sample"]["host_bytes"], phases["measured"]["0"]["sample"]["host_bytes"]
    step_planned, step_measured = phases["planned"]["step"]["host_bytes"], phases["measured"]["0"]["step"]["host_bytes"]
    print(f"sample phase host: planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB "
          f"({(measured - planned) / planned:+.1%}); step: planned {step_planned / 2**20:.1f} MiB, measured "
          f"{step_measured / 2**20:.1f} MiB ({(step_measured - step_planned) / step_planned:+.1%})")
    # On the tiny preset the process runtime dominates both phases (the KV cache is under 1 MiB): the sampling
    # phase is held to being planned as closely as the supervised step is, on the same rank.
    sample_error, step_error = (measured - planned) / planned, (step_measured - step_planned) / step_planned
    assert abs(sample_error - step_error) < 0.05, (sample_error, step_error)


def test_reinforcement_rows_must_hold_the_graders_fields(shared_stack):
    stack = shared_stack
    oai = client(stack)
    bad = rows()[:3] + [{"messages": [{"role": "user", "content": "hi"}]}]
    train = upload(stack.http, stack.key, bad, name="rft-bad.jsonl")
    with pytest.raises(openai.BadRequestError) as exc:
        oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=train, method={
            "type": "reinforcement", "reinforcement": {"grader": GRADER}})
    assert exc.value.param == "training_file"
    assert "line 4: the grader reads {{item.answer}}, which this example lacks" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:  # chat rows are not prompts to sample from
        oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=stack.train_file, method={
            "type": "reinforcement", "reinforcement": {"grader": GRADER}})
    assert exc.value.param == "training_file" and "trains on prompt rows" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        oai.fine_tuning.jobs.create(model="preset:tiny-llama", training_file=train, method={
            "type": "reinforcement", "reinforcement": {"grader": {**GRADER, "operation": "regex"}}})
    assert exc.value.param.startswith("method.reinforcement.grader")
