"""Final models written by streaming: safetensors files (and their index) written tensor by tensor, in the base
checkpoint's own dtype (bf16 for a bf16 checkpoint), a PEFT adapter merged into each weight as that weight is
written — no rank ever holds the whole model, and nothing is rebuilt in fp32.

What each export holds at most, beyond the rank's steady state (service/memory/host.py plans it):

- :class:`ShardedWriter` plans every file from the tensors' names, dtypes and shapes before the first byte
  (so every rank knows the plan, and each file's header is written first), then writes each tensor's bytes
  as it comes: one tensor at a time, never a whole file in memory;
- a full fine-tune's tensors come one at a time from where they live (:func:`module_tensors`): the rank's
  own module (DDP, ZeRO-0/1/2, QAT), a DTensor gathered by every rank (FSDP2, tensor parallel), a ZeRO-3
  parameter gathered under ``GatheredParameters`` (:func:`zero3_tensors`), or a pipeline stage's own tensor
  sent to rank 0 (workers/strategies/pipeline.py);
- a merged PEFT export (:func:`merged_tensors`) needs no gather at all: the frozen base is unchanged by
  training, so rank 0 reads each base tensor from the checkpoint's files (workers/weights.py), merges the
  trained adapter into it with peft's own ``merge`` (LoRA, IA3, LoHa, LoKr; QLoRA into the NF4-rounded
  weight it trained against) in fp32, and writes it in the checkpoint's dtype: one tensor and its merge at a time.

The folder is what ``save_pretrained`` writes for the same weights (config, generation config, files, index
when there are several) plus the tokenizer; ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from workers.weights import TORCH_TO_SAFETENSORS, Checkpoint, checkpoint_name

EXPORT_SHARD_BYTES = 1 << 30  # the most one safetensors file of an export holds (service/memory/host.py mirrors it)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the export: its name in the files, and the dtype and shape it is written in."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_files(specs: list[TensorSpec], max_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """The files, in order, each at most ``max_bytes`` (a larger tensor gets a file of its own), named as
    ``save_pretrained`` names them."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    n = len(groups)
    return [("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", g)
            for i, g in enumerate(groups)]


def _header(specs: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": TORCH_TO_SAFETENSORS[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return len(raw).to_bytes(8, "little") + raw


class ShardedWriter:
    """Writes the planned files into ``folder`` one tensor at a time, in the planned order (``add``), then
    the index (``close``)."""

    def __init__(self, folder: Path, specs: list[TensorSpec], max_bytes: int = EXPORT_SHARD_BYTES):
        self.folder = Path(folder)
        self.files = plan_files(specs, max_bytes)
        self._queue: list[tuple[int, TensorSpec]] = [(i, s) for i, (_, g) in enumerate(self.files) for s in g]
        self._next = 0
        self._file = None
        self._file_index = -1
        self.written_bytes = 0
        self.largest_tensor_bytes = 0

    @property
    def expected(self) -> TensorSpec | None:
        return self._queue[self._next][1] if self._next < len(self._queue) else None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        i, spec = self._queue[self._next]
        if name != spec.name:
            raise RuntimeError(f"export: got {name!r} where the plan has {spec.name!r}")
        if tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"export: {name} is {tuple(tensor.shape)}, the plan says {spec.shape}")
        if i != self._file_index:
            self._open(i)
        data = tensor.detach().to("cpu", spec.dtype).contiguous()
        raw = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
        self._file.write(memoryview(raw.numpy()))
        self.written_bytes += spec.nbytes
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, spec.nbytes)
        self._next += 1

    def _open(self, i: int) -> None:
        if self._file is not None:
            self._file.close()
        fname, group = self.files[i]
        self._file = open(self.folder / fname, "wb")
        self._file.write(_header(group))
        self._file_index = i

    def close(self) -> None:
        if self._next != len(self._queue):
            missing = [s.name for _, s in self._queue[self._next:]]
            raise RuntimeError(f"export: {len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        if self._file is not None:
            self._file.close()
            self._file = None
        if len(self.files) > 1:
            total = sum(s.nbytes for _, g in self.files for s in g)
            weight_map = {s.name: fname for fname, g in self.files for s in g}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


# --- the export's dtypes and config -------------------------------------------------------------------


def checkpoint_dtypes(model_dir: str) -> dict[str, torch.dtype]:
    """Each base tensor's dtype in the checkpoint (empty when the checkpoint is not safetensors)."""
    try:
        with Checkpoint(model_dir) as ckpt:
            return {n: e.dtype for n, e in ckpt.entries.items()}
    except Exception:  # noqa: BLE001 - a .bin checkpoint: the tensors keep their own floating dtype
        return {}


def export_dtype(name: str, tensor: torch.Tensor, dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The base checkpoint's dtype of this tensor (a bf16 checkpoint exports bf16), else the tensor's own."""
    return dtypes.get(name, tensor.dtype)


def write_config(model_dir: str, d: Path, dtypes: dict[str, torch.dtype]) -> None:
    """The base's config (and generation config), its dtype the weights' (as ``save_pretrained`` records it)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    floats = {t for t in dtypes.values() if t.is_floating_point}
    if len(floats) == 1:
        config.dtype = next(iter(floats))
    config.save_pretrained(d)
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # the base has none: derive it as save_pretrained does
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(d)


# --- where a full fine-tune's tensors come from -------------------------------------------------------


def unique_state(model) -> dict[str, torch.Tensor]:
    """The model's state dict as saved to Hugging Face files: each tensor once (a tied weight under its first
    name, the one save_pretrained keeps), DTensors and ZeRO-3 parameters not gathered, under the base's names."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[checkpoint_name(name)] = t
    return out


def specs_for(state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> list[TensorSpec]:
    out = []
    for name, t in state.items():
        shape = tuple(getattr(t, "ds_shape", None) or t.shape)
        out.append(TensorSpec(name, export_dtype(name, t, dtypes), shape))
    return out


def module_tensors(state: dict[str, torch.Tensor], restore: Callable | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, one at a time: a DTensor gathered (a collective every rank runs, in this order), a
    plain tensor as it is; ``restore(name, tensor)`` puts a rearranged tensor back in the model's own layout."""
    for name, t in state.items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        full = full.detach()
        yield name, (restore(name, full) if restore else full)


def zero3_tensors(state: dict[str, torch.Tensor], rank: int) -> Iterator[tuple[str, torch.Tensor | None]]:
    """ZeRO-3: each parameter gathered alone (``GatheredParameters``, a collective), copied on rank 0 and
    released before the next; other ranks get None."""
    import deepspeed

    for name, t in state.items():
        if getattr(t, "ds_tensor", None) is not None:
            with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                yield name, (t.detach().to("cpu", copy=True) if rank == 0 else None)
        else:
            yield name, (t.detach() if rank == 0 else None)


def write_folder(out: Path, name: str, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor | None]],
                 model_dir: str, tokenizer, dtypes: dict[str, torch.dtype], rank: int,
                 max_bytes: int = EXPORT_SHARD_BYTES) -> dict[str, str]:
    """The folder ``out/name`` from ``tensors`` (in ``specs``' order), written by rank 0; every rank runs the
    iteration (its collectives). Published atomically (workers/storage.py publish_folder)."""
    from workers.storage import publish_folder

    if rank != 0:
        for _ in tensors:
            pass
        return {}

    def write(d: Path) -> None:
        writer = ShardedWriter(d, specs, max_bytes)
        for tname, t in tensors:
            writer.add(tname, t)
            del t
        writer.close()
        write_config(model_dir, d, dtypes)
        tokenizer.save_pretrained(d)

    publish_folder(out, name, write)
    return {name: name}


# --- PEFT: the adapter, and the merged model streamed from the base's files ----------------------------


def fresh_peft_model(args, model_dir: str, adapter_state: dict[str, torch.Tensor]):
    """The job's PEFT model on a base built empty (nothing of it in memory), its adapter the trained one."""
    from workers.models import empty_model
    from workers.peft_setup import apply_peft

    base = empty_model(model_dir, args.attention, torch.float32)
    model = apply_peft(base, args.peft_method if args.peft_method != "qlora" else "lora", r=args.peft_r,
                       alpha=args.peft_alpha, dropout=args.peft_dropout, targets=args.peft_targets,
                       num_virtual_tokens=args.peft_virtual_tokens)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = trainable - set(adapter_state)
    if missing:
        raise RuntimeError(f"trained state lacks adapter weights: {sorted(missing)[:5]}")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in trainable:
                p.copy_(adapter_state[n])
    return model


def save_adapter(model, d: Path, tokenizer) -> None:
    """The adapter folder peft writes (adapter_config.json, adapter_model.safetensors), from a model whose base
    is on the meta device: only the adapter's tensors are read."""
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)


def _nf4_rounded(weight: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """The weight as QLoRA's 4-bit base holds it (workers/peft_setup.py qlora_quantization: NF4, blocks of 64,
    double quantisation), dequantised: what the adapter was trained against."""
    import bitsandbytes.functional as F

    w = weight.to(compute_dtype)
    if torch.cuda.is_available():
        w = w.cuda()
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return F.dequantize_4bit(q, state).to("cpu")


def merged_tensors(model, model_dir: str, quantized_from=None) -> tuple[list[TensorSpec], Iterator]:
    """(the merged model's tensors, an iterator over them): each base tensor read from the checkpoint in turn,
    its adapter merged by peft's ``merge`` in fp32 where one adapts it, written in the checkpoint's dtype (an
    adapted layer's bias right after its weight: IA3 scales it too). ``quantized_from`` (QLoRA: the dtype the
    base was quantised from): each quantised linear's weight NF4-rounded first. ``model``:
    :func:`fresh_peft_model`'s."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted: dict[str, torch.nn.Module] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            adapted[checkpoint_name(f"{fqn}.base_layer.weight")] = m
    quantised: set[str] = set()
    if quantized_from is not None:
        quantised = _quantised_weights(model.get_base_model())
    ckpt = Checkpoint(model_dir)
    biases = {w[:-len("weight")] + "bias" for w in adapted if w[:-len("weight")] + "bias" in ckpt.entries}
    names = []
    for n in ckpt.entries:
        if n in biases:
            continue  # written right after its weight
        names.append(n)
        bias = n[:-len("weight")] + "bias" if n.endswith("weight") else None
        if n in adapted and bias in biases:
            names.append(bias)
    specs = [TensorSpec(n, ckpt.entries[n].dtype, ckpt.entries[n].shape) for n in names]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with ckpt:
            for n in names:
                if n in biases:
                    continue  # yielded with its weight
                t = ckpt.read(n)
                if n in quantised:
                    t = _nf4_rounded(t, quantized_from)
                layer = adapted.get(n)
                if layer is None:
                    yield n, t
                    continue
                bias_name = n[:-len("weight")] + "bias"
                bias = ckpt.read(bias_name) if bias_name in biases else None
                weight, bias = _merge(layer, t, bias)
                yield n, weight
                if bias is not None:
                    yield bias_name, bias
                del t, weight, bias

    return specs, tensors()


def _quantised_weights(lm) -> set[str]:
    """The weights transformers quantises for QLoRA (every nn.Linear but those it keeps, e.g. the LM head)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = set(get_keys_to_not_convert(lm) or [])
    # under checkpoint names: an adapted linear is PEFT's ``….q_proj.base_layer``, the checkpoint's ``….q_proj``
    return {checkpoint_name(f"{fqn}.weight") for fqn, m in lm.named_modules() if isinstance(m, torch.nn.Linear)
            and not any(fqn == s or fqn.endswith("." + s) or fqn.startswith(s + ".") for s in skip)}


@torch.no_grad()
def _merge(layer, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight`` (and ``bias``) with ``layer``'s adapter folded in by peft, in fp32, on a base layer that holds
    only these tensors for the moment (its own are on the meta device)."""
    base = layer.get_base_layer()
    kept_weight, kept_bias = base.weight, getattr(base, "bias", None)
    base.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    if bias is not None:
        base.bias = torch.nn.Parameter(bias.float(), requires_grad=False)
    try:
        layer.merge(adapter_names=list(layer.active_adapters))
        return base.weight.detach(), (base.bias.detach() if bias is not None else None)
    finally:
        layer.merged_adapters = []  # the copy is thrown away: nothing is merged into the model itself
        base.weight = kept_weight
        if kept_bias is not None:
            base.bias = kept_bias


def export_peft(args, adapter_state: dict[str, torch.Tensor], model_dir: str, tokenizer,
                quantized_from=None) -> dict[str, str]:
    """Rank 0: the adapter folder and, where the method merges, the merged model streamed from the base's files."""
    from workers.storage import publish_folder

    out = Path(args.output_dir)
    model = fresh_peft_model(args, model_dir, adapter_state)
    publish_folder(out, "adapter", lambda d: save_adapter(model, d, tokenizer))
    artifacts = {"adapter": "adapter"}
    if args.merges_adapter:
        specs, tensors = merged_tensors(model, model_dir, quantized_from)
        dtypes = {s.name: s.dtype for s in specs}
        artifacts.update(write_folder(out, "merged", specs, tensors, model_dir, tokenizer, dtypes, rank=0))
    return artifacts


def file_bytes(folder: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(folder).glob("*.safetensors"))
