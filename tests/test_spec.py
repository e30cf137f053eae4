"""The job spec: defaults, bounds, unknown fields and cross-field rules, all reported together."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.domain.spec import JobSpec, SpecError, auto_epochs, derive, validate_spec

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
    r = spec.resolved()  # n_epochs 'auto' for a file of unknown size: OpenAI's target of 3
    assert (r.n_epochs, r.micro_batch_size, r.gradient_accumulation_steps, r.global_batch_size) == (3, 4, 1, 4)


def test_openai_batch_size_sets_accumulation():
    body = {**BASE, "method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 16}}},
            "training": {"hyperparameters": {"micro_batch_size": 2}, "resources": {"num_workers": 2}}}
    r = validate_spec(body).resolved()
    assert (r.gradient_accumulation_steps, r.global_batch_size) == (4, 16)


def test_field_errors_together_each_named():
    got = problems({**BASE, "suffix": "bad suffix!", "training": {
        "hyperparameters": {"max_seq_length": 1}, "peft": {"r": 0}, "strategy": "megatron"}})
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
        ({"strategy": "fsdp", "fsdp": {"cpu_offload": True}, "peft": {"method": "qlora"}}, "training.fsdp.cpu_offload"),
        ({"strategy": "deepspeed", "peft": {"method": "qlora"}}, "training.peft.method"),
        ({"strategy": "pipeline", "peft": {"method": "qlora"}, "resources": {"num_workers": 2}}, "training.peft.method"),
        ({"peft": {"method": "prefix_tuning", "merge": True}}, "training.peft.merge"),
        # peft raises "PREFIX_TUNING does not work with gradient checkpointing" in the worker: a 422 at admission
        ({"peft": {"method": "prefix_tuning"}, "gradient_checkpointing": True}, "training.gradient_checkpointing"),
        ({"strategy": "pipeline", "pipeline": {"stages": 4}, "resources": {"num_workers": 2}}, "training.pipeline.stages"),
        ({"fsdp": {"cpu_offload": True}}, "training.fsdp.cpu_offload"),
        ({"strategy": "tensor"}, "training.tensor_parallel.size"),  # one worker: nothing to split over
        ({"strategy": "tensor", "tensor_parallel": {"size": 4}, "resources": {"num_workers": 6}},
         "training.tensor_parallel.size"),
        ({"tensor_parallel": {"size": 2}, "resources": {"num_workers": 2}}, "training.tensor_parallel.size"),
        ({"strategy": "tensor", "resources": {"num_workers": 2}, "peft": {"method": "prompt_tuning", "merge": False}},
         "training.peft.method"),
        ({"strategy": "tensor", "resources": {"num_workers": 2}, "loss_chunk_tokens": 512}, "training.loss_chunk_tokens"),
        ({"strategy": "tensor", "resources": {"num_workers": 2, "gpus_per_worker": 1}, "activation_offload": True},
         "training.activation_offload"),
        ({"strategy": "tensor", "resources": {"num_workers": 2, "gpus_per_worker": 1}, "precision": "fp16"},
         "training.precision"),
        ({"resources": {"gpu_type": "a100-40gb"}}, "training.resources.gpu_type"),
    ],
)
def test_cross_field_rules(training, param):
    assert (param, "invalid_value") in problems({**BASE, "training": training})


def test_tensor_parallel_defaults_to_every_worker_and_leaves_the_rest_data_parallel():
    two = validate_spec({**BASE, "training": {"strategy": "tensor", "resources": {"num_workers": 2},
                                              "peft": {"method": "lora"}}})
    assert two.resolved().data_parallel_size == 1
    four = validate_spec({**BASE, "training": {"strategy": "tensor", "tensor_parallel": {"size": 2},
                                               "resources": {"num_workers": 4}}})
    assert four.resolved().data_parallel_size == 2


def test_several_cross_field_problems_at_once():
    got = problems({**BASE, "training": {"precision": "fp16", "strategy": "deepspeed", "peft": {"method": "qlora"},
                                         "qat": {"enabled": True}}})
    assert {p for p, _ in got} == {"training.precision", "training.peft.method", "training.qat.enabled"}


def test_qlora_runs_on_cpu_workers_under_ddp():
    """bitsandbytes has a CPU backend: QLoRA is no longer refused on CPU workers, in fp32 or bf16, on 1 or 2 ranks,
    under DDP or FSDP2."""
    for strategy, precision, workers in (("ddp", "fp32", 1), ("ddp", "bf16", 2), ("fsdp", "bf16", 2)):
        spec = validate_spec({**BASE, "training": {"peft": {"method": "qlora"}, "precision": precision, "strategy": strategy,
                                                   "resources": {"num_workers": workers}}})
        assert spec.training.peft.method.value == "qlora" and spec.training.resources.gpus_per_worker == 0


def test_qlora_refusals_say_why():
    for strategy, why in (("deepspeed", "ZeRO"), ("pipeline", "stages")):
        spec = {**BASE, "training": {"strategy": strategy, "peft": {"method": "qlora"}, "resources": {"num_workers": 2}}}
        with pytest.raises(SpecError) as e:
            validate_spec(spec)
        [problem] = [p for p in e.value.problems if p.param == "training.peft.method"]
        assert why in problem.message and "use " in problem.message


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


# --- OpenAI's hyperparameters → memfit's (derive, split_batch, auto_epochs) -------------------


def openai_hp(**hp):
    return {"method": {"type": "supervised", "supervised": {"hyperparameters": hp}}}


@pytest.mark.parametrize(
    "batch_size, workers, micro, accumulation",
    [(1, None, 1, 1), (2, None, 2, 1), (3, None, 3, 1), (6, None, 3, 2), (64, None, 4, 16),
     (2, 2, 1, 1), (64, 2, 4, 8), (65536, None, 16, 4096)],
)
def test_batch_size_alone_is_split_into_micro_batch_and_accumulation(batch_size, workers, micro, accumulation):
    body = {**BASE, **openai_hp(batch_size=batch_size)}
    if workers:
        body["training"] = {"resources": {"num_workers": workers}}
    spec = validate_spec(body)
    derived = derive(spec, training_examples=40, seed=9)
    stored = JobSpec.model_validate(derived.spec.model_dump(mode="json"))  # what the store hands back
    hp = stored.training.hyperparameters
    assert (hp.micro_batch_size, hp.gradient_accumulation_steps) == (micro, accumulation)
    assert stored.method.supervised.hyperparameters.batch_size == batch_size
    dp = workers or 1
    r = stored.resolved()
    assert (r.micro_batch_size, r.gradient_accumulation_steps, r.data_parallel_size, r.global_batch_size) == (
        micro, accumulation, dp, batch_size)
    # resolved() of the body before derivation already says the same: one rule, read twice.
    assert spec.resolved().model_copy(update={"n_epochs": r.n_epochs, "seed": r.seed}) == r
    [event] = [d for d in derived.derivations if d.data.get("derived") == "batch_size"]
    worker_word = "worker" if dp == 1 else "workers"
    assert event.message == (f"batch_size {batch_size} → micro_batch_size {micro} × gradient_accumulation_steps "
                             f"{accumulation} × {dp} {worker_word}")
    assert event.data == {"derived": "batch_size", "batch_size": batch_size, "global_batch_size": batch_size,
                          "micro_batch_size": micro, "gradient_accumulation_steps": accumulation,
                          "data_parallel_workers": dp}
    # Deriving the stored spec again changes nothing: it is explicit.
    assert derive(stored).spec == stored


def test_derive_fills_epochs_learning_rate_and_seed_and_moves_deprecated_hyperparameters():
    body = {**BASE, "hyperparameters": {"batch_size": 8, "learning_rate_multiplier": 0.5},
            "training": {"hyperparameters": {"learning_rate": 1e-3}}}
    derived = derive(validate_spec(body), training_examples=10, seed=1234)
    s = derived.spec
    assert s.hyperparameters is None
    assert s.method.supervised.hyperparameters.model_dump() == {
        "n_epochs": 10, "batch_size": 8, "learning_rate_multiplier": 0.5}
    assert s.seed == 1234
    r = s.resolved()
    assert (r.n_epochs, r.learning_rate, r.learning_rate_multiplier, r.global_batch_size) == (10, 5e-4, 0.5, 8)
    assert {d.data["derived"]: d.message for d in derived.derivations} == {
        "method": "hyperparameters (deprecated by OpenAI) read as method.supervised.hyperparameters",
        "batch_size": "batch_size 8 → micro_batch_size 4 × gradient_accumulation_steps 2 × 1 worker",
        "learning_rate": "learning_rate_multiplier 0.5 → learning_rate 0.0005 = training.hyperparameters.learning_rate "
                         "0.001 × 0.5",
        "n_epochs": "n_epochs auto → 10 for 10 training examples (OpenAI's rule: 3 epochs, raised to see 100 examples "
                    "or lowered to 25,000, within 1–25)",
        "seed": "seed not given → 1234",
    }
    # A seed the caller gave is kept, and nothing is said about it.
    kept = derive(validate_spec({**BASE, "seed": 7}), seed=99)
    assert kept.spec.seed == 7 and "seed" not in {d.data.get("derived") for d in kept.derivations}


@pytest.mark.parametrize("examples, epochs", [(1, 25), (2, 25), (10, 10), (33, 3), (34, 3), (5000, 3),
                                              (9000, 2), (20000, 1), (100000, 1), (None, 3)])
def test_auto_epochs_is_openais_rule(examples, epochs):
    assert auto_epochs(examples) == epochs


def test_batch_size_auto_is_what_training_makes_and_stays_auto():
    body = {**BASE, "training": {"hyperparameters": {"micro_batch_size": 2, "gradient_accumulation_steps": 3},
                                 "resources": {"num_workers": 2}}}
    derived = derive(validate_spec(body), training_examples=100)
    assert derived.spec.method.supervised.hyperparameters.batch_size == "auto"  # the pre-flight may still change it
    assert derived.spec.resolved().global_batch_size == 12
    [event] = [d for d in derived.derivations if d.data.get("derived") == "batch_size"]
    assert event.message == "batch_size auto → 12 = micro_batch_size 2 × gradient_accumulation_steps 3 × 2 workers"


def test_integrations_are_kept_and_run():
    """W&B (OpenAI's) and MLflow (memfit's) integrations are kept as given and run with the job
    (workers/integrations.py): nothing to warn about at creation; each names its own object."""
    wandb = {"project": "p", "entity": "team", "name": "run", "tags": ["a"]}
    mlflow = {"tracking_uri": "https://mlflow.example", "experiment": "e", "run_name": None}
    derived = derive(validate_spec({**BASE, "integrations": [{"type": "wandb", "wandb": wandb},
                                                             {"type": "mlflow", "mlflow": mlflow}]}))
    assert [i.model_dump(exclude_none=True) for i in derived.spec.integrations] == [
        {"type": "wandb", "wandb": wandb}, {"type": "mlflow", "mlflow": {k: v for k, v in mlflow.items() if v}}]
    assert [d for d in derived.derivations if d.level == "warn"] == []
    assert problems({**BASE, "integrations": [{"type": "slack"}]}) == [("integrations.0.type", "invalid_value")]
    assert problems({**BASE, "integrations": [{"type": "mlflow", "wandb": wandb}]}) == [("integrations.0", "invalid_value")]
    # a path on the server's disk is not a tracking URI a tenant may name
    assert problems({**BASE, "integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "file:///etc"}}]}) == [
        ("integrations.0.mlflow.tracking_uri", "invalid_value")]


MICRO_4 = {"training": {"hyperparameters": {"micro_batch_size": 4}}}


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({**openai_hp(batch_size=6), **MICRO_4}, "method.supervised.hyperparameters.batch_size",
         "batch_size 6 is not a multiple of training.hyperparameters.micro_batch_size 4 × 1 data-parallel worker = 4"),
        ({"hyperparameters": {"batch_size": 6}, **MICRO_4}, "hyperparameters.batch_size",
         "batch_size 6 is not a multiple of training.hyperparameters.micro_batch_size 4 × 1 data-parallel worker = 4"),
        ({**openai_hp(batch_size=8), "training": {"hyperparameters": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}}},
         "method.supervised.hyperparameters.batch_size",
         "batch_size 8 is not training.hyperparameters.micro_batch_size 2 × gradient_accumulation_steps 3 × "
         "1 data-parallel worker = 6"),
        ({**openai_hp(batch_size=6), "training": {"hyperparameters": {"gradient_accumulation_steps": 4}}},
         "method.supervised.hyperparameters.batch_size",
         "batch_size 6 is not a multiple of training.hyperparameters.gradient_accumulation_steps 4 × "
         "1 data-parallel worker = 4"),
        ({**openai_hp(batch_size=3), "training": {"resources": {"num_workers": 2}}},
         "method.supervised.hyperparameters.batch_size",
         "batch_size 3 cannot be shared evenly by training.resources.num_workers = 2 data-parallel workers; "
         "use a multiple of 2"),
    ],
    ids=["micro", "deprecated-top-level", "micro-and-accumulation", "accumulation", "workers"],
)
def test_only_what_the_caller_set_can_conflict(body, param, message):
    with pytest.raises(SpecError) as exc:
        validate_spec({**BASE, **body})
    assert [(p.param, p.code, p.message) for p in exc.value.problems] == [(param, "invalid_value", message)]


def test_reinforcement_needs_its_grader_and_dpo_is_a_method():
    body = {**BASE, "method": {"type": "reinforcement", "reinforcement": {"hyperparameters": {"n_epochs": 2}}}}
    with pytest.raises(SpecError) as exc:
        validate_spec(body)
    assert [(p.param, p.code, p.message) for p in exc.value.problems] == [
        ("method.reinforcement.grader", "invalid_value", "Field required")]
    assert problems({**BASE, "method": {"type": "supervised", "dpo": {}}}) == [("method.dpo", "invalid_value")]
    dpo = validate_spec({**BASE, "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.5, "n_epochs": 2}}},
                         "training": {"peft": {"method": "lora"}}})
    assert dpo.openai_hyperparameters.beta == 0.5 and dpo.resolved().n_epochs == 2
    assert problems({**BASE, "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 3}}}}) == [
        ("method.dpo.hyperparameters.beta", "invalid_value")]
    # what DPO is not built with names its field
    assert problems({**BASE, "method": {"type": "dpo"}, "training": {"strategy": "pipeline", "resources": {
        "num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}}}) == [("training.strategy", "invalid_value")]
    assert problems({**BASE, "method": {"type": "dpo"}, "training": {"dpo_reference": "adapter_disabled"}}) == [
        ("training.dpo_reference", "invalid_value")]
    assert problems({**BASE, "method": {"type": "dpo"}, "training": {"hyperparameters": {"packing": True}}}) == [
        ("training.hyperparameters.packing", "invalid_value")]


def test_interleaved_1f1b_options_are_checked_by_field():
    pp = {"strategy": "pipeline", "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 5}}
    ok = validate_spec({**BASE, "training": {**pp, "hyperparameters": {"micro_batch_size": 4},
                                             "pipeline": {"stages": 2, "schedule": "interleaved_1f1b"}}})
    assert ok.training.pipeline.virtual_stages is None  # 2 model stages per rank (service/domain/training.py)
    # 5 chunks over 2 ranks: 2 rounds of 2 leave one over (ScheduleInterleaved1F1B refuses it)
    assert problems({**BASE, "training": {**pp, "pipeline": {"stages": 2, "schedule": "interleaved_1f1b"}}}) == [
        ("training.pipeline.microbatches", "invalid_value")]
    assert problems({**BASE, "training": {**pp, "hyperparameters": {"micro_batch_size": 4},
                                          "pipeline": {"stages": 2, "virtual_stages": 2}}}) == [
        ("training.pipeline.virtual_stages", "invalid_value")]
    assert problems({**BASE, "training": {**pp, "pipeline": {"stages": 2, "schedule": "interleaved_1f1b",
                                                             "virtual_stages": 1}}})[0] == (
        "training.pipeline.virtual_stages", "invalid_value")


def test_the_tensor_strategy_refuses_an_elastic_range_naming_the_field():
    from service.domain.spec import SpecError, validate_spec

    body = {"model": "preset:tiny-llama", "training_file": "file-1",
            "training": {"strategy": "tensor", "resources": {"num_workers": 4, "min_workers": 2}}}
    with pytest.raises(SpecError) as exc:
        validate_spec(body)
    assert [p.param for p in exc.value.problems] == ["training.resources.min_workers"]
    body["training"]["resources"]["min_workers"] = 4
    validate_spec(body)


RFT_GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}


def test_reinforcement_spec_in_openais_shape_is_derived_explicitly():
    from service.domain.spec import derive, rl_reference_mode

    body = {**BASE, "method": {"type": "reinforcement", "reinforcement": {
        "grader": RFT_GRADER, "hyperparameters": {"n_epochs": 2, "batch_size": 4, "compute_multiplier": 2,
                                                  "eval_interval": 3}}},
        "training": {"peft": {"method": "lora"}, "rl": {"kl_coef": 0.05}}}
    spec = derive(validate_spec(body), training_examples=8).spec
    rl = spec.method.reinforcement
    assert rl.grader.operation == "eq" and spec.training.rl.samples_per_prompt == 8
    assert spec.training.eval_every_steps == 3 and rl.hyperparameters.eval_samples == 1
    assert rl_reference_mode(spec.training) == "adapter_disabled"
    assert spec.resolved().global_batch_size == 4


@pytest.mark.parametrize("extra, param", [
    ({"training": {"strategy": "fsdp"}}, "training.strategy"),
    ({"training": {"rl": {"kl_coef": 0.1, "reference": "adapter_disabled"}}}, "training.rl.reference"),
    ({"training": {"rl": {"max_completion_tokens": 600}}}, "training.rl.max_completion_tokens"),
    ({"training": {"hyperparameters": {"packing": True}}}, "training.hyperparameters.packing"),
    ({"hyperparameters_rl": {"reasoning_effort": "high"}}, "method.reinforcement.hyperparameters.reasoning_effort"),
    ({"grader": {**RFT_GRADER, "type": "text_similarity", "evaluation_metric": "cosine", "operation": None}},
     "method.reinforcement.grader"),
])
def test_reinforcement_refusals_name_their_field(extra, param):
    reinforcement = {"grader": extra.pop("grader", RFT_GRADER), "hyperparameters": extra.pop("hyperparameters_rl", {})}
    body = {**BASE, "method": {"type": "reinforcement", "reinforcement": reinforcement}, **extra}
    with pytest.raises(SpecError) as exc:
        validate_spec(body)
    assert any(p.param.startswith(param) for p in exc.value.problems), exc.value.problems
