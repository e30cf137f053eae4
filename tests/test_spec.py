"""The job spec: defaults, bounds, unknown fields and cross-field rules, all reported together."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.spec import JobSpec, SpecError, validate_spec

BASE = {"model": "preset:tiny-llama", "training_file": "file-abc"}
EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.y*ml"))


def problems(body, known_gpus=None):
    with pytest.raises(SpecError) as exc:
        validate_spec(body, known_gpus)
    return [(p.param, p.code) for p in exc.value.problems]


def test_minimal_body_gets_defaults():
    spec = validate_spec(BASE)
    assert spec.training.strategy.value == "ddp" and spec.training.peft.method.value == "none"
    assert spec.method.type == "supervised" and spec.method.supervised.hyperparameters.n_epochs == "auto"
    r = spec.resolved()
    assert (r.n_epochs, r.micro_batch_size, r.gradient_accumulation_steps, r.global_batch_size) == (1, 4, 1, 4)


def test_openai_batch_size_sets_accumulation():
    body = {**BASE, "method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 16}}},
            "training": {"hyperparameters": {"micro_batch_size": 2}, "resources": {"num_workers": 2}}}
    r = validate_spec(body).resolved()
    assert (r.gradient_accumulation_steps, r.global_batch_size) == (4, 16)


def test_field_errors_together_each_named():
    got = problems({**BASE, "suffix": "bad suffix!", "training": {
        "hyperparameters": {"max_seq_length": 1}, "peft": {"r": 0}, "strategy": "tensor"}})
    assert got == [("suffix", "invalid_value"), ("training.hyperparameters.max_seq_length", "invalid_value"),
                   ("training.strategy", "invalid_value"), ("training.peft.r", "invalid_value")]


def test_unknown_fields_rejected_at_every_level():
    got = problems({**BASE, "status": "queued", "training": {"peft": {"rank": 8}},
                    "method": {"supervised": {"hyperparameters": {"epochs": 3}}}})
    assert sorted(got) == sorted([("status", "unknown_field"), ("training.peft.rank", "unknown_field"),
                                  ("method.supervised.hyperparameters.epochs", "unknown_field")])


@pytest.mark.parametrize(
    "training, param",
    [
        ({"deepspeed": {"offload_param": "cpu"}}, "training.deepspeed.offload_param"),
        ({"strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_param": "cpu"}}, "training.deepspeed.offload_param"),
        ({"precision": "fp16"}, "training.precision"),
        ({"peft": {"method": "qlora"}}, "training.peft.method"),
        ({"peft": {"method": "prefix_tuning", "merge": True}}, "training.peft.merge"),
        ({"strategy": "pipeline", "pipeline": {"stages": 4}, "resources": {"num_workers": 2}}, "training.pipeline.stages"),
        ({"fsdp": {"cpu_offload": True}}, "training.fsdp.cpu_offload"),
        ({"resources": {"gpu_type": "a100-40gb"}}, "training.resources.gpu_type"),
    ],
)
def test_cross_field_rules(training, param):
    assert (param, "invalid_value") in problems({**BASE, "training": training})


def test_several_cross_field_problems_at_once():
    got = problems({**BASE, "training": {"precision": "fp16", "peft": {"method": "qlora"}, "qat": {"enabled": True}}})
    assert {p for p, _ in got} == {"training.precision", "training.peft.method", "training.qat.enabled"}


def test_unknown_gpu_named():
    body = {**BASE, "training": {"resources": {"gpus_per_worker": 1, "gpu_type": "voodoo-5"}}}
    assert problems(body, known_gpus={"a100-40gb"}) == [("training.resources.gpu_type", "invalid_value")]
    assert validate_spec({**body, "training": {"resources": {"gpus_per_worker": 1, "gpu_type": "a100-40gb"}}},
                         known_gpus={"a100-40gb"})


def test_spec_round_trips_through_json():
    spec = validate_spec({**BASE, "training": {"strategy": "fsdp", "peft": {"method": "lora"}}})
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_specs_validate(path):
    import yaml

    body = yaml.safe_load(path.read_text())
    body = body.get("job", body) if isinstance(body, dict) else body
    validate_spec(body)
