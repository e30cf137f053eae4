"""OpenAI's inference requests and answers, torch-free: ``POST /v1/chat/completions`` and ``POST
/v1/completions`` bodies checked here, turned into the request a serving engine takes (workers/serving_engine.py),
and the engine's events turned back into OpenAI's objects — a whole ``chat.completion`` /
``text_completion``, or the ``chat.completion.chunk`` / ``text_completion`` chunks of a stream.

Accepted and used: messages (with ``tools``, which the chat template renders), prompt, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` /
``top_logprobs``, ``stream`` / ``stream_options.include_usage``. Accepted and ignored (as OpenAI does for
some models): ``user``, ``metadata``, ``store``, penalties, ``logit_bias``, ``tool_choice``,
``parallel_tool_calls``, ``response_format``. Anything else is left out by the parser.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.domain.errors import BadRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ContextTooLong(BadRequest):
    code = "context_length_exceeded"


class MaxTokensTooLarge(BadRequest):
    code = "max_tokens_too_large"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., min_length=1, max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is an empty string")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    def plain(self) -> dict[str, Any]:
        """The message as the chat template takes it: content parts' texts joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.get("text", "") for p in self.content if p.get("type") in ("text", "input_text"))
        if out.get("role") == "developer":
            out["role"] = "system"
        return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None

    def wanted_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Common):
    prompt: str | list[str] = ""
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("one prompt per request (a list of one string)")
        return v

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    def wanted_tokens(self, default: int) -> int:
        return self.max_tokens or min(DEFAULT_COMPLETION_MAX_TOKENS, default)


def check_max_tokens(wanted: int, cap: int, param: str) -> None:
    if wanted > cap:
        raise MaxTokensTooLarge(f"{param} is {wanted}; this server allows at most {cap} (MEMFIT_SERVE_MAX_TOKENS)",
                                param=param)


def engine_request(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, adapter_path: str | None,
                   adapter_config_from: str | None = None) -> dict:
    """What the serving engine takes (workers/serving_engine.py: parse_request)."""
    chat = isinstance(req, ChatCompletionRequest)
    sampling = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                "stop": req.stops,
                "logprobs": bool(req.logprobs) if chat else req.logprobs is not None,
                "top_logprobs": (req.top_logprobs or 0) if chat else (req.logprobs or 0)}
    body: dict[str, Any] = {"kind": "chat" if chat else "completion", "n": req.n, "sampling": sampling,
                            "adapter_path": adapter_path, "adapter_config_from": adapter_config_from}
    if chat:
        body["messages"] = [m.plain() for m in req.messages]
        if req.tools:
            body["tools"] = req.tools
    else:
        body["prompt"] = req.text
    return body


# --- answers -------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(entries: list[dict], offset: int) -> dict[str, Any]:
    """The legacy completions' logprobs object from the engine's per-token entries."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class Assembler:
    """Engine events → one OpenAI answer (whole, or as chunks when streaming)."""

    def __init__(self, req: ChatCompletionRequest | CompletionRequest, model: str):
        self.chat = isinstance(req, ChatCompletionRequest)
        self.req, self.model = req, model
        self.id, self.created = new_id(self.chat), int(time.time())
        self.texts = [""] * req.n
        self.logprobs: list[list[dict]] = [[] for _ in range(req.n)]
        self.finish: list[str | None] = [None] * req.n
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._role_sent = [False] * req.n

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": "memfit"}

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one event; the stream chunks it makes (none for the start)."""
        kind = event["event"]
        if kind == "start":
            self.prompt_tokens = int(event["prompt_tokens"])
            return []
        i = int(event["index"])
        if kind == "delta":
            offset = len(self.texts[i])
            self.texts[i] += event["text"]
            entries = event.get("logprobs") or []
            self.logprobs[i] += entries
            return [self._chunk(i, text=event["text"], entries=entries, offset=offset)]
        if kind == "end":
            self.finish[i] = event["finish_reason"]
            self.completion_tokens += int(event["completion_tokens"])
            return [self._chunk(i, finish=event["finish_reason"])]
        return []

    def _chunk(self, i: int, *, text: str = "", entries: list | None = None, offset: int = 0,
               finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if not self._role_sent[i]:
                delta["role"] = "assistant"
                self._role_sent[i] = True
            if text or finish is None:
                delta["content"] = text
            lp = {"content": entries, "refusal": None} if (self.req.logprobs and entries) else None
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            lp = _completion_logprobs(entries, offset) if (self.req.logprobs is not None and entries) else None
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        out = {**self._base(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    @property
    def include_usage(self) -> bool:
        return self.req.include_usage

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage(self.prompt_tokens, self.completion_tokens)}

    def whole(self) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.texts):
            if self.chat:
                lp = {"content": self.logprobs[i], "refusal": None} if self.req.logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                                        "annotations": []},
                                "logprobs": lp, "finish_reason": self.finish[i] or "stop"})
            else:
                lp = _completion_logprobs(self.logprobs[i], 0) if self.req.logprobs is not None else None
                shown = (self.req.text + text) if self.req.echo else text
                choices.append({"index": i, "text": shown, "logprobs": lp, "finish_reason": self.finish[i] or "stop"})
        return {**self._base(False), "choices": choices, "usage": usage(self.prompt_tokens, self.completion_tokens)}
