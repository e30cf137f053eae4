"""The Tinker training API's requests (Thinking Machines' ``tinker`` SDK; docs/tinker.md): what memfit accepts,
what it refuses and why, torch-free. The JSON bodies are pydantic models that ignore fields a newer SDK adds;
``forward_backward``'s protobuf body is read by service/domain/tinker_wire.py and checked here.

A Tinker checkpoint is named ``tinker://<model id>/weights/<name>`` (``save_state``: the adapter and the
optimizer's state) or ``tinker://<model id>/sampler_weights/<name>`` (``save_weights_for_sampler``: the adapter
alone); both folders hold the adapter in peft's format, so both are models of ``/v1/models`` under that name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.domain.errors import DomainError, NotFound
from service.domain.tinker_wire import ForwardBackwardRequest

API_KEY_PREFIX = "tml-"  # the SDK refuses keys without it; memfit's key is what follows
PATH_SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MODEL_ID = re.compile(r"^tm-[a-z0-9]{6,40}$")
MAX_RANK = 256
MAX_DATUMS = 1024
MAX_TOKENS_PER_DATUM = 32768

# Each built-in loss and the loss_fn_inputs it reads (Tinker's docs: "Losses"); weights default to ones.
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
OPTIONAL_INPUTS = ("weights",)
LOSS_CONFIG = {"ppo": ("clip_low_threshold", "clip_high_threshold")}

# The modules each LoRA switch adapts, per model family (llama-like: every preset but gpt2).
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_GPT2 = {"attn": ("c_attn",), "mlp": ("c_fc", "c_proj")}


class TinkerError(DomainError):
    """A request memfit's Tinker API refuses: 400 with the field it is about."""

    code = "invalid_tinker_request"


class Unsupported(DomainError):
    """A part of the Tinker API memfit does not implement (docs/tinker.md lists them)."""

    status, code, title = 400, "unsupported", "Not supported"


class TinkerNotFound(NotFound):
    code, title = "not_found", "Not found"


def lora_targets(family: str, *, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    """The module names a Tinker LoRA wraps: its switches over the family's attention, MLP and LM head."""
    attn, mlp = (_GPT2["attn"], _GPT2["mlp"]) if family == "gpt2" else (_ATTN, _MLP)
    out = list(attn if train_attn else ()) + list(mlp if train_mlp else ()) + (["lm_head"] if train_unembed else [])
    if not out:
        raise TinkerError("at least one of train_attn, train_mlp and train_unembed must be true", param="lora_config")
    return out


# --- JSON bodies (the SDK's types; fields memfit does not use are ignored) ----------------------------


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class LoraConfig(Body):
    rank: int = Field(32, description=f"LoRA rank, 1 to {MAX_RANK}.")
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRef(Body):
    session_id: str


class CreateModel(Body):
    session_id: str
    model_seq_id: int = 0
    base_model: str = Field(..., min_length=1, max_length=512)
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()
    user_metadata: dict[str, Any] | None = None


class ModelRef(Body):
    model_id: str


class AdamParams(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class LoadWeights(Body):
    model_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    path: str
    optimizer: bool = False
    seq_id: int | None = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(Body):
    chunks: list[Chunk]


class SamplingParams(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Body):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


# --- checks -------------------------------------------------------------------------------------------


def check_lora(cfg: LoraConfig) -> None:
    if not 1 <= cfg.rank <= MAX_RANK:
        raise TinkerError(f"lora_config.rank must be between 1 and {MAX_RANK}, got {cfg.rank}", param="lora_config.rank")


def check_optimizer(cfg: OptimizerConfig) -> None:
    if cfg.type != "adamw":
        raise Unsupported(f"optimizer {cfg.type!r} is not supported: memfit's Tinker API trains with AdamW only",
                          param="optimizer_config.type")


def adam_params(req: OptimStep) -> AdamParams:
    if req.adam_params is None:
        kind = (req.optimizer_params or {}).get("type", "?")
        raise Unsupported(f"optimizer params of type {kind!r} are not supported: send AdamParams", param="optimizer_params")
    p = req.adam_params
    problems = []
    if not p.learning_rate >= 0:
        problems.append(("adam_params.learning_rate", "must be ≥ 0"))
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(p, name) < 1:
            problems.append((f"adam_params.{name}", "must be in [0, 1)"))
    if not p.eps > 0:
        problems.append(("adam_params.eps", "must be > 0"))
    if not p.weight_decay >= 0:
        problems.append(("adam_params.weight_decay", "must be ≥ 0"))
    if not p.grad_clip_norm >= 0:
        problems.append(("adam_params.grad_clip_norm", "must be ≥ 0 (0: no clipping)"))
    if problems:
        raise TinkerError("; ".join(f"{f} {m}" for f, m in problems), param=problems[0][0],
                          errors=[{"param": f, "message": m} for f, m in problems])
    return p


def check_forward_backward(req: ForwardBackwardRequest, vocab_size: int) -> None:
    """Every datum well formed for its loss: memfit refuses here, before the trainer sees it."""
    if req.loss_fn not in LOSS_INPUTS:
        raise TinkerError(f"unknown loss_fn {req.loss_fn!r}; memfit's built-in losses are {', '.join(LOSS_INPUTS)} "
                          "(custom losses are not supported)", param="loss_fn")
    for key in req.loss_fn_config:
        if key not in LOSS_CONFIG.get(req.loss_fn, ()):
            raise TinkerError(f"loss_fn_config key {key!r} is not one {req.loss_fn} takes "
                              f"({', '.join(LOSS_CONFIG.get(req.loss_fn, ())) or 'none'})", param=f"loss_fn_config.{key}")
    if not req.data:
        raise TinkerError("data is empty", param="data")
    if len(req.data) > MAX_DATUMS:
        raise TinkerError(f"{len(req.data)} datums in one request; at most {MAX_DATUMS}", param="data")
    needed = LOSS_INPUTS[req.loss_fn]
    for i, d in enumerate(req.data):
        where = f"data[{i}]"
        n = len(d.tokens)
        if n == 0:
            raise TinkerError(f"{where}.model_input holds no tokens", param=f"{where}.model_input")
        if n > MAX_TOKENS_PER_DATUM:
            raise TinkerError(f"{where}.model_input holds {n} tokens; at most {MAX_TOKENS_PER_DATUM}", param=f"{where}.model_input")
        bad = next((t for t in d.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TinkerError(f"{where}.model_input token {bad} is outside the model's vocabulary (0..{vocab_size - 1})",
                              param=f"{where}.model_input")
        for key in needed:
            if key not in d.loss_fn_inputs:
                raise TinkerError(f"{where}.loss_fn_inputs lacks {key!r}, which {req.loss_fn} needs", param=f"{where}.loss_fn_inputs.{key}")
        for key, t in d.loss_fn_inputs.items():
            if key not in needed and key not in OPTIONAL_INPUTS:
                raise TinkerError(f"{where}.loss_fn_inputs.{key} is not an input of {req.loss_fn} "
                                  f"({', '.join(needed + OPTIONAL_INPUTS)})", param=f"{where}.loss_fn_inputs.{key}")
            if len(t.data) != n:
                raise TinkerError(f"{where}.loss_fn_inputs.{key} has {len(t.data)} values for {n} input tokens; "
                                  "each input position needs one", param=f"{where}.loss_fn_inputs.{key}")
        targets = d.loss_fn_inputs["target_tokens"].data
        bad = next((t for t in targets if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TinkerError(f"{where}.loss_fn_inputs.target_tokens holds {bad}, outside the vocabulary (0..{vocab_size - 1})",
                              param=f"{where}.loss_fn_inputs.target_tokens")


def check_sample(req: Sample, vocab_size: int, max_tokens_limit: int) -> list[int]:
    """The prompt's tokens, after refusing what memfit does not sample."""
    tokens: list[int] = []
    for i, c in enumerate(req.prompt.chunks):
        if c.type != "encoded_text":
            raise Unsupported(f"prompt chunk {i} is {c.type!r}: memfit samples text models (encoded_text chunks only)",
                              param=f"prompt.chunks[{i}]")
        tokens += c.tokens
    if not tokens:
        raise TinkerError("the prompt holds no tokens", param="prompt")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TinkerError(f"prompt token {bad} is outside the model's vocabulary (0..{vocab_size - 1})", param="prompt")
    if not 1 <= req.num_samples <= 16:
        raise TinkerError("num_samples must be between 1 and 16", param="num_samples")
    mt = req.sampling_params.max_tokens
    if mt is None or not 1 <= mt <= max_tokens_limit:
        raise TinkerError(f"sampling_params.max_tokens must be between 1 and {max_tokens_limit} (MEMFIT_SERVE_MAX_TOKENS)",
                          param="sampling_params.max_tokens")
    if req.sampling_params.temperature < 0:
        raise TinkerError("sampling_params.temperature must be ≥ 0", param="sampling_params.temperature")
    for name in ("prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(req, name):
            raise Unsupported(f"{name} is not supported by memfit's sampler", param=name)
    return tokens


# --- checkpoint names ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: Literal["weights", "sampler_weights"]
    name: str

    def __str__(self) -> str:
        return f"{PATH_SCHEME}{self.model_id}/{self.kind}/{self.name}"


def check_name(name: str, param: str = "path") -> str:
    if not NAME.match(name):
        raise TinkerError(f"checkpoint name {name!r} must be 1–64 letters, digits, '.', '_' or '-', starting with a "
                          "letter or digit", param=param)
    return name


def parse_path(path: str, param: str = "path") -> CheckpointPath:
    if not path.startswith(PATH_SCHEME):
        raise TinkerError(f"{path!r} is not a tinker:// checkpoint path", param=param)
    parts = path[len(PATH_SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not MODEL_ID.match(parts[0]):
        raise TinkerError(f"{path!r} is not tinker://<model id>/weights|sampler_weights/<name>", param=param)
    return CheckpointPath(parts[0], parts[1], check_name(parts[2], param))  # type: ignore[arg-type]
