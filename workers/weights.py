"""A model's weights read from its safetensors files: each rank only the part it holds, straight into place,
in the dtype it trains in — never the whole model, never an fp32 copy of a 16-bit checkpoint first.

Why not ``from_pretrained``: it builds the whole model on every rank (transformers 5 reads it memory-mapped,
but every tensor is materialised whole, in the dtype asked for), which is what every rank loading the
model in fp32 before anything is sharded costs: 8 × 27 GB of host memory for Llama-2-7B on one 8-GPU node.
Why not torch's ``HuggingFaceStorageReader`` (torch/distributed/checkpoint/hf_storage.py): it reads through
``safe_open``, a memory map of each whole file, whose pages stay resident in the reading process (they count
in its RSS) until the file is closed, and it needs a template state dict keyed exactly as the files are.

How: :class:`Checkpoint` parses the files' headers (8 bytes of length, then JSON: each tensor's dtype, shape
and byte range) and reads the bytes a rank needs with ``os.preadv`` — through the page cache, which is the
kernel's, not the process's — into the destination tensor's own storage when the dtypes agree, else in
chunks of at most :data:`CHUNK_BYTES` that are cast as they are copied. What a rank holds of each tensor is
described by the tensor itself (:func:`load_into`):

- a plain tensor (DDP, DeepSpeed ZeRO-0/1/2, a pipeline stage's own blocks): the whole tensor;
- a DTensor (FSDP2, tensor parallel, both): the box ``compute_local_shape_and_global_offset`` gives for its
  placements — rows for FSDP2's Shard(0), columns or rows for tensor parallelism;
- a ZeRO-3 parameter (``ds_tensor``): its flat partition, elements ``rank × n … (rank + 1) × n`` of the
  flattened tensor (deepspeed/runtime/zero/partition_parameters.py ``_partition_param``), zero-padded.

The model's names map to the checkpoint's: PEFT's wrapper prefix (``base_model.model.``) and the
``.base_layer`` a LoRA/IA3/LoHa/LoKr layer keeps its base in are dropped, and a checkpoint saved without the
model's base prefix (GPT-2's ``transformer.``, as older hub checkpoints are) is found without it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from workers.models import ModelSourceError

CHUNK_BYTES = 64 << 20  # the most a cast or a column slice holds in a staging buffer

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
WEIGHTS_NAME, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


class WeightsError(ModelSourceError):
    """The checkpoint cannot give what the model needs (no safetensors files, a tensor missing or misshapen):
    the job's ``model_unavailable``, as any model that cannot be loaded."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in ``path``)."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def read_header(path: str | Path) -> tuple[dict, int]:
    """(the header's JSON, the byte offset where the data starts) of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise WeightsError(f"{path} is not a safetensors file (shorter than its header length)")
        n = int.from_bytes(head, "little")
        if not 2 <= n <= 100 << 20:
            raise WeightsError(f"{path} is not a safetensors file (a header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise WeightsError(f"{path} is not a safetensors file (its header is not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{path} is not a safetensors file (its header is not a JSON object)")
        return header, 8 + n


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory: one file, or every shard its index names."""
    d = Path(model_dir)
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME]
    if (d / WEIGHTS_INDEX).is_file():
        shards = sorted(set(json.loads((d / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        return [d / s for s in shards]
    raise WeightsError(f"{d} has no {WEIGHTS_NAME} (or {WEIGHTS_INDEX}): memfit reads weights from safetensors files")


class Checkpoint:
    """Every tensor of a model directory's safetensors files, by name, read a part at a time (module docstring)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)
        self.entries: dict[str, Entry] = {}
        for path in checkpoint_files(model_dir):
            header, start = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise WeightsError(f"{path.name}: tensor {name} has a dtype memfit cannot read ({info['dtype']})")
                lo, hi = info["data_offsets"]
                self.entries[name] = Entry(name, str(path), dtype, tuple(info["shape"]), start + lo, hi - lo)
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def dtypes(self) -> set[torch.dtype]:
        return {e.dtype for e in self.entries.values()}

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise WeightsError(f"the checkpoint in {self.model_dir} has no tensor {name!r}") from None

    # -- raw reads -------------------------------------------------------------------------------

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread_into(self, e: Entry, byte_offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, ``e``'s dtype) with the bytes at ``byte_offset`` of ``e``'s data."""
        if out.numel() == 0:
            return
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.dtype != torch.uint8 \
            else memoryview(out.reshape(-1).numpy())
        fd, pos, done, total = self._fd(e.path), e.offset + byte_offset, 0, view.nbytes
        while done < total:
            n = os.preadv(fd, [view[done:]], pos + done)
            if n <= 0:
                raise WeightsError(f"{e.path}: short read of {e.name} ({done} of {total} bytes)")
            done += n
        self.bytes_read += total

    def read_flat(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``start … start + out.numel()`` of the flattened tensor into ``out`` (1-D, any dtype);
        what lies past the tensor's end is zero (a ZeRO-3 partition's padding)."""
        e = self.entry(name)
        n = max(0, min(out.numel(), e.numel - start))
        if n < out.numel():
            out[n:].zero_()
        self._copy_range(e, start, out[:n])

    def _copy_range(self, e: Entry, start: int, out: torch.Tensor) -> None:
        """Contiguous elements ``start …`` of ``e`` into ``out`` (contiguous, any dtype), cast in chunks."""
        if out.dtype == e.dtype and out.is_contiguous() and out.device.type == "cpu":
            self._pread_into(e, start * e.itemsize, out)
            return
        step = max(1, CHUNK_BYTES // e.itemsize)
        flat = out.view(-1) if out.is_contiguous() else None
        for i in range(0, out.numel(), step):
            n = min(step, out.numel() - i)
            buf = torch.empty(n, dtype=e.dtype)
            self._pread_into(e, (start + i) * e.itemsize, buf)
            if flat is not None:
                flat[i:i + n].copy_(buf)
            else:
                out.view(-1)[i:i + n].copy_(buf)  # pragma: no cover - callers pass contiguous outputs

    def read_box(self, name: str, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        """The sub-tensor starting at ``offsets`` with ``out``'s shape into ``out`` (any dtype). Whole rows
        (every dimension after the first taken whole) are one contiguous range; otherwise rows are read a
        chunk at a time and sliced."""
        e = self.entry(name)
        if len(offsets) != len(e.shape) or any(o + s > d for o, s, d in zip(offsets, out.shape, e.shape)):
            raise WeightsError(f"{name}: the part {tuple(out.shape)} at {offsets} is outside the checkpoint's "
                               f"{e.shape}")
        if out.numel() == 0:
            return
        if not e.shape:  # a scalar
            self._copy_range(e, 0, out.reshape(1))
            return
        row = math.prod(e.shape[1:])
        if tuple(out.shape[1:]) == tuple(e.shape[1:]) and out.is_contiguous():
            self._copy_range(e, offsets[0] * row, out)
            return
        rows = max(1, CHUNK_BYTES // max(1, row * e.itemsize))
        inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], out.shape[1:]))
        for i in range(0, out.shape[0], rows):
            n = min(rows, out.shape[0] - i)
            buf = torch.empty((n, *e.shape[1:]), dtype=e.dtype)
            self._pread_into(e, (offsets[0] + i) * row * e.itemsize, buf)
            out[i:i + n].copy_(buf[(slice(None), *inner)])

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor (in ``dtype``, default the file's)."""
        e = self.entry(name)
        out = torch.empty(e.shape, dtype=dtype or e.dtype)
        self.read_box(name, (0,) * len(e.shape), out)
        return out


# --- model names and the checkpoint's ---------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def checkpoint_name(fqn: str) -> str:
    """The base model's name of a parameter of the (possibly PEFT-wrapped) model: PEFT's prefix and the
    ``.base_layer`` its layers keep the base module in dropped."""
    name = fqn[len(PEFT_PREFIX):] if fqn.startswith(PEFT_PREFIX) else fqn
    return name.replace(".base_layer.", ".")


def find_name(ckpt: Checkpoint, fqn: str, base_prefix: str | None) -> str | None:
    """The checkpoint's name for the model's ``fqn``, or None when it has none."""
    name = checkpoint_name(fqn)
    if name in ckpt.entries:
        return name
    if base_prefix:
        if name.startswith(base_prefix + "."):
            short = name[len(base_prefix) + 1:]
            if short in ckpt.entries:
                return short
        elif f"{base_prefix}.{name}" in ckpt.entries:
            return f"{base_prefix}.{name}"
    # A prompt-learning PeftModel (prompt, prefix, p-tuning) wraps the causal LM itself as ``base_model``:
    # its head is ``base_model.lm_head``, not LoRA's ``base_model.model.lm_head``.
    if fqn.startswith("base_model.") and not fqn.startswith(PEFT_PREFIX):
        short = fqn[len("base_model."):].replace(".base_layer.", ".")
        if short in ckpt.entries:
            return short
    return None


# --- what a rank holds of a tensor, and loading it --------------------------------------------------


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None, int | None]:
    """(the tensor this rank's bytes live in, the global offsets of its box, or the flat start of a ZeRO-3
    partition). A plain tensor is its own box at 0."""
    ds = getattr(t, "ds_tensor", None)
    if ds is not None:  # ZeRO-3: a flat partition of the flattened tensor
        import deepspeed.comm as ds_dist

        group = getattr(t, "ds_process_group", None)
        rank = ds_dist.get_rank(group=group)
        return ds, None, rank * ds.ds_numel
    if type(t).__name__ == "DTensor" or hasattr(t, "device_mesh") and hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) != tuple(local.shape):
            raise WeightsError(f"a DTensor's local shard {tuple(local.shape)} is not the box {tuple(shape)} its "
                               f"placements {t.placements} give")
        return local, tuple(offsets), None
    return t, (0,) * t.dim(), None


@torch.no_grad()
def load_tensor(ckpt: Checkpoint, name: str, t: torch.Tensor,
                transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Fill this rank's part of ``t`` (a parameter or buffer) from the checkpoint's ``name``; returns the
    bytes it holds. ``transform`` (the whole tensor → the whole tensor as the model holds it, e.g. tensor
    parallelism's regrouped GPT-2 attention) reads the whole tensor first."""
    e = ckpt.entry(name)
    if tuple(t.shape) != e.shape and getattr(t, "ds_shape", None) is None:
        raise WeightsError(f"{name}: the model's {tuple(t.shape)} is not the checkpoint's {e.shape}")
    if str(getattr(getattr(t, "ds_tensor", None), "final_location", None)).endswith("nvme"):
        return _load_swapped(ckpt, name, t, transform)
    local, offsets, flat_start = local_part(t)
    if transform is not None:
        whole = transform(ckpt.read(name))
        if flat_start is not None:
            flat = whole.reshape(-1)[flat_start:flat_start + local.numel()]
            local[:flat.numel()].copy_(flat)
            local[flat.numel():].zero_()
        else:
            local.copy_(whole[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))])
        return local.numel() * local.element_size()
    if flat_start is not None:
        ckpt.read_flat(name, flat_start, local.view(-1))
    elif local.is_contiguous():
        ckpt.read_box(name, offsets, local)
    else:  # pragma: no cover - FSDP2 and DTensor locals are contiguous
        staged = torch.empty(local.shape, dtype=local.dtype)
        ckpt.read_box(name, offsets, staged)
        local.copy_(staged)
    return local.numel() * local.element_size()


def _load_swapped(ckpt: Checkpoint, name: str, t: torch.Tensor, transform=None) -> int:
    """A ZeRO-3 parameter whose partition lives on the disk (ZeRO-Infinity's nvme offload): gathered whole, filled
    by the first rank of its group from the checkpoint, and partitioned again by DeepSpeed, which broadcasts it
    and swaps each rank's partition out (one parameter whole at a time on every rank)."""
    import deepspeed
    import deepspeed.comm as ds_dist

    with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
        if ds_dist.get_rank(group=getattr(t, "ds_process_group", None)) == 0:
            if transform is not None:
                t.data.copy_(transform(ckpt.read(name)))
            else:
                ckpt.read_box(name, (0,) * t.data.dim(), t.data)
    return t.ds_tensor.ds_numel * t.element_size()


def named_tensors(model) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once (a tied weight under its first name)."""
    seen: set[int] = set()
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def base_prefix(model) -> str | None:
    from workers.peft_setup import language_model

    return getattr(language_model(model), "base_model_prefix", None)


def is_meta(t: torch.Tensor) -> bool:
    if getattr(t, "ds_tensor", None) is not None:
        return False
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.device.type == "meta"


@torch.no_grad()
def snapshot_real(model) -> dict[str, torch.Tensor]:
    """Copies of the tensors a meta-built model holds for real (buffers computed at build, a fresh adapter
    PEFT initialised): what ``to_empty`` would wipe and the checkpoint does not have."""
    return {name: t.detach().clone() for name, t in named_tensors(model) if not is_meta(t)}


@dataclass
class LoadReport:
    """What one rank read: bytes from the files, bytes it holds, tensors read, tensors taken from the snapshot."""

    bytes_read: int = 0
    bytes_held: int = 0
    tensors: int = 0
    from_snapshot: int = 0
    checkpoint_bytes: int = 0
    largest_tensor_bytes: int = 0


def tied_aliases(model) -> dict[str, list[str]]:
    """Every name of a parameter known under several (a tied embedding and LM head): name -> the others.
    A pipeline stage keeps only one of them once the other's module is gone: its checkpoint name may be the other."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}


def tied_duplicates(model) -> set[str]:
    """The base model's names of a shared parameter after its first (what ``save_pretrained`` leaves out: a tied
    LM head's ``lm_head.weight``)."""
    first: dict[int, str] = {}
    out: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.add(checkpoint_name(name))
        else:
            first[id(p)] = name
    return out


def to_empty(model, device) -> None:
    """``model.to_empty(device=device)``, keeping one Parameter for a tied pair: for a parameter on the meta
    device ``Module._apply`` makes a new Parameter in each module that holds it (a meta tensor cannot take a
    host tensor's data in place), which would untie the embedding and the LM head."""
    groups = [[n, *others] for n, others in tied_aliases(model).items() if all(n < o for o in others)]
    model.to_empty(device=device)
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            if model.get_parameter(name) is not first:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, attr, first)


def pending(model) -> set[str]:
    """The names of what the checkpoint must fill: meta tensors (to be made empty) and ZeRO-3 partitions."""
    return {name for name, t in named_tensors(model) if is_meta(t) or getattr(t, "ds_tensor", None) is not None}


@torch.no_grad()
def load_model_weights(model, model_dir: str, *, snapshot: dict[str, torch.Tensor] | None = None,
                       transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                       only: set[str] | None = None, aliases: dict[str, list[str]] | None = None) -> LoadReport:
    """Fill what this rank holds of ``model``'s parameters and buffers: from ``snapshot`` (by the model's name)
    where it has the tensor, else from the checkpoint in ``model_dir``. ``only``: the names to fill (default
    every one; :func:`pending` taken before ``to_empty``). ``transforms``: see :func:`load_tensor` (by the
    model's name). ``aliases``: other names of the same tensor (:func:`tied_aliases`)."""
    report = LoadReport()
    snapshot = snapshot or {}
    prefix = base_prefix(model)
    try:
        ckpt = Checkpoint(model_dir)
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read the weights in {model_dir}: {exc}") from None
    with ckpt:
        report.checkpoint_bytes = ckpt.total_bytes
        report.largest_tensor_bytes = max((e.nbytes for e in ckpt.entries.values()), default=0)
        missing = []
        for fqn, t in named_tensors(model):
            if fqn in snapshot:
                local, offsets, flat_start = local_part(t)
                src = snapshot[fqn]
                if flat_start is not None:
                    flat = src.reshape(-1)[flat_start:flat_start + local.numel()]
                    local.view(-1)[:flat.numel()].copy_(flat)
                else:
                    local.copy_(src[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))])
                report.from_snapshot += 1
                continue
            if only is not None and fqn not in only:
                continue
            name = next((n for n in (find_name(ckpt, a, prefix) for a in (fqn, *(aliases or {}).get(fqn, ())))
                         if n is not None), None)
            if name is None:
                missing.append(fqn)
                continue
            report.bytes_held += load_tensor(ckpt, name, t, (transforms or {}).get(fqn))
            report.tensors += 1
        if missing:
            raise WeightsError(f"the checkpoint in {model_dir} has no tensor for {len(missing)} of the model's, "
                               f"e.g. {', '.join(missing[:3])}")
        report.bytes_read = ckpt.bytes_read
    return report
