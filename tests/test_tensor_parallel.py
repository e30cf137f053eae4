"""Tensor parallelism (workers/strategies/tensor.py) on gloo processes: the same update as a single
process over the same global batch (full fine-tune and LoRA, with checkpointing), bf16, resume from
the sharded checkpoint, and an export that from_pretrained loads with the trained model's logits;
and the planner's per-rank shard sizes. The HTTP and Ray path is tests/test_e2e.py -k tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"


# --- admission and the planner's shards (no torch) ------------------------------------------------


def _plan(training: dict, model: str = "preset:small-llama"):
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    spec = JobSpec.model_validate({"model": model, "training_file": "file-x", "training": training})
    return plan(spec, shape_for_model(resolve_model(spec.model, ())), None)


TP = {"strategy": "tensor", "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 4, "max_seq_length": 256}}


def test_a_model_whose_heads_the_ranks_cannot_share_is_refused_by_field():
    from service.domain.errors import SpecInvalid

    with pytest.raises(SpecInvalid) as exc:  # small-qwen2: 2 key/value heads over 4 ranks
        _plan({**TP, "resources": {"num_workers": 4}}, "preset:small-qwen2")
    assert exc.value.param == "training.tensor_parallel.size" and "num_key_value_heads (2)" in str(exc.value)
    with pytest.raises(SpecInvalid) as exc:
        _plan(TP, "preset:tiny-gpt2")
    assert exc.value.param == "training.tensor_parallel.size" and "gpt2" in str(exc.value)


# --- the worker on gloo processes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_local():
    pytest.importorskip("torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workers.local import run_local

    return run_local


@pytest.fixture(scope="module", autouse=True)
def _preset_cache(tmp_path_factory):
    os.environ.setdefault("MEMFIT_PRESET_CACHE", str(tmp_path_factory.mktemp("presets")))


def _args(out: Path, **kw):
    from workers.args import TrainArgs

    base = dict(job_id="ftjob-tp", output_dir=str(out), training_path=str(EXAMPLES / "chat.jsonl"),
                model="preset:tiny-llama", learning_rate=1e-2, warmup_steps=2, micro_batch_size=4, accumulation=2,
                max_steps=4, max_seq_length=64, checkpoint_every_steps=100, telemetry_every_steps=1,
                memory_trace_every_steps=1000)
    base.update(kw)
    return TrainArgs(**base)


def _tensor(out: Path, **kw):
    return _args(out, strategy="tensor", **kw)


def _losses(ranks: list[dict]) -> list[float]:
    return [r["loss"] for r in ranks[0]["reports"] if r.get("kind") == "metrics"]


@pytest.mark.parametrize("model", ["preset:tiny-llama", "preset:tiny-qwen2"])
def test_tensor_parallel_trains_exactly_as_one_process(tmp_path, run_local, model):
    """Two ranks, each with half the heads and MLP columns, give the single process's losses step for
    step (full fine-tune: every split weight, the replicated embeddings, norms and head, clipping)."""
    one = _losses(run_local(_args(tmp_path / "one", model=model), world_size=1))
    tp = _losses(run_local(_tensor(tmp_path / "tp", model=model), world_size=2))
    assert len(tp) == 4 and tp[-1] < tp[0]
    assert tp == pytest.approx(one, rel=1e-5)


def test_lora_with_checkpointing_matches_one_process_and_exports_an_adapter(tmp_path, run_local):
    kw = dict(peft_method="lora", gradient_checkpointing=True, learning_rate=5e-2,
              peft_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    one = _losses(run_local(_args(tmp_path / "one", **kw), world_size=1))
    ranks = run_local(_tensor(tmp_path / "tp", **kw), world_size=2)
    assert _losses(ranks) == pytest.approx(one, rel=1e-5)
    assert ranks[0]["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    assert (tmp_path / "tp" / "adapter" / "adapter_model.safetensors").is_file()
