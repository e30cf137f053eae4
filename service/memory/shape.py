"""A model's shape, read from its Hugging Face config, and exact parameter counts from the shape.

No torch here: the planner runs in the API process. Supported families: Llama, Mistral, Qwen2,
Qwen3, GPT-2, Gemma, Gemma 2, Gemma 3 (text). Anything else raises :class:`UnsupportedModel`; a worker can then
count the parameters on the meta device and hand the planner the counts instead.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from service.domain.model_ref import ModelRef
from service.domain.presets import PRESETS

LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"}
SUPPORTED = LLAMA_LIKE | {"gpt2"}


class UnsupportedModel(ValueError):
    """The config's model_type is not one the planner knows how to read."""


@dataclass(frozen=True)
class ModelShape:
    family: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    norm: Literal["rmsnorm", "layernorm"]
    mlp: Literal["swiglu", "geglu", "gelu"]
    attention_bias: bool = False  # q, k, v (and o for llama's attention_bias) carry biases
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3 / gemma3: RMSNorm over head_dim on q and k
    norms_per_layer: int = 2  # gemma2/3 add pre/post feed-forward norms
    learned_positions: int = 0  # gpt2: wpe rows
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # --- parameter counts -------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def mlp_params(self) -> int:
        h, i = self.hidden, self.intermediate
        if self.mlp in ("swiglu", "geglu"):
            n = 3 * h * i
            if self.mlp_bias:
                n += 2 * i + h
            return n
        return 2 * h * i + i + h  # gpt2 c_fc, c_proj with biases

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + self.norms_per_layer * self.norm_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.learned_positions * self.hidden

    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def parameter_count(self) -> int:
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.norm_params()  # final norm
            + self.lm_head_params()
        )

    def largest_layer_params(self) -> int:
        """The largest single module's parameters (DeepSpeed's ZeRO-3 estimator input): embedding or lm_head."""
        return max(self.vocab * self.hidden, self.learned_positions * self.hidden, self.layer_params())

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear in one block, by the HF module name."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        if self.family == "gpt2":
            # q = h, except for a tensor-parallel rank's share (service/memory/tensor_parallel.py: rank_shape)
            return {"c_attn": (h, 3 * q), "attn.c_proj": (q, h), "c_fc": (h, i), "mlp.c_proj": (i, h)}
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    def targeted_linears(self, targets) -> dict[str, tuple[int, int]]:
        """The block's linears (in, out) that ``targets`` names: peft matches a module's full name or its last part."""
        return {name: io for name, io in self.linear_shapes().items() if name in targets or name.split(".")[-1] in targets}

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Trainable parameters of LoRA rank r on ``targets`` (module names) in every layer."""
        return sum(r * (din + dout) for din, dout in self.targeted_linears(targets).values()) * self.num_layers

    def layer_numels(self) -> list[int]:
        """One block's parameter sizes in ``block.parameters()`` order (attention, MLP, norms)."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        norm = [self.hidden] * (2 if self.norm == "layernorm" else 1)  # weight (, bias)
        if self.family == "gpt2":  # ln_1, attn (c_attn, c_proj), ln_2, mlp (c_fc, c_proj), all with biases
            return [*norm, h * 3 * q, 3 * q, q * h, h, *norm, h * i, i, i * h, h]
        attn: list[int] = []
        for din, dout, bias in ((h, q, self.attention_bias), (h, kv, self.attention_bias),
                                (h, kv, self.attention_bias), (q, h, self.o_bias)):
            attn += [din * dout] + ([dout] if bias else [])
        if self.qk_norm:
            attn += [self.head_dim, self.head_dim]
        if self.mlp in ("swiglu", "geglu"):
            mlp = [h * i] + ([i] if self.mlp_bias else [])
            mlp += [h * i] + ([i] if self.mlp_bias else [])
            mlp += [i * h] + ([h] if self.mlp_bias else [])
        else:  # pragma: no cover - only gpt2 has the plain GELU MLP, handled above
            mlp = [h * i, i, i * h, h]
        return attn + mlp + norm * self.norms_per_layer

    def parameter_numels(self) -> list[int]:
        """Every parameter's size in ``model.parameters()`` order (tied weights once), as ZeRO flattens them."""
        out = [self.vocab * self.hidden]
        if self.learned_positions:
            out.append(self.learned_positions * self.hidden)
        out += self.layer_numels() * self.num_layers
        out += [self.hidden] * (2 if self.norm == "layernorm" else 1)
        if not self.tied_embeddings:
            out.append(self.vocab * self.hidden)
        return out

    def lora_numels(self, r: int, targets: list[str] | set[str]) -> list[int]:
        """LoRA's trainable tensors (lora_A, lora_B of each adapted linear) in ``model.parameters()`` order."""
        return self.adapter_numels("lora", r, targets)

    def adapter_numels(self, method: str, r: int, targets: list[str] | set[str],
                       feedforward: list[str] | set[str] = ()) -> list[int]:
        """The trainable tensors peft adds to each adapted linear of every block, in ``model.parameters()``
        order, for the adapters that wrap linears (peft/tuners/<method>/layer.py ``update_layer``):

        - ``lora``/``qlora``: lora_A (r × in), lora_B (out × r);
        - ``loha``: hada_w1_a (out × r), hada_w1_b (r × in), hada_w2_a, hada_w2_b — two low-rank pairs
          whose Hadamard product is the update;
        - ``lokr``: a Kronecker product w1 ⊗ w2 of the factors of in and out nearest their square roots
          (``factorization(dim, -1)``): w1 is the small (out_l × in_m) factor, kept whole; w2
          (out_k × in_n) is kept whole unless r < max(out_k, in_n)/2, when it becomes w2_a (out_k × r)
          and w2_b (r × in_n) (``use_w2``; peft's defaults decompose_both=False, decompose_factor=-1);
        - ``ia3``: one scaling vector, over the outputs (out × 1), or over the inputs (1 × in) of a
          feed-forward module (``is_feedforward``).
        """
        one_layer: list[int] = []
        feedforward_linears = self.targeted_linears(feedforward)
        for name, (din, dout) in self.targeted_linears(targets).items():
            if method in ("lora", "qlora"):
                one_layer += [r * din, dout * r]
            elif method == "loha":
                one_layer += [dout * r, r * din, dout * r, r * din]
            elif method == "lokr":
                in_m, in_n = lokr_factorization(din)
                out_l, out_k = lokr_factorization(dout)
                one_layer.append(out_l * in_m)
                one_layer += [out_k * in_n] if r >= max(out_k, in_n) / 2 else [out_k * r, r * in_n]
            elif method == "ia3":
                one_layer.append(din if name in feedforward_linears else dout)
            else:
                raise ValueError(f"{method!r} does not adapt linears")
        return one_layer * self.num_layers

    def prompt_numels(self, method: str, num_virtual_tokens: int) -> list[int]:
        """Prompt tuning's and prefix tuning's one trainable table (peft/utils/other.py
        ``_prepare_prompt_learning_config``). Prompt tuning learns ``num_virtual_tokens`` input
        embeddings (× hidden). Prefix tuning learns a key and a value per virtual token for every layer,
        each as wide as the attention's keys: for a config with ``num_key_value_heads`` (every
        Llama-like family) that is head_dim × num_kv_heads, not hidden (peft's grouped-query rule,
        peft#1901); GPT-2 has no such field and gets hidden. No ``prefix_projection`` (peft's default)."""
        if method == "prompt_tuning":
            return [num_virtual_tokens * self.hidden]
        width = self.hidden if self.family == "gpt2" else self.kv_dim
        return [num_virtual_tokens * self.num_layers * 2 * width]

    def counts(self) -> dict[str, int]:
        return {
            "total": self.parameter_count(),
            "per_layer": self.layer_params(),
            "largest_layer": self.largest_layer_params(),
            "embedding": self.embedding_params(),
            "lm_head": self.lm_head_params(),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["parameter_count"] = self.parameter_count()
        return d


def lokr_factorization(dimension: int) -> tuple[int, int]:
    """peft's ``factorization(dimension, factor=-1)`` (peft/tuners/lokr/layer.py): it walks the divisors
    of ``dimension`` upwards from 1 and stops at the first pair (m, n = dimension / m) with m ≥ n (its
    ``length`` bound is fixed at 1 + dimension and never binds), then returns the pair smaller first."""
    m, n = 1, dimension
    while m < n:
        m += 1
        while dimension % m:
            m += 1
        n = dimension // m
    return (n, m) if m > n else (m, n)


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is not None:
        return default
    raise KeyError(names[0])


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    """Read a Hugging Face config dict (config.json contents)."""
    if "text_config" in cfg and cfg.get("model_type") not in SUPPORTED:  # multimodal wrappers (gemma3)
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    family = cfg.get("model_type")
    if family not in SUPPORTED:
        raise UnsupportedModel(
            f"model_type {family!r} is not one the planner reads ({', '.join(sorted(SUPPORTED))}); "
            "count its parameters on the meta device instead"
        )
    try:
        if family == "gpt2":
            h = int(_get(cfg, "n_embd", "hidden_size"))
            heads = int(_get(cfg, "n_head", "num_attention_heads"))
            return ModelShape(
                family=family,
                num_layers=int(_get(cfg, "n_layer", "num_hidden_layers")),
                hidden=h,
                intermediate=int(cfg.get("n_inner") or 4 * h),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=h // heads,
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                norm="layernorm",
                mlp="gelu",
                attention_bias=True,
                o_bias=True,
                mlp_bias=True,
                learned_positions=int(_get(cfg, "n_positions", "max_position_embeddings", default=1024)),
            )
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or h // heads)
        gemma = family.startswith("gemma")
        tied_default = gemma or family == "qwen3"
        return ModelShape(
            family=family,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden=h,
            intermediate=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
            norm="rmsnorm",
            mlp="geglu" if gemma else "swiglu",
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            o_bias=bool(cfg.get("attention_bias", False)) and family != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3_text"),
            norms_per_layer=4 if family in ("gemma2", "gemma3_text") else 2,
            # the model caps its logits after the LM head (Gemma 2): training.loss_chunk_problem refuses chunking
            extra={"final_logit_softcapping": float(cfg["final_logit_softcapping"])}
            if cfg.get("final_logit_softcapping") is not None else {},
        )
    except KeyError as exc:
        raise UnsupportedModel(f"config of a {family} model lacks {exc.args[0]!r}") from None


def shape_from_path(path: str | Path) -> ModelShape:
    """Read ``config.json`` from a model directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"no config.json at {p}") from None
    except json.JSONDecodeError as exc:
        raise UnsupportedModel(f"{p} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    return shape_from_config(cfg)


# Shapes of well-known hub models, so that a plan needs no download (config.json values).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                                 "vocab_size": 32000, "tie_word_embeddings": False},
    "meta-llama/Llama-2-13b-hf": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                                  "vocab_size": 32000, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-8B": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 128256, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-70B": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                                 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                                 "vocab_size": 128256, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-405B": {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
                                  "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                                  "vocab_size": 128256, "tie_word_embeddings": False},
    "meta-llama/Llama-3.2-1B": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 128256, "tie_word_embeddings": True, "head_dim": 64},
    "mistralai/Mistral-7B-v0.1": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "vocab_size": 32000, "tie_word_embeddings": False},
    "Qwen/Qwen2-7B": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                      "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "vocab_size": 152064, "tie_word_embeddings": False},
    "Qwen/Qwen2-0.5B": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                        "vocab_size": 151936, "tie_word_embeddings": True},
    "openai-community/gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                              "n_positions": 1024, "vocab_size": 50257},
    "google/gemma-2b": {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
                        "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
                        "head_dim": 256, "vocab_size": 256000},
}
KNOWN_CONFIGS["gpt2"] = KNOWN_CONFIGS["openai-community/gpt2"]


def shape_for_model(ref: ModelRef) -> ModelShape:
    """A resolved ``model`` (service/domain/model_ref.py) → its shape: a preset's config, a local
    directory's config.json, or a hub id's entry in KNOWN_CONFIGS. Raises UnsupportedModel saying why."""
    if ref.kind == "preset":
        return shape_from_config(PRESETS[ref.preset])
    if ref.kind == "local":
        return shape_from_path(ref.path)
    if ref.hub_id in KNOWN_CONFIGS:
        return shape_from_config(KNOWN_CONFIGS[ref.hub_id])
    raise UnsupportedModel(f"{ref.hub_id!r} is a hub id whose shape the planner does not know (not a preset, "
                           "and not a directory under MEMFIT_MODEL_DIRS with a config.json)")
