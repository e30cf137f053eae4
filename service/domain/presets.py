"""Built-in tiny models for demos and tests, as plain Hugging Face config dicts (no torch here).

Workers build them with random weights from these configs and train a small tokenizer in-process
(vocab_size tokens); the planner reads the same dicts as it reads a model's config.json.
"""

from __future__ import annotations

PRESET_PREFIX = "preset:"

PRESETS: dict[str, dict] = {
    "tiny-llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "tiny-gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 1024,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "tiny-qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    # Bigger, still CPU-sized: the memory benchmarks' "tiny-but-not-trivial" models.
    "small-llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "small-qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 8000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    "small-gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": 256,
        "n_layer": 4,
        "n_head": 8,
        "n_positions": 2048,
        "vocab_size": 8000,
        "tie_word_embeddings": True,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "small-gemma": {
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 8000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # The held-out family of bench/holdout_matrix.py: Qwen3 adds an RMSNorm over head_dim on q and k.
    "small-qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 8000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
}


def preset_name(model: str) -> str | None:
    """'preset:tiny-llama' -> 'tiny-llama'; anything else -> None."""
    return model[len(PRESET_PREFIX):] if model.startswith(PRESET_PREFIX) else None


def preset_config(model: str) -> dict:
    name = preset_name(model)
    if name is None or name not in PRESETS:
        raise KeyError(f"unknown preset {model!r}; known: {', '.join(PRESET_PREFIX + n for n in PRESETS)}")
    return dict(PRESETS[name])
