"""Parameter counts from a config agree exactly with the real Hugging Face model on the meta device."""

from __future__ import annotations

import json

import pytest

from service.domain.presets import PRESETS
from service.memory.shape import UnsupportedModel, shape_from_config, shape_from_path

FAMILY_CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "tie_word_embeddings": False},
    "llama-bias": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 500, "attention_bias": True,
                   "mlp_bias": True, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
              "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "n_embd": 128, "n_layer": 3, "n_head": 4, "n_positions": 256, "vocab_size": 1000},
    "gemma": {"model_type": "gemma", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 96, "vocab_size": 1000},
    "gemma2": {"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000},
}


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS) + ["preset:" + p for p in sorted(PRESETS)])
def test_parameter_count_matches_meta_model(name):
    cfg = PRESETS[name[7:]] if name.startswith("preset:") else FAMILY_CONFIGS[name]
    cfg = {k: v for k, v in cfg.items() if k != "architectures"}
    model = _meta_model(cfg)
    shape = shape_from_config(cfg)
    # model.parameters() de-duplicates tied weights, as the optimizer sees them.
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())
    # ZeRO flattens the parameters in this order; the planner places its partition boundaries on it.
    assert shape.parameter_numels() == [p.numel() for p in model.parameters()]
    layer = model.base_model.layers[0] if hasattr(model.base_model, "layers") else model.base_model.h[0]
    assert shape.layer_params() == sum(p.numel() for p in layer.parameters())
    embed = model.get_input_embeddings()
    assert shape.vocab * shape.hidden == embed.weight.numel()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_layer_params() >= largest


@pytest.mark.parametrize("name,targets", [("preset:small-qwen2", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                          ("gpt2", ["c_attn", "c_proj"])])
def test_lora_trainable_count_matches_peft(name, targets):
    pytest.importorskip("peft")
    import peft

    cfg = PRESETS[name[7:]] if name.startswith("preset:") else FAMILY_CONFIGS[name]
    cfg = {k: v for k, v in cfg.items() if k != "architectures"}
    model = _meta_model(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    assert shape_from_config(cfg).lora_params(8, targets) == sum(trainable)
    assert shape_from_config(cfg).lora_numels(8, set(targets)) == trainable


def test_reads_config_json_and_rejects_unknown(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FAMILY_CONFIGS["mistral"]))
    shape = shape_from_path(tmp_path)
    assert (shape.family, shape.num_kv_heads, shape.head_dim) == ("mistral", 2, 32)
    with pytest.raises(UnsupportedModel, match="t5"):
        shape_from_config({"model_type": "t5"})
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(UnsupportedModel, match="line 1"):
        shape_from_path(tmp_path)


def test_llama2_7b_count():
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False}
    assert shape_from_config(cfg).parameter_count() == 6_738_415_616


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_every_family_the_planner_reads_has_automatic_lora_targets_and_they_match(name):
    """target_modules "auto" adapts, in the worker, exactly what the planner counts for it."""
    pytest.importorskip("peft")
    from service.domain.spec import JobSpec
    from service.domain.training import AUTO_LORA_TARGETS
    from service.memory.planner import _lora_targets
    from service.memory.shape import SUPPORTED
    from workers.peft_setup import apply_peft

    assert SUPPORTED <= set(AUTO_LORA_TARGETS)
    cfg = FAMILY_CONFIGS[name]
    model = apply_peft(_meta_model(cfg), "lora", r=4)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = shape_from_config(cfg)
    spec = JobSpec.model_validate({"model": "x/y", "training_file": "file-1", "training": {"peft": {"method": "lora", "r": 4}}})
    assert trainable == shape.lora_params(4, sorted(_lora_targets(spec, shape)))
