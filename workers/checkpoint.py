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
name and renamed into place whole (workers/storage.py :func:`publish_folder`). Both raise :class:`StorageFullError`,
naming what was being written and where; workers/run.py turns it into the job's ``storage_full``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import torch

from service.domain.disk import folder_bytes
from service.domain.errors import is_storage_full
from workers.args import TrainArgs
from workers.storage import StorageFullError, check_storage_budget, publish_folder as _publish_folder  # noqa: F401 - imported from here too

DS_TAG = "state"


def persist_checkpoint(checkpoint, dir_name: str):
    """``ray.train.report``'s ``checkpoint_upload_fn``: Ray's own upload, except that it is refused
    before a byte is written when the tenant's storage quota has no room for it (StorageQuotaError),
    and a full storage volume leaves no partial checkpoint folder behind (every rank uploads into the
    same folder; the first to fail removes it) and raises StorageFullError naming it."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    check_storage_budget(f"checkpoint {dir_name}", folder_bytes(Path(checkpoint.path)),
                         os.environ.get("MEMFIT_ATTEMPT_DIR"), "checkpoint", storage.build_checkpoint_path_from_name(dir_name))
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


def safe_load(path: str | Path, map_location="cpu", allow: tuple = ()):
    """Every checkpoint file memfit reads back goes through here: ``torch.load(weights_only=True)``,
    which unpickles tensors and plain containers (dicts, lists, tuples, numbers, strings) and refuses
    anything else — a pickle that would import or call code raises ``UnpicklingError`` before it runs.
    A checkpoint folder is shared storage a run wrote and the next attempt links in; what it holds is
    data, never code. Model, optimizer, schedule and RNG state are all saved in forms this loads.
    ``allow``: classes a library's own checkpoint holds by name (DeepSpeed's, below), allowed as data."""
    if allow:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True)
    return torch.load(path, map_location=map_location, weights_only=True)


def deepspeed_safe_globals() -> tuple:
    """The classes DeepSpeed pickles into its checkpoints (the loss scaler, the ZeRO stage enum, the
    fragment addresses of its parameter map): data classes, allowed by name and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


def load_deepspeed_safely(engine) -> None:
    """DeepSpeed reads its checkpoint files through ``engine.checkpoint_engine.load`` with
    ``weights_only=False``: make that read :func:`safe_load` (call before ``engine.load_checkpoint``)."""
    allow = deepspeed_safe_globals()
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_load(
        path, map_location=map_location or "cpu", allow=allow)


def save_rng(d: str, rank: int) -> None:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, Path(d, f"rng-rank{rank}.pt"))


def load_rng(d: str, rank: int) -> None:
    path = Path(d, f"rng-rank{rank}.pt")
    if not path.exists():  # a checkpoint from a run with fewer ranks: keep the seeded state
        return
    state = safe_load(path)
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
    scheduler.load_state_dict(safe_load(Path(d, "scheduler.pt"))["scheduler"])


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
    state = safe_load(Path(d, "state.pt"))
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
    """Rank 0: the Hugging Face folders users load, streamed (workers/export.py), in the base checkpoint's
    dtype. PEFT: ``state_dict`` holds the trained adapter (small, gathered whole); the adapter folder and,
    where the method merges, the merged model, each base tensor read from the checkpoint and merged as it is
    written. A full fine-tune: ``state_dict`` holds the model's tensors whole (a tied weight once, as
    ``save_pretrained`` keeps it), written one at a time. After QAT, ``state_dict`` holds the quantised weights
    (workers.strategies.qat.qat_export: scale × int4 value per group in every quantised linear), so ``model/``
    is a stock checkpoint of them."""
    from workers.export import checkpoint_dtypes, export_peft, specs_for, write_folder
    from workers.models import empty_model
    from workers.weights import checkpoint_name, tied_duplicates

    if args.is_peft:
        return export_peft(args, state_dict, model_dir, tokenizer, quantized_from(args))
    # A tied weight under its second name is left out, as save_pretrained leaves it. Which names those are
    # comes from the model as its config builds it (on the meta device): a gathered FSDP2 state dict holds
    # separate CPU copies of a tied pair, so the tensors cannot tell.
    tied = tied_duplicates(empty_model(model_dir))
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in state_dict.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else (name,)
        if key in seen or checkpoint_name(name) in tied:
            continue
        seen.add(key)
        state[checkpoint_name(name)] = t
    dtypes = checkpoint_dtypes(model_dir)
    return write_folder(Path(args.output_dir), "model", specs_for(state, dtypes), iter(state.items()), model_dir,
                        tokenizer, dtypes, rank=0)


def export_model(args: TrainArgs, model, model_dir: str, tokenizer, rank: int, *, restore=None, zero3: bool = False,
                 max_shard_bytes: int | None = None) -> dict[str, str]:
    """A full fine-tune's ``model/`` folder streamed from where the weights live, one tensor at a time, in the
    base checkpoint's dtype (workers/export.py): the rank's own module (DDP, ZeRO-0/1/2), a DTensor gathered
    by every rank (FSDP2, tensor parallel), a ZeRO-3 parameter gathered alone (``zero3``). Rank 0 writes; no
    rank holds more than one tensor beyond its own state. A collective: every rank calls it.
    ``restore(name, tensor)``, where given, turns a gathered tensor back into the model's own layout (the
    tensor strategy's regrouped GPT-2 c_attn)."""
    from workers.export import (
        EXPORT_SHARD_BYTES,
        checkpoint_dtypes,
        module_tensors,
        specs_for,
        unique_state,
        write_folder,
        zero3_tensors,
    )

    state = unique_state(unwrap(model))
    dtypes = checkpoint_dtypes(model_dir)
    tensors = zero3_tensors(state, rank) if zero3 else module_tensors(state, restore)
    return write_folder(Path(args.output_dir), "model", specs_for(state, dtypes), tensors, model_dir, tokenizer,
                        dtypes, rank, max_shard_bytes or EXPORT_SHARD_BYTES)


def export_model_streamed(args: TrainArgs, model, model_dir: str, tokenizer, rank: int,
                          max_shard_bytes: int | None = None, restore=None) -> dict[str, str]:
    """FSDP2 and tensor parallel, full fine-tune: :func:`export_model` (its DTensors gathered one at a time)."""
    return export_model(args, model, model_dir, tokenizer, rank, restore=restore, max_shard_bytes=max_shard_bytes)
