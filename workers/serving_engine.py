"""The engines behind a serving deployment (workers/serving.py): one base model, the adapters on top, and a
loop that generates for every request in flight as one batch.

- :class:`TransformersEngine` (CPU nodes; any GPU without vLLM): the base loaded once with ``transformers``,
  each adapter added to it with ``peft`` under a name of its own; a batch may mix adapters — peft's
  ``adapter_names`` gives each row of one forward pass its own adapter (``"__base__"``: none). Requests that
  arrive while a batch runs wait for the next one (static batching: simple, and honest about it).
- :class:`VLLMEngine` (GPU nodes with vLLM installed): vLLM's ``AsyncLLMEngine`` with ``enable_lora``,
  each adapter a ``LoRARequest``; vLLM batches and pages the KV cache itself.

Both take the same request (:func:`parse_request`) and yield the same events, so the deployment and the API
do not know which one runs:

- ``{"event": "start", "prompt_tokens": N}`` once;
- ``{"event": "delta", "index": i, "text": "…", "logprobs": [...]}`` as choice ``i`` grows;
- ``{"event": "end", "index": i, "finish_reason": "stop"|"length", "completion_tokens": k}`` per choice;
- ``{"event": "error", "status": 400, "code": "…", "message": "…"}`` instead of all of that for a request
  the engine refuses (a prompt too long for the context).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


class RequestRejected(Exception):
    """A request the engine cannot serve as asked; the API answers ``status`` with ``code``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def event(self) -> dict[str, Any]:
        return {"event": "error", "status": self.status, "code": self.code, "message": self.message, "param": self.param}


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False  # the benchmarks' fixed lengths (vLLM's option of the same name)


def parse_request(body: dict[str, Any]) -> tuple[str, Sampling, int]:
    """(kind, sampling, n) of a request the API sends (service/domain/serving.py: engine_request)."""
    s = body.get("sampling") or {}
    return body.get("kind", "chat"), Sampling(
        max_tokens=int(s.get("max_tokens", 16)), temperature=float(s.get("temperature", 1.0)),
        top_p=float(s.get("top_p", 1.0)), seed=s.get("seed"), stop=list(s.get("stop") or []),
        logprobs=bool(s.get("logprobs")), top_logprobs=int(s.get("top_logprobs") or 0),
        ignore_eos=bool(s.get("ignore_eos"))), int(body.get("n", 1))


# --- transformers + peft ------------------------------------------------------------------------


class _Sequence:
    """One choice being generated: its prompt, adapter, sampling, what it has produced and where its events go."""

    def __init__(self, index: int, prompt_ids: list[int], adapter: str | None, sampling: Sampling,
                 sink: Callable[[dict], None], seed_offset: int = 0):
        import torch

        self.index, self.prompt_ids, self.adapter, self.sampling, self.sink = index, prompt_ids, adapter, sampling, sink
        self.out_ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.pending_logprobs: list[dict] = []
        self.done = False
        self.cancelled = False
        self.generator = torch.Generator()
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.generator.manual_seed(int(seed) + seed_offset)


class TransformersEngine:
    """The base model with adapters on top, and a thread generating for every request in flight as one batch."""

    name = "transformers"

    def __init__(self, model_dir: str, *, max_batch: int = 8, max_context: int | None = None, dtype: str = "float32",
                 threads: int | None = None, batch_window_s: float = 0.002):
        import torch
        from transformers import AutoModelForCausalLM

        from workers.models import load_tokenizer

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = model_dir
        self.batch_window_s = batch_window_s  # how long the first request waits for others to join its batch
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        cfg = self.model.config
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        self.max_context = int(min(max_context or positions, positions))
        self.max_batch = max_batch
        self.stop_ids = self._stop_ids()
        self.adapters: dict[str, str] = {}  # name → folder
        self._model_lock = threading.Lock()  # adapters are added/removed between batches, never during one
        self._queue: queue.Queue[_Sequence] = queue.Queue()
        self._stopping = False
        self.batches = 0
        self.max_rows = 0  # the largest batch run, and how many adapters it mixed
        self.max_adapters_in_batch = 0
        self._thread = threading.Thread(target=self._run, name="memfit-engine", daemon=True)
        self._thread.start()

    def _stop_ids(self) -> set[int]:
        tok = self.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        end = tok.convert_tokens_to_ids("<|end|>") if "<|end|>" in tok.get_vocab() else None
        if end is not None:  # the presets' template closes every turn with <|end|> (service/domain/encoding.py)
            ids.add(end)
        return {int(i) for i in ids if i is not None}

    # --- adapters ---

    def load_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        with self._model_lock:
            if name in self.adapters:
                return
            if not hasattr(self.model, "peft_config"):
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            else:
                self.model.load_adapter(path, adapter_name=name)
            self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        with self._model_lock:
            if name in self.adapters:
                self.model.delete_adapter(name)
                del self.adapters[name]

    # --- requests ---

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        kind = body.get("kind", "chat")
        if kind == "chat":
            extra = {"tools": body["tools"]} if body.get("tools") else {}
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True, **extra)
        else:
            text = body.get("prompt") or ""
        # BOS first, as training encodes every row (service/domain/encoding.py): the model sees what it learnt on
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = bos + self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids or [self.tokenizer.eos_token_id]

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + 1 > self.max_context:
            raise RequestRejected(400, "context_length_exceeded",
                                  f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                                  f"{prompt_tokens}", param="messages")

    def submit(self, body: dict[str, Any], adapter: str | None, sink: Callable[[dict], None]) -> list[_Sequence]:
        """Queue the request's choices; events go to ``sink`` (from the engine's thread). Raises RequestRejected."""
        _, sampling, n = parse_request(body)
        ids = self.prompt_ids(body)
        self.check_fits(len(ids), sampling.max_tokens)
        sink({"event": "start", "prompt_tokens": len(ids)})
        seqs = [_Sequence(i, ids, adapter, sampling, sink, seed_offset=i) for i in range(n)]
        for s in seqs:
            self._queue.put(s)
        return seqs

    def close(self) -> None:
        self._stopping = True

    # --- the loop ---

    def _run(self) -> None:
        while not self._stopping:
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            time.sleep(self.batch_window_s)  # let the requests arriving together join one batch
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for s in batch:
                s.done = s.cancelled  # a client that left before its batch: nothing to generate
            batch = [s for s in batch if not s.cancelled]
            if not batch:
                continue
            with self._model_lock:
                try:
                    self._generate(batch)
                except Exception as exc:  # noqa: BLE001 - every request of the batch hears of it; the loop goes on
                    for s in batch:
                        if not s.done:
                            s.done = True
                            s.sink({"event": "error", "status": 500, "code": "generation_failed",
                                    "message": f"{type(exc).__name__}: {exc}"[:500], "param": None})

    def _generate(self, batch: list[_Sequence]) -> None:
        import torch
        from transformers import DynamicCache

        self.batches += 1
        self.max_rows = max(self.max_rows, len(batch))
        self.max_adapters_in_batch = max(self.max_adapters_in_batch, len({s.adapter for s in batch}))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(s.prompt_ids) for s in batch)
        input_ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in batch])
        mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in batch])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra: dict[str, Any] = {}
        if hasattr(self.model, "peft_config"):  # every row names its adapter, the base included
            extra["adapter_names"] = [s.adapter or BASE_ADAPTER for s in batch]
        budget = max(min(s.sampling.max_tokens, self.max_context - len(s.prompt_ids)) for s in batch)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=DynamicCache(), use_cache=True, **extra)
            for _ in range(budget):
                logits = out.logits[:, -1, :].float()
                tokens = []
                for i, s in enumerate(batch):
                    if not s.done:
                        self._step(s, logits[i])
                    tokens.append(s.out_ids[-1] if s.out_ids and not s.done else pad)
                if all(s.done for s in batch):
                    break
                mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(input_ids=torch.tensor(tokens)[:, None], attention_mask=mask, position_ids=positions,
                                 past_key_values=out.past_key_values, use_cache=True, **extra)
        for s in batch:
            if not s.done:
                self._emit(s, self.tokenizer.decode(s.out_ids, skip_special_tokens=True), final=True)
                self._finish(s, "length")

    def _step(self, s: _Sequence, logits) -> None:
        import torch

        if s.cancelled:
            s.done = True
            return
        sp = s.sampling
        if sp.temperature <= 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / sp.temperature, dim=-1)
            if sp.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p  # the smallest set whose mass reaches top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
            token = int(torch.multinomial(probs, 1, generator=s.generator))
        if token in self.stop_ids and not sp.ignore_eos:
            self._emit(s, self.tokenizer.decode(s.out_ids, skip_special_tokens=True), final=True)
            self._finish(s, "stop")
            return
        s.out_ids.append(token)
        if sp.logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)
            entry = {"token": self.tokenizer.decode([token]), "logprob": finite(float(logprobs[token])),
                     "bytes": list(self.tokenizer.decode([token]).encode())}
            if sp.top_logprobs:
                top = torch.topk(logprobs, min(sp.top_logprobs, logprobs.shape[-1]))
                entry["top_logprobs"] = [{"token": self.tokenizer.decode([int(t)]), "logprob": finite(float(v)),
                                          "bytes": list(self.tokenizer.decode([int(t)]).encode())}
                                         for v, t in zip(top.values, top.indices)]
            else:
                entry["top_logprobs"] = []
            s.pending_logprobs.append(entry)
        text = self.tokenizer.decode(s.out_ids, skip_special_tokens=True)
        for stop in sp.stop:
            at = text.find(stop, max(0, s.sent - len(stop)))
            if at >= 0:
                self._emit(s, text[:at], final=True)
                self._finish(s, "stop")
                return
        if len(s.out_ids) >= sp.max_tokens or len(s.prompt_ids) + len(s.out_ids) >= self.max_context:
            self._emit(s, text, final=True)
            self._finish(s, "length")
            return
        self._emit(s, text, final=False)

    @staticmethod
    def _emit(s: _Sequence, text: str, *, final: bool) -> None:
        end = len(text)
        if not final:
            while end > s.sent and text[end - 1] == "\ufffd":  # half a UTF-8 character: wait for the rest
                end -= 1
            hold = max((len(x) for x in s.sampling.stop), default=1) - 1  # may be the start of a stop string
            end = max(s.sent, end - hold)
        if end > s.sent or (final and s.pending_logprobs):
            event = {"event": "delta", "index": s.index, "text": text[s.sent:end]}
            if s.sampling.logprobs:
                event["logprobs"], s.pending_logprobs = s.pending_logprobs, []
            s.sent = end
            s.sink(event)

    def _finish(self, s: _Sequence, reason: str) -> None:
        if not s.done:
            s.done = True
            s.sink({"event": "end", "index": s.index, "finish_reason": reason, "completion_tokens": len(s.out_ids)})

    def stats(self) -> dict[str, Any]:
        weights = adapters = 0
        for name, p in self.model.named_parameters():
            if "lora_" in name:
                adapters += p.numel() * p.element_size()
            else:
                weights += p.numel() * p.element_size()
        return {"engine": self.name, "weights_bytes": int(weights), "adapters_bytes": int(adapters),
                "adapters": sorted(self.adapters),
                "batches": self.batches, "max_rows": self.max_rows, "max_adapters_in_batch": self.max_adapters_in_batch,
                "max_context": self.max_context}


# --- vLLM ---------------------------------------------------------------------------------------


class VLLMEngine:  # pragma: no cover - needs CUDA and vLLM (tests/test_serving_gpu.py, skipped without them)
    """vLLM's AsyncLLMEngine with ``enable_lora``: the same requests and events as TransformersEngine."""

    name = "vllm"

    def __init__(self, model_dir: str, *, max_batch: int = 64, max_context: int | None = None, dtype: str = "auto",
                 max_adapters: int = 8, max_lora_rank: int = 64, threads: int | None = None):
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        args = AsyncEngineArgs(model=model_dir, enable_lora=True, max_loras=max_adapters, max_lora_rank=max_lora_rank,
                               max_num_seqs=max_batch, max_model_len=max_context, dtype=dtype)
        self.engine = AsyncLLMEngine.from_engine_args(args)
        from workers.models import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.max_context = int(max_context or self.engine.engine.model_config.max_model_len)
        self.adapters: dict[str, tuple[int, str]] = {}
        self._next_id = 1

    def load_adapter(self, name: str, path: str) -> None:
        if name not in self.adapters:
            self.adapters[name] = (self._next_id, path)
            self._next_id += 1

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    prompt_ids = TransformersEngine.prompt_ids
    check_fits = TransformersEngine.check_fits

    async def generate(self, body: dict[str, Any], adapter: str | None):
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        _, sp, n = parse_request(body)
        ids = self.prompt_ids(body)
        self.check_fits(len(ids), sp.max_tokens)
        yield {"event": "start", "prompt_tokens": len(ids)}
        params = SamplingParams(n=n, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                seed=sp.seed, stop=sp.stop or None, logprobs=sp.top_logprobs if sp.logprobs else None)
        lora = None
        if adapter is not None:
            lora_id, path = self.adapters[adapter]
            lora = LoRARequest(adapter, lora_id, path)
        sent = [0] * n
        request_id = os.urandom(8).hex()
        async for out in self.engine.generate({"prompt_token_ids": ids}, params, request_id, lora_request=lora):
            for c in out.outputs:
                if len(c.text) > sent[c.index]:
                    yield {"event": "delta", "index": c.index, "text": c.text[sent[c.index]:]}
                    sent[c.index] = len(c.text)
                if c.finish_reason is not None:
                    yield {"event": "end", "index": c.index, "finish_reason": "length" if c.finish_reason == "length" else "stop",
                           "completion_tokens": len(c.token_ids)}

    def stats(self) -> dict[str, Any]:
        return {"engine": self.name, "adapters": sorted(self.adapters), "max_context": self.max_context}

    def close(self) -> None:
        pass


def make_engine(kind: str, model_dir: str, **options):
    """``auto``: vLLM where it is installed and CUDA is there, else transformers."""
    if kind == "auto":
        kind = "vllm" if _vllm_usable() else "transformers"
    if kind == "vllm":
        return VLLMEngine(model_dir, **options)
    options.pop("max_adapters", None)
    return TransformersEngine(model_dir, **options)


def _vllm_usable() -> bool:
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def finite(x: float) -> float:
    """A log-probability JSON can carry (-inf is not JSON): OpenAI's -9999.0 for "never"."""
    return x if math.isfinite(x) else -9999.0
