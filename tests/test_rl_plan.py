"""Reinforcement fine-tuning's memory plan (service/memory/rl.py): the step is a supervised step of m × n rows at
prompt + completion tokens, the sampling phase holds the KV cache of those sequences, a frozen reference copy is
the base's weights once more, and a job that does not fit is offered the knobs RL users turn. Pure arithmetic."""

from __future__ import annotations

import pytest

from service.domain.spec import derive, validate_spec
from service.memory import planner, rl
from service.memory.serving import kv_bytes_per_token
from service.memory.shape import shape_from_config
from service.domain.presets import preset_config

GRADER = {"type": "string_check", "name": "g", "input": "{{sample.output_text}}", "reference": "{{item.a}}",
          "operation": "eq"}


def spec(**training):
    body = {"model": "preset:tiny-llama", "training_file": "file-x",
            "method": {"type": "reinforcement", "reinforcement": {"grader": GRADER}},
            "training": {"hyperparameters": {"max_seq_length": 256, "micro_batch_size": 2}, **training}}
    return derive(validate_spec(body)).spec


@pytest.fixture(scope="module")
def shape():
    return shape_from_config(preset_config("preset:tiny-llama"))


def test_the_step_is_a_supervised_step_of_m_times_n_rows_and_sampling_holds_their_kv_cache(shape):
    s = spec(rl={"samples_per_prompt": 4, "max_completion_tokens": 32})
    p = rl.plan(s, shape, seq_length=40)
    sft = planner.plan(rl.policy_spec(s), shape, seq_length=72, padded=True)
    assert rl.policy_spec(s).training.hyperparameters.micro_batch_size == 8
    assert p.per_rank.device.activations == sft.per_rank.device.activations
    terms = rl.sampler_bytes(s, shape, 40, 72)
    assert terms["kv_cache"] == kv_bytes_per_token(shape, "float32") * 72 * 8
    assert kv_bytes_per_token(shape, "float32") == 2 * 2 * 2 * 16 * 4  # 2 (k, v) × layers × kv heads × head dim × fp32
    sample = p.job_phases.phases["sample"]
    assert sample.host_bytes > 0 and "8 sequences" in sample.note
    assert any("KV cache" in a for a in p.assumptions)


def test_a_frozen_reference_copy_is_the_bases_weights_once_more(shape):
    none = rl.plan(spec(), shape)
    frozen = rl.plan(spec(rl={"kl_coef": 0.1}), shape)  # a full fine-tune: auto is frozen_copy
    lora = rl.plan(spec(rl={"kl_coef": 0.1}, peft={"method": "lora"}), shape)
    assert frozen.per_rank.device.parameters - none.per_rank.device.parameters == shape.parameter_count() * 4
    assert any("adapter disabled" in a for a in lora.assumptions)


def test_sampler_memory_fraction_samples_in_rounds():
    assert rl.rounds_for(8, 4, 1000, None, 0.1) == 1
    assert rl.rounds_for(8, 4, 1000, 100_000, 0.1) == 4  # 10 kB a round: 2 prompts × 4 samples × 1 kB
    assert rl.rounds_for(8, 4, 1000, 10**9, 0.5) == 1


def test_a_job_that_does_not_fit_is_offered_rl_knobs(shape):
    s = spec(rl={"samples_per_prompt": 64, "max_completion_tokens": 128, "kl_coef": 0.1},
             resources={"host_memory_budget_bytes": 700 * 2**20})
    p = rl.plan(s, shape)
    assert not p.fits
    changes = rl.suggestions(s, shape, None)
    assert {c.change for c in changes} >= {"rl.samples_per_prompt", "rl.max_completion_tokens", "rl.kl_coef"}
    assert changes[0].plan.need_bytes < p.need_bytes
