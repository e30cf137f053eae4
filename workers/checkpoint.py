"""Checkpoints (resume state) and final artifacts (Hugging Face formats users load).

A checkpoint directory, as Ray Train merges it from every rank's report:
- ``meta.json`` (rank 0): the optimizer step it was taken after, the strategy, tokens so far;
- ``dcp/`` (every rank, fsdp): model (or, for PEFT, only the trainable adapter) and optimizer state
  as a ``torch.distributed.checkpoint`` folder — each rank writes only its own shard
  (``__<rank>_0.distcp``), rank 0 the ``.metadata`` that maps every tensor's pieces; each rank reads
  back only the pieces of its shard, at any world size (DCP reshards by the global offsets);
- ``scheduler.pt`` (rank 0, fsdp): the schedule's state;
- ``state.pt`` (rank 0, ddp — and fsdp checkpoints made before ``dcp/``, still read): model,
  optimizer and scheduler state as full tensors;
- ``deepspeed/`` (every rank): DeepSpeed's own sharded checkpoint (engine.save_checkpoint);
- ``rng-rank<r>.pt`` (every rank): that rank's RNG states.
The data position is the step itself: the sampler is a pure function of the step (workers/data.py).

A full storage volume never leaves something half-written that looks finished: a checkpoint upload
that hits ENOSPC removes its folder (:func:`persist_checkpoint`, so Ray never registers it and the
artifacts routes never list it), and each exported folder is written under a hidden ``.<name>.part``
name and renamed into place whole (:func:`_publish_folder`). Both raise :class:`StorageFullError`,
naming what was being written and where; workers/run.py turns it into the job's ``storage_full``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import torch

from service.domain.errors import find_storage_full, is_storage_full
from workers.args import TrainArgs

DS_TAG = "state"


class StorageFullError(OSError):
    """No space left on the storage volume for ``what``; ``str()`` names it and the path. An OSError
    with errno ENOSPC, so that it survives pickling through Ray and reads as one everywhere."""

    phase: str | None = None  # "checkpoint" or "export"

    @classmethod
    def writing(cls, what: str, path: str | Path, cause: BaseException, phase: str) -> "StorageFullError":
        detail = " ".join(str(cause).split())[:300]
        exc = cls(errno.ENOSPC, f"no space left on the storage volume while writing {what} to {path} ({detail})",
                  str(path))
        exc.phase = phase
        return exc


def persist_checkpoint(checkpoint, dir_name: str):
    """``ray.train.report``'s ``checkpoint_upload_fn``: Ray's own upload, except that a full storage
    volume leaves no partial checkpoint folder behind (every rank uploads into the same folder; the
    first to fail removes it) and raises StorageFullError naming it."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    try:
        return storage.persist_current_checkpoint(checkpoint, dir_name)
    except OSError as exc:
        if not is_storage_full(exc):
            raise
        dest = storage.build_checkpoint_path_from_name(dir_name)
        with contextlib.suppress(Exception):  # already gone (another rank), or not removable
            storage.storage_filesystem.delete_dir(dest)
        raise StorageFullError.writing(f"checkpoint {dir_name}", dest, exc, "checkpoint") from exc


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


SHARDED_DIR = "dcp"


def save_torch_state(d: str, model, optimizer, scheduler, *, step: int, strategy: str, trained_tokens: int,
                     rank: int, trainable_only: bool) -> None:
    """ddp/fsdp: every rank calls this. FSDP2: each rank writes its own shard (:func:`save_sharded_state`);
    ddp: rank 0 writes the full state (every replica holds all of it anyway)."""
    if _is_fsdp2(model):
        save_sharded_state(d, model, optimizer, scheduler, rank=rank, trainable_only=trainable_only)
    else:
        save_full_state(d, model, optimizer, scheduler, rank=rank, trainable_only=trainable_only)
    save_rng(d, rank)
    write_meta(d, step, strategy, trained_tokens, rank)


def load_torch_state(d: str, model, optimizer, scheduler, *, rank: int, trainable_only: bool) -> dict:
    """The checkpoint's own format decides: ``dcp/`` (each rank reads its shard) or ``state.pt`` (every
    rank reads the whole file and keeps its shard; ddp, and fsdp checkpoints made before ``dcp/``)."""
    if Path(d, SHARDED_DIR, ".metadata").is_file():
        load_sharded_state(d, model, optimizer, scheduler, trainable_only=trainable_only)
    else:
        load_full_state(d, model, optimizer, scheduler, trainable_only=trainable_only)
    load_rng(d, rank)
    return read_meta(d)


def _sharded_options(trainable_only: bool, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # PEFT: the frozen base is the model's own (rebuilt from the base on resume): only the adapter.
    return StateDictOptions(ignore_frozen_params=trainable_only, **kw)


def save_sharded_state(d: str, model, optimizer, scheduler, *, rank: int, trainable_only: bool) -> None:
    """FSDP2: model and optimizer state as DTensor shards through ``torch.distributed.checkpoint`` —
    no gather, each rank writes only the bytes it holds, into its own ``d/dcp`` (Ray Train merges
    every rank's folder into one checkpoint); rank 0 adds the ``.metadata`` and ``scheduler.pt``.
    A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_sharded_options(trainable_only))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(Path(d, SHARDED_DIR)))
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict()}, Path(d, "scheduler.pt"))


def load_sharded_state(d: str, model, optimizer, scheduler, *, trainable_only: bool) -> None:
    """FSDP2: each rank asks DCP for the pieces of its own shards (the templates are this run's
    DTensors, so a different world size reads different pieces of the same files) and loads them in
    place; the optimizer's states are created first (a zero-lr step) so there is a template for them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_sharded_options(trainable_only))
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(Path(d, SHARDED_DIR)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_sharded_options(trainable_only, strict=not trainable_only))
    scheduler.load_state_dict(torch.load(Path(d, "scheduler.pt"), weights_only=False)["scheduler"])


def save_full_state(d: str, model, optimizer, scheduler, *, rank: int, trainable_only: bool) -> None:
    """``state.pt``: the full state on rank 0 (gathered there under FSDP2 — host memory of the whole
    model and optimizer on rank 0: the ddp format, and what fsdp wrote before ``dcp/``)."""
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


def load_full_state(d: str, model, optimizer, scheduler, *, trainable_only: bool) -> None:
    """``state.pt``: every rank reads the full state (the storage is shared) and keeps its own shard of it."""
    state = torch.load(Path(d, "state.pt"), map_location="cpu", weights_only=False)
    if _is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=not trainable_only)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=_keyed_by_name(state["optimizer"], model), options=opts)
    else:
        missing, unexpected = unwrap(model).load_state_dict(state["model"], strict=not trainable_only)
        if unexpected:
            raise RuntimeError(f"checkpoint holds unknown keys: {unexpected[:5]}")
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def _keyed_by_name(optim_sd: dict, model) -> dict:
    """A ddp checkpoint's optimizer state, keyed as FSDP2's ``set_state_dict`` reads it. torch's
    ``Optimizer.state_dict()`` numbers the parameters in the order the optimizer got them — ddp's
    ``make_optimizer`` passes the trainable ``model.parameters()`` — while torch.distributed.checkpoint
    keys state and param groups by parameter name (state_dict.py: ``_load_optim_state_dict``). The
    FSDP2 model names its parameters as the unwrapped model did, in the same order, so number i is
    the i-th trainable name: this is what lets a job that started under ddp resume under fsdp (an
    out-of-memory downshift, service/memory/downshift.py). A state already keyed by name is returned as is."""
    if not all(isinstance(k, int) for k in optim_sd.get("state", {})) or not optim_sd.get("param_groups"):
        return optim_sd
    if not all(isinstance(i, int) for g in optim_sd["param_groups"] for i in g["params"]):
        return optim_sd
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"state": {names[i]: s for i, s in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}


# --- final artifacts ----------------------------------------------------------------------------


def quantized_from(args: TrainArgs):
    """QLoRA: the dtype the worker loaded the base in before quantising it (its regime's compute dtype); else None."""
    if args.peft_method != "qlora":
        return None
    from service.domain.training import regime

    return getattr(torch, regime(args.strategy, args.peft_method, args.precision).compute_dtype)  # "bfloat16" …


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
        _publish_folder(out, "adapter", lambda d: (fresh.save_pretrained(d), tokenizer.save_pretrained(d)))
        artifacts["adapter"] = "adapter"
        if args.merges_adapter:
            _publish_folder(out, "merged", lambda d: (
                merge_adapter(model_dir, out / "adapter", d, attention=args.attention,
                             quantized_from=quantized_from(args)), tokenizer.save_pretrained(d)))
            artifacts["merged"] = "merged"
    else:
        fresh.load_state_dict(state_dict, strict=True)
        _publish_folder(out, "model", lambda d: (fresh.save_pretrained(d), tokenizer.save_pretrained(d)))
        artifacts["model"] = "model"
    return artifacts


EXPORT_SHARD_BYTES = 1 << 30  # one safetensors file of the streamed export: the most rank 0 holds at once


def export_model_streamed(args: TrainArgs, model, model_dir: str, tokenizer, rank: int,
                          max_shard_bytes: int = EXPORT_SHARD_BYTES, restore=None) -> dict[str, str]:
    """FSDP2, full fine-tune: the ``model/`` folder gathered once and streamed to disk. Every rank
    gathers one tensor at a time (``DTensor.full_tensor()``, a collective, in state-dict order);
    rank 0 collects them into the next safetensors file and writes it when it reaches
    ``max_shard_bytes``, so no process ever holds more than one file plus one tensor — not the model.
    The files, their index and the config are what ``save_pretrained`` writes for the same weights
    (fp32, tied weights once); ``from_pretrained`` loads the folder. A collective: every rank calls it.
    ``restore(name, tensor)``, where given, turns a gathered tensor back into the model's own layout
    (the tensor strategy's regrouped GPT-2 c_attn)."""
    tensors = _export_tensors(model)
    shards = _plan_shards(tensors, max_shard_bytes)

    def gather_and_write(d: Path | None) -> None:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            shard: dict[str, torch.Tensor] = {}
            for name in names:
                full = _full_tensor(tensors[name])  # every rank: the all-gather of this one tensor
                if d is not None:
                    shard[name] = restore(name, full) if restore else full
                    weight_map[name] = fname
                del full
            if d is not None:
                from safetensors.torch import save_file

                save_file(shard, str(d / fname), metadata={"format": "pt"})
            shard.clear()
        if d is None:
            return
        if len(shards) > 1:
            total = sum(_export_bytes(t) for t in tensors.values())
            Path(d, "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        _write_model_config(model_dir, d)
        tokenizer.save_pretrained(d)

    if rank == 0:
        _publish_folder(Path(args.output_dir), "model", gather_and_write)
        return {"model": "model"}
    gather_and_write(None)
    return {}


def _export_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict as saved to Hugging Face files: DTensor shards (not gathered) and
    replicated buffers under their FQNs; a tied weight (one Parameter under two names) once, under
    its first name — the one ``save_pretrained`` keeps (``model.embed_tokens.weight``, not ``lm_head``)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _export_dtype(t: torch.Tensor) -> torch.dtype:
    # The export holds fp32 floats, like the model export_artifacts rebuilds (load_model is fp32).
    return torch.float32 if t.is_floating_point() else t.dtype


def _export_bytes(t: torch.Tensor) -> int:
    return t.numel() * torch.empty((), dtype=_export_dtype(t)).element_size()  # global numel for a DTensor


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names per file, in order, each file at most ``max_shard_bytes`` (a larger tensor gets its own),
    from the global shapes alone — so every rank knows the plan before gathering anything."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        b = _export_bytes(t)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu", dtype=_export_dtype(full)).contiguous()


def _write_model_config(model_dir: str, d: Path) -> None:
    """The base's config (and generation config) as the rebuilt fp32 model would save them."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.dtype = torch.float32
    config.save_pretrained(d)
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # the base has none: derive it as save_pretrained does
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(d)


def _publish_folder(out: Path, name: str, write: Callable[[Path], object]) -> Path:
    """``write`` the folder ``out/name`` under the hidden name ``.name.part`` (which the artifacts
    routes never serve), then rename it into place; on any failure the partial folder is removed, and
    a full volume raises StorageFullError naming the folder."""
    final, partial = out / name, out / f".{name}.part"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        write(partial)
        if final.exists():  # a re-export (a resumed run that finished before): replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if find_storage_full(exc) is not None:
            raise StorageFullError.writing(f"the final {name} folder", final, exc, "export") from exc
        raise
    return final
