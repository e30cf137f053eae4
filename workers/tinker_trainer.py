"""One Tinker training client: a Ray Serve application of one replica (a Ray actor) holding one LoRA on its
base, its AdamW state, and the adapters it samples from. The API deploys it through Serve's REST API
(service/scheduler/tinker.py: ``import_path`` ``workers.tinker_trainer:app``) and sends it, one at a time and
in the client's order, ``POST <prefix>`` with ``{"op": ..., ...}``; the answer is JSON, or
``{"error", "status"}`` for a request it refuses.

Ops: ``forward_backward`` (``forward_only`` for ``forward``) with the built-in losses, ``optim_step``,
``save`` (the adapter in peft's format, and for ``save_state`` the optimizer's state beside it), ``load``,
``sample`` (the live adapter, a saved one loaded by path, or the base), ``info``.

The losses are Tinker's, summed over tokens (not averaged: the client weights its tokens):

- ``cross_entropy``: ``-Σ w·log p(target)``;
- ``importance_sampling``: ``-Σ w·(p/q)·A``, ``q`` the sampler's probability (``logprobs`` input), ``A`` the
  advantages;
- ``ppo``: ``-Σ w·min(r·A, clip(r, 1-ε_lo, 1+ε_hi)·A)``, ``r = p/q``; the clip thresholds from
  ``loss_fn_config`` (``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2 by default, as ratios).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse


class Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def token_logprobs(model, batch: list[list[int]], targets: list[list[int]], adapter_names: list[str] | None = None):
    """log p(target_t | tokens_≤t) per datum, one padded forward (right padding, attention masked)."""
    import torch

    width = max(len(t) for t in batch)
    ids = torch.tensor([t + [0] * (width - len(t)) for t in batch])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in batch])
    tgt = torch.tensor([t + [0] * (width - len(t)) for t in targets])
    kwargs = {"adapter_names": adapter_names} if adapter_names else {}
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return [lp[i, :len(t)] for i, t in enumerate(batch)]


def datum_loss(loss_fn: str, lp, inputs: dict[str, list], config: dict[str, float]):
    """The per-token loss of one datum (see the module's docstring)."""
    import torch

    w = torch.tensor(inputs["weights"], dtype=torch.float32) if "weights" in inputs else torch.ones_like(lp)
    if loss_fn == "cross_entropy":
        return -lp * w
    q = torch.tensor(inputs["logprobs"], dtype=torch.float32)
    adv = torch.tensor(inputs["advantages"], dtype=torch.float32)
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv) * w
    lo, hi = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv) * w


class Trainer:
    """The model, its LoRA and optimizer; every op under one lock (Serve may call from several threads)."""

    def __init__(self, model_dir: str, *, rank: int, targets: list[str], seed: int | None, threads: int | None = None):
        import peft
        import torch

        from workers.models import load_model, load_tokenizer

        if threads:
            torch.set_num_threads(threads)
        if seed is not None:
            torch.manual_seed(seed)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        base = load_model(model_dir)
        cfg = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=rank, lora_alpha=float(rank), lora_dropout=0.0,
                              target_modules=targets)
        self.model = peft.get_peft_model(base, cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.loaded: dict[str, str] = {}  # sampler adapter name → its folder
        self.lock = threading.Lock()
        self.steps = 0
        self.pending_grads = 0

    # --- training ---

    def forward_backward(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        data, loss_fn, config = body["data"], body["loss_fn"], body.get("loss_fn_config") or {}
        forward_only = bool(body.get("forward_only"))
        self.model.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            lps = token_logprobs(self.model, [d["tokens"] for d in data], [d["inputs"]["target_tokens"] for d in data])
            losses = [datum_loss(loss_fn, lp, d["inputs"], config) for lp, d in zip(lps, data)]
            total = torch.stack([x.sum() for x in losses]).sum()
            if not forward_only:
                total.backward()  # gradients add up until optim_step, as Tinker's do
                self.pending_grads += 1
        outputs = [{"logprobs": lp.detach().tolist(), "elementwise_loss": x.detach().tolist()} for lp, x in zip(lps, losses)]
        return {"outputs": outputs, "metrics": {"loss:sum": float(total.detach())}}

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        p = body["adam_params"]
        for group in self.optimizer.param_groups:
            group.update(lr=p["learning_rate"], betas=(p["beta1"], p["beta2"]), eps=p["eps"], weight_decay=p["weight_decay"])
        metrics: dict[str, float] = {}
        if p["grad_clip_norm"] > 0:
            metrics["grad_norm:mean"] = float(torch.nn.utils.clip_grad_norm_(self.params, p["grad_clip_norm"]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending_grads = 0
        return {"metrics": {**metrics, "step:max": float(self.steps)}}

    # --- checkpoints ---

    def save(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        out = Path(body["folder"])
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        self.model.save_pretrained(str(tmp), save_embedding_layers=False)  # adapter_config.json + adapter_model.safetensors: a servable adapter
        if body.get("optimizer"):
            torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, tmp / "optimizer.pt")
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
        return {"bytes": sum(f.stat().st_size for f in out.iterdir())}

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        folder = Path(body["folder"])
        state = load_file(str(folder / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.model, state)
        if getattr(result, "unexpected_keys", None):
            raise Refused(400, f"the checkpoint's adapter does not fit this training client (rank or targets differ): "
                          f"{len(result.unexpected_keys)} unexpected tensors", "path")
        self.optimizer.zero_grad(set_to_none=True)
        if body.get("optimizer"):
            if not (folder / "optimizer.pt").is_file():
                raise Refused(400, "this checkpoint holds no optimizer state (a sampler checkpoint?)", "optimizer")
            saved = torch.load(folder / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.steps = int(saved.get("steps", 0))
        return {}

    # --- sampling ---

    def _adapter(self, folder: str | None) -> str:
        """The adapter name to sample with: a saved adapter loaded once by its folder, or the base."""
        if folder is None:
            return "__base__"
        import hashlib

        name = "s" + hashlib.sha256(folder.encode()).hexdigest()[:12]
        if name not in self.loaded:
            if not (Path(folder) / "adapter_config.json").is_file():
                raise Refused(404, "the sampler weights are gone from storage", "model_path")
            self.model.load_adapter(folder, adapter_name=name, is_trainable=False)
            self.model.set_adapter("default")  # load_adapter leaves the live adapter the trained one
            for p in self.params:
                p.requires_grad_(True)
            self.loaded[name] = folder
        return name

    def sample(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        adapter = self._adapter(body.get("folder"))
        prompt, n, sp = body["tokens"], int(body["num_samples"]), body["sampling_params"]
        stop = sp.get("stop")
        stop_ids = [t for t in stop if isinstance(t, int)] if isinstance(stop, list) else []
        stop_strs = [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str)]
        if stop is None and self.tokenizer.eos_token_id is not None:
            stop_ids = [self.tokenizer.eos_token_id]
        generator = torch.Generator().manual_seed(int(sp["seed"])) if sp.get("seed") is not None else None
        temperature = float(sp.get("temperature", 1.0))
        self.model.eval()
        seqs = []
        with torch.no_grad():
            for _ in range(n):
                ids = list(prompt)
                out: list[int] = []
                reason = "length"
                for _ in range(int(sp["max_tokens"])):
                    logits = self.model(input_ids=torch.tensor([ids]), adapter_names=[adapter]).logits[0, -1].float()
                    if temperature == 0:
                        tok = int(torch.argmax(logits))
                    else:
                        probs = torch.softmax(_top(logits / temperature, sp), dim=-1)
                        tok = int(torch.multinomial(probs, 1, generator=generator))
                    ids.append(tok)
                    out.append(tok)
                    if tok in stop_ids or (stop_strs and any(s in self.tokenizer.decode(out) for s in stop_strs)):
                        reason = "stop"
                        break
                lps = token_logprobs(self.model, [prompt + out[:-1]], [prompt[1:] + out], [adapter])[0][len(prompt) - 1:]
                seqs.append({"tokens": out, "logprobs": lps.tolist(), "stop_reason": reason})
        self.model.train()
        return {"sequences": seqs}

    def info(self) -> dict[str, Any]:
        import psutil

        trainable = sum(p.numel() for p in self.params)
        return {"steps": self.steps, "trainable_parameters": trainable, "rss_bytes": psutil.Process().memory_info().rss,
                "adapter_bytes": trainable * 4, "optimizer_bytes": 2 * trainable * 4, "pid": os.getpid()}


def _top(logits, sp: dict[str, Any]):
    import torch

    k = int(sp.get("top_k") or -1)
    if 0 < k < logits.numel():
        cut = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    p = float(sp.get("top_p") or 1.0)
    if p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


OPS = ("forward_backward", "optim_step", "save", "load", "sample", "info")


@serve.deployment(max_ongoing_requests=8, health_check_period_s=5)
class TinkerTrainer:
    def __init__(self, model: str, model_path: str | None, rank: int, targets: list[str], seed: int | None = None,
                 threads: int | None = None):
        from workers.models import resolve_model_dir

        model_dir = model_path if model_path and Path(model_path).is_dir() else resolve_model_dir(model, model_path)
        self.trainer = Trainer(model_dir, rank=rank, targets=targets, seed=seed, threads=threads)

    def _run(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.trainer.lock:
            return self.trainer.info() if op == "info" else getattr(self.trainer, op)(body)

    async def __call__(self, request: Request):
        body = await request.json()
        op = body.get("op")
        if op not in OPS:
            return JSONResponse({"error": f"unknown op {op!r}", "status": 400}, status_code=400)
        try:
            return JSONResponse(await asyncio.to_thread(self._run, op, body))
        except Refused as exc:
            return JSONResponse({"error": exc.message, "param": exc.param, "status": exc.status}, status_code=exc.status)


def app(args: dict[str, Any]):
    """The application builder Serve's config names (``workers.tinker_trainer:app``)."""
    return TinkerTrainer.bind(model=args["model"], model_path=args.get("model_path"), rank=int(args["rank"]),
                              targets=list(args["targets"]), seed=args.get("seed"), threads=args.get("threads"))
