"""Built-in tiny models for demos and tests, as plain Hugging Face config dicts (no torch here).

Workers build them with random weights from these configs and train a small tokenizer in-process
(vocab_size tokens, :func:`preset_tokenizer`); the planner reads the same dicts as it reads a model's
config.json, and tokenizes a training file with the same tokenizer (service/memory/data.py).
"""

from __future__ import annotations

import random
from functools import lru_cache

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


# --- the presets' tokenizer ------------------------------------------------------------------------

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
PRESET_SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _tokenizer_corpus(n_words: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic English-like text: enough distinct words for the BPE trainer to reach its vocab."""
    rng = random.Random(seed)
    base = (
        "the of and to in is was for on that with as by at from his her they this are have not be "
        "answer question user assistant system hello world model memory train token learn data "
        "what why how when where which who please thank you yes no one two three four five"
    ).split()
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "an", "er", "in", "on", "st", "th", "qu"]
    words = base + ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(n_words)]
    lines = []
    for _ in range(4000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + ".")
    lines.extend(" ".join(words[i : i + 10]) for i in range(0, len(words), 10))
    return lines


@lru_cache(maxsize=8)
def _trained_bpe_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=PRESET_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(n_words=max(2000, vocab_size)), trainer=trainer)
    # A small corpus can stop short of vocab_size merges: pad with unused tokens so that the
    # embedding matrix and the tokenizer agree exactly.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def preset_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens (the special tokens
    above first), trained on a seeded corpus: the same merges in every process (0.1–0.5 s, then cached)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_bpe_json(vocab_size))
