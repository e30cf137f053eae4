"""The planner's trainable tensors for every PEFT method equal what peft itself builds, on every family
the planner reads: each method is applied to the real Hugging Face model on the meta device and its
``get_nb_trainable_parameters()`` and trainable tensor sizes (in ``parameters()`` order, as the optimizer
and ZeRO see them) are compared with the planner's, from config.json alone."""

from __future__ import annotations

import pytest

from service.domain.presets import PRESETS
from service.domain.spec import JobSpec
from service.domain.training import PEFT_UNSUPPORTED
from service.memory.planner import _lora_targets, _trainable_numels, plan, trainable_parameters
from service.memory.shape import lokr_factorization, shape_from_config
from tests.test_modelshape import FAMILY_CONFIGS, _meta_model

peft = pytest.importorskip("peft")

METHODS = ["lora", "qlora", "ia3", "loha", "lokr", "prefix_tuning", "prompt_tuning"]
CONFIGS = {**FAMILY_CONFIGS, **{"preset:" + k: v for k, v in PRESETS.items()}}


def _spec(method: str, r: int = 8, targets: list[str] | str = "auto", tokens: int = 16) -> JobSpec:
    return JobSpec.model_validate({"model": "preset:small-llama", "training_file": "file-x", "training": {
        "peft": {"method": method, "r": r, "target_modules": targets, "num_virtual_tokens": tokens}}})


def _peft_model(cfg: dict, method: str, r: int, targets, tokens: int):
    from workers.peft_setup import peft_config

    shape = shape_from_config(cfg)
    model = _meta_model(cfg)
    # qlora is LoRA on a 4-bit base: the same adapter tensors (the base's quantisation is not counted).
    m = "lora" if method == "qlora" else method
    return peft.get_peft_model(model, peft_config(m, shape.family, r=r, alpha=16, dropout=0.0, targets=targets,
                                                  num_virtual_tokens=tokens))


def _clean(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "architectures"}


# Every (config, method) peft can build; the ones it cannot are test_refused_where_peft_cannot's.
APPLICABLE = [(name, method) for name in sorted(CONFIGS) for method in METHODS
              if method not in PEFT_UNSUPPORTED.get(shape_from_config(_clean(CONFIGS[name])).family, ())]


@pytest.mark.parametrize("name,method", APPLICABLE)
def test_trainable_tensors_match_peft(name, method):
    cfg = _clean(CONFIGS[name])
    shape = shape_from_config(cfg)
    spec = _spec(method)
    model = _peft_model(cfg, method, 8, "auto", 16)
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable_parameters(spec, shape) == trainable
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if method in ("prefix_tuning", "prompt_tuning"):  # peft keeps the prompt table outside the base model
        sizes = [p.numel() for p in model.prompt_encoder.parameters()]
    assert _trainable_numels(spec, shape, _lora_targets(spec, shape)) == sizes


# Ranks on both sides of LoKr's whole-or-decomposed w2 threshold (r < max(out_k, in_n) / 2), explicit
# targets (MLP included), and other token counts.
@pytest.mark.parametrize("name,method,r,targets,tokens", [
    ("llama", "lokr", 2, "auto", 16),
    ("llama", "lokr", 64, ["q_proj", "down_proj", "up_proj"], 16),
    ("mistral", "lokr", 9, ["gate_proj", "o_proj"], 16),
    ("llama", "loha", 4, ["gate_proj", "up_proj", "down_proj"], 16),
    ("qwen3", "ia3", 8, ["k_proj", "v_proj", "down_proj"], 16),
    ("gemma", "prefix_tuning", 8, "auto", 5),
    ("gpt2", "prefix_tuning", 8, "auto", 30),
    ("preset:small-gemma", "prompt_tuning", 8, "auto", 7),
])
def test_other_ranks_targets_and_tokens(name, method, r, targets, tokens):
    cfg = _clean(CONFIGS[name])
    shape = shape_from_config(cfg)
    spec = _spec(method, r, targets, tokens)
    trainable, _ = _peft_model(cfg, method, r, targets, tokens).get_nb_trainable_parameters()
    assert trainable_parameters(spec, shape) == trainable


def test_gradients_and_optimizer_states_follow_the_count():
    """On a CPU worker the planned optimizer states are the bytes torch's AdamW holds after a step on the planned
    trainable tensors: two fp32 moments each and a 0-dim fp32 ``step`` each (torch/optim/adam.py)."""
    import torch

    cfg = _clean(CONFIGS["preset:small-llama"])
    shape = shape_from_config(cfg)
    for method in ("ia3", "lokr", "prefix_tuning"):
        spec = _spec(method)
        p = plan(spec, shape).model_dump(mode="json")
        n = trainable_parameters(spec, shape)
        assert p["trainable_parameter_count"] == n
        states = p["model_states"]["device"]
        assert states["gradients"] == 4 * n  # fp32 gradients
        params = [torch.nn.Parameter(torch.zeros(k)) for k in _trainable_numels(spec, shape, _lora_targets(spec, shape))]
        for q in params:
            q.grad = torch.ones_like(q)
        opt = torch.optim.AdamW(params)
        opt.step()
        held = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))
        assert states["optimizer_states"] == held


@pytest.mark.parametrize("dimension", [1, 2, 7, 12, 127, 128, 256, 344, 688, 704, 1000, 4096, 11008, 14336])
def test_lokr_factorization_is_peft_s(dimension):
    from peft.tuners.lokr.layer import factorization

    assert lokr_factorization(dimension) == factorization(dimension, -1)


def test_refused_where_peft_cannot(tmp_path):
    """LoHa/LoKr on GPT-2 is refused at admission naming the field, not left to fail in the worker."""
    from service.domain.errors import SpecInvalid
    from service.memory.preflight import preflight
    from tests.factories import settings_for

    settings = settings_for(f"sqlite:///{tmp_path}/db.sqlite", tmp_path)
    for method in ("loha", "lokr"):
        spec = JobSpec.model_validate({"model": "preset:tiny-gpt2", "training_file": "file-x",
                                       "training": {"peft": {"method": method}}})
        with pytest.raises(SpecInvalid) as err:
            preflight(spec, settings)
        problem = err.value.errors[0]
        assert problem["param"] == "training.peft.method" and "Conv1D" in problem["message"]
        with pytest.raises(TypeError, match="Conv1D"):  # what peft itself does with it
            _peft_model(_clean(PRESETS["tiny-gpt2"]), method, 8, "auto", 16)
    ok = JobSpec.model_validate({"model": "preset:tiny-gpt2", "training_file": "file-x",
                                 "training": {"peft": {"method": "ia3"}}})
    assert preflight(ok, settings).plan is not None
