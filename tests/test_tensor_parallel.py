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
