"""Checkpoints (resume state) and final artifacts (Hugging Face formats users load).

A checkpoint directory, as Ray Train merges it from every rank's report:
- ``meta.json`` (rank 0): the optimizer step it was taken after, the strategy, tokens so far;
- ``state.pt`` (rank 0, ddp/fsdp): model (or, for PEFT, only the trainable adapter), optimizer and
  scheduler state — gathered to full tensors under FSDP2 so that a different world size can load it;
- ``deepspeed/`` (every rank): DeepSpeed's own sharded checkpoint (engine.save_checkpoint);
- ``rng-rank<r>.pt`` (every rank): that rank's RNG states.
The data position is the step itself: the sampler is a pure function of the step (workers/data.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from workers.args import TrainArgs

DS_TAG = "state"


def write_meta(d: str, step: int, strategy: str, trained_tokens: int, rank: int) -> None:
    if rank == 0:
        Path(d, "meta.json").write_text(json.dumps({"step": step, "strategy": strategy, "trained_tokens": trained_tokens}))


def read_meta(d: str) -> dict:
    return json.loads(Path(d, "meta.json").read_text())


def save_rng(d: str, rank: int) -> None:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, Path(d, f"rng-rank{rank}.pt"))


def load_rng(d: str, rank: int) -> None:
    path = Path(d, f"rng-rank{rank}.pt")
    if not path.exists():  # a checkpoint from a run with fewer ranks: keep the seeded state
        return
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_fsdp2(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_model_state(model, trainable_only: bool) -> dict:
    """The full (unsharded) model state dict on rank 0, on CPU; a collective under FSDP2."""
    if _is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=opts)
    m = unwrap(model)
    sd = m.state_dict()
    if trainable_only:
        keep = {n for n, p in m.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if k in keep}
    return {k: v.detach().cpu() for k, v in sd.items()}


def save_torch_state(d: str, model, optimizer, scheduler, *, step: int, strategy: str, trained_tokens: int,
                     rank: int, trainable_only: bool) -> None:
    """ddp/fsdp: every rank calls this (FSDP2 gathers collectively), rank 0 writes."""
    if _is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    else:
        model_sd = full_model_state(model, trainable_only)
        optim_sd = optimizer.state_dict()
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict()}, Path(d, "state.pt"))
    save_rng(d, rank)
    write_meta(d, step, strategy, trained_tokens, rank)


def load_torch_state(d: str, model, optimizer, scheduler, *, rank: int, trainable_only: bool) -> dict:
    """Every rank reads the full state (the storage is shared) and keeps its own shard of it."""
    state = torch.load(Path(d, "state.pt"), map_location="cpu", weights_only=False)
    if _is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=not trainable_only)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=opts)
    else:
        missing, unexpected = unwrap(model).load_state_dict(state["model"], strict=not trainable_only)
        if unexpected:
            raise RuntimeError(f"checkpoint holds unknown keys: {unexpected[:5]}")
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    load_rng(d, rank)
    return read_meta(d)


# --- final artifacts ----------------------------------------------------------------------------


def export_artifacts(args: TrainArgs, state_dict: dict, model_dir: str, tokenizer) -> dict[str, str]:
    """Rank 0: rebuild the model on CPU from the base, load the trained state and save it in
    Hugging Face format — the adapter (+ merged model where the method allows) or the full model,
    each with the tokenizer. Rebuilding keeps the export independent of how training sharded it.
    After QAT, ``state_dict`` already holds the quantised weights (workers.strategies.qat.qat_export: scale
    × int4 value per group in every quantised linear), so ``model/`` is a stock checkpoint of them."""
    from workers.models import load_model
    from workers.peft_setup import apply_peft, merge_adapter

    out = Path(args.output_dir)
    fresh = load_model(model_dir, args.attention)
    artifacts: dict[str, str] = {}
    if args.is_peft:
        fresh = apply_peft(fresh, args.peft_method, r=args.peft_r, alpha=args.peft_alpha, dropout=args.peft_dropout,
                           targets=args.peft_targets, num_virtual_tokens=args.peft_virtual_tokens)
        trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
        missing = trainable - set(state_dict)
        if missing:
            raise RuntimeError(f"trained state lacks adapter weights: {sorted(missing)[:5]}")
        fresh.load_state_dict({k: v for k, v in state_dict.items() if k in trainable}, strict=False)
        fresh.save_pretrained(out / "adapter")
        tokenizer.save_pretrained(out / "adapter")
        artifacts["adapter"] = "adapter"
        if args.merges_adapter:
            merge_adapter(model_dir, out / "adapter", out / "merged", attention=args.attention)
            tokenizer.save_pretrained(out / "merged")
            artifacts["merged"] = "merged"
    else:
        fresh.load_state_dict(state_dict, strict=True)
        fresh.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        artifacts["model"] = "model"
    return artifacts
