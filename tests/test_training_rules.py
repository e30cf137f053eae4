"""The training rules have one home (service/domain/training.py): for every strategy × PEFT method ×
precision the spec accepts, the regime the planner predicts from is the very object the workers
build from, and the workers take the dtypes they set from it (not from a copy of their own)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from service.domain import training
from service.domain.model_ref import resolve_model
from service.domain.spec import (
    PeftMethod,
    Precision,
    RunRequest,
    SpecError,
    StrategyName,
    validate_spec,
)
from service.memory import job as planned_job
from service.memory import planner
from service.memory.shape import shape_for_model

MODEL = "preset:tiny-llama"


def body(strategy: str, peft: str, precision: str) -> dict:
    on_gpu = precision == "fp16"  # the spec refuses it on CPU workers
    workers = 2 if strategy in ("pipeline", "tensor") else 1
    resources = {"num_workers": workers, **({"gpus_per_worker": 1} if on_gpu else {})}
    t = {"strategy": strategy, "precision": precision, "peft": {"method": peft}, "resources": resources}
    if strategy == "pipeline":
        t["pipeline"] = {"stages": workers}
    return {"model": MODEL, "training_file": "file-1", "training": t}


def accepted():
    for st, pm, pr in itertools.product(StrategyName, PeftMethod, Precision):
        try:
            validate_spec(body(st.value, pm.value, pr.value))
        except SpecError:
            continue
        yield st.value, pm.value, pr.value


CASES = list(accepted())


def test_the_matrix_covers_every_strategy_method_and_precision():
    assert {c[0] for c in CASES} == {s.value for s in StrategyName}
    assert {c[1] for c in CASES} == {m.value for m in PeftMethod}
    assert {c[2] for c in CASES} == {p.value for p in Precision}
    assert ("deepspeed", "qlora", "bf16") not in CASES  # refused by the spec, so not asked
    assert ("fsdp", "qlora", "bf16") in CASES and ("ddp", "qlora", "fp32") in CASES


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_planner_and_worker_use_the_same_regime_object(case, monkeypatch):
    pytest.importorskip("torch")
    from workers.args import train_args
    from workers.strategies import common

    strategy, peft, precision = case
    spec = validate_spec(body(*case))
    calls: list[tuple[tuple, training.Regime]] = []

    def spy(*args):
        rg = training.regime(*args)
        calls.append((args, rg))
        return rg

    monkeypatch.setattr(planned_job, "regime", spy)  # where the planner reads a job's regime (service/memory/job.py)
    monkeypatch.setattr(common, "regime", spy)
    p = planner.plan(spec, shape_for_model(resolve_model(MODEL, ())))
    req = RunRequest(job_id="ftjob-1", spec=spec, training_path="/t.jsonl", output_dir="/out")
    worker_rg = common.training_regime(train_args(req))
    (planner_args, planner_rg), (worker_args, _) = calls
    assert planner_args == worker_args == (strategy, peft, precision)
    assert worker_rg is planner_rg is training.regime(strategy, peft, precision)
    assert f"activations: {planner_rg.name} regime" in " ".join(p.assumptions)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "pipeline"], ids="-".join)
def test_worker_configs_follow_the_regime(case):
    """What each strategy hands torch/DeepSpeed is read off the regime: autocast under DDP, the
    MixedPrecisionPolicy under FSDP2, the 16-bit mode and buckets under DeepSpeed."""
    torch = pytest.importorskip("torch")
    from workers.strategies.common import autocast_dtype
    from workers.strategies.deepspeed import deepspeed_config
    from workers.strategies.fsdp import mixed_precision_policy

    strategy, peft, precision = case
    rg = training.regime(strategy, peft, precision)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if strategy == "ddp":
        assert autocast_dtype(rg) == half  # fp32 weights, per-op casts (None: no autocast in fp32)
    if strategy == "fsdp":
        mp = mixed_precision_policy(rg)
        assert mp.param_dtype == half
        assert mp.reduce_dtype == (torch.float32 if half else None)
    if strategy == "deepspeed":
        hidden = 64
        cfg = deepspeed_config(stage=3, micro_batch_size=1, accumulation=1, world_size=2, lr=1e-3, weight_decay=0.0,
                               max_grad_norm=1.0, regime=rg, offload_optimizer="none", offload_param="none",
                               buckets=training.deepspeed_buckets(hidden), on_cpu=True)
        assert cfg["bf16"]["enabled"] == (precision == "bf16") and cfg["fp16"]["enabled"] == (precision == "fp16")
        zero = cfg["zero_optimization"]
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == hidden * hidden
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
        assert zero["stage3_param_persistence_threshold"] == 10 * hidden
        assert zero["stage3_max_reuse_distance"] == training.DEEPSPEED_MAX_REUSE_DISTANCE


def _tiny_args(tmp_path, **kw):
    from workers.args import TrainArgs

    return TrainArgs(job_id="ftjob-rules", output_dir=str(tmp_path), training_path="unused", model=MODEL, **kw)


@pytest.mark.parametrize("strategy, peft, precision", [
    ("ddp", "lora", "bf16"), ("ddp", "lora", "fp32"), ("ddp", "ia3", "bf16"), ("fsdp", "lora", "bf16"),
    ("deepspeed", "lora", "bf16"),
])
def test_build_model_holds_the_frozen_base_as_the_regime_says(tmp_path, strategy, peft, precision):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from workers.models import resolve_model_dir
    from workers.strategies import build_model

    args = _tiny_args(tmp_path, strategy=strategy, peft_method=peft, precision=precision)
    rg = training.regime(strategy, peft, precision)
    model = build_model(args, str(resolve_model_dir(MODEL)))
    # the frozen base as build_model reads it: in the regime's 16-bit dtype where it holds it so (LoRA + bf16
    # under DDP or a pipeline, any PEFT base under FSDP2, DeepSpeed's 16-bit mode), else fp32
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {getattr(torch, rg.frozen_dtype)}
    assert trained == {torch.float32}
    assert rg.cast_frozen_base == ((strategy, peft, precision) in {("ddp", "lora", "bf16"), ("fsdp", "lora", "bf16")})
    assert training.regime("pipeline", "lora", "bf16").frozen_dtype == "bfloat16"


def test_build_model_takes_the_dtype_from_the_domain_regime(tmp_path, monkeypatch):
    """A worker with its own copy of the rule would ignore a changed regime; this one follows it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from workers.models import resolve_model_dir
    from workers.strategies import build_model, common

    real = training.regime
    monkeypatch.setattr(common, "regime", lambda *a: dataclasses.replace(real(*a), frozen_dtype="float16",
                                                                        cast_frozen_base=True))
    model = build_model(_tiny_args(tmp_path, peft_method="lora", precision="fp32"), str(resolve_model_dir(MODEL)))
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}


def test_planner_counts_the_regime_it_is_given(monkeypatch):
    """The planner's parameter bytes come from the regime's dtypes, not from a rule of its own."""
    spec = validate_spec(body("ddp", "lora", "fp32"))
    shape = shape_for_model(resolve_model(MODEL, ()))
    fp32 = planner.plan(spec, shape)
    real = training.regime
    monkeypatch.setattr(planned_job, "regime", lambda *a: dataclasses.replace(real(*a), frozen_dtype="bfloat16",
                                                                             cast_frozen_base=True))
    halved = planner.plan(spec, shape)
    frozen = fp32.parameter_count - fp32.trainable_parameter_count
    assert fp32.model_states.device.parameters - halved.model_states.device.parameters == 2 * frozen


def test_mergeable_methods_are_the_spec_s_and_the_workers():
    pytest.importorskip("torch")
    from workers.args import TrainArgs

    for method in PeftMethod:
        args = TrainArgs(job_id="j", output_dir="/o", training_path="/t", model=MODEL, peft_method=method.value)
        assert args.merges_adapter == (method.value in training.MERGEABLE_PEFT)
    assert training.MERGEABLE_PEFT == {"lora", "qlora", "ia3", "loha", "lokr"}
    # the spec refuses an explicit merge exactly for the methods that cannot merge
    for method in PeftMethod:
        if method == PeftMethod.none:
            continue
        b = body("ddp", method.value, "fp32")
        b["training"]["peft"]["merge"] = True
        if method.value in training.MERGEABLE_PEFT:
            validate_spec(b)
        else:
            with pytest.raises(SpecError):
                validate_spec(b)
