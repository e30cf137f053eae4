"""Per-rank memory telemetry: exact counters every sampled step, a measured peak on traced steps.

What a sample holds (bytes, per rank, see ``service.domain.records.MemoryRecord``):

- ``parameters_bytes`` / ``gradients_bytes`` / ``optimizer_bytes`` are counted from the tensors
  themselves, one count per unique storage, so views into a flat buffer (DeepSpeed's bit16 groups,
  DDP's gradient buckets) are counted once, with their padding. Sharded state is counted where it
  lives: a DTensor (FSDP2) by its local shard, a ZeRO-3 parameter by its ``ds_tensor`` partition,
  a ZeRO-1/2/3 fp32 master partition by the rank that owns it. State that the strategy offloads
  to host memory (``offload={"optimizer": True, "param": True}`` or FSDP2 CPU offload) is reported
  as ``host_*`` instead.
- ``peak_bytes`` and ``activations_bytes`` are measured on traced steps (every
  ``trace_every_steps`` and always step 3, the first steady-state step) from the PyTorch profiler's
  memory events: the running sum of signed allocation sizes from ``begin_step`` gives the live
  bytes at every instant, so peak = live bytes at ``begin_step`` (counted from the tensors) + the
  highest running sum. ``activations_bytes`` is what forward leaves allocated for backward (the
  running sum at the "forward" mark minus the one before it; logits and loss included).
  ``temporary_bytes`` is the rest of the peak once parameters, gradients, optimizer states,
  activations and other known buffers are taken away (backward temporaries, all-gather buffers,
  reduce buckets, optimizer scratch). In torch 2.13 memory events live in
  ``prof.profiler.kineto_results.events()``; ``prof.events()`` has none.
- Cost: counters walk the parameter and optimizer-state lists (~0.1 ms for a few hundred tensors)
  and read ``/proc/self/statm``; a traced step records its allocations with the profiler
  (``MemoryTrace``: allocations and marks, no operators), a few % of that step on CPU;
  ``bench/train_overhead.py`` measures the loop with and without traces.
- On CUDA the allocator's view is added to ``device``: ``memory_allocated``,
  ``max_memory_allocated`` (reset at each mark, so it is the phase peak), ``memory_reserved``
  (reserved − allocated is cached/fragmented memory), ``mem_get_info`` (free/total as the driver
  sees it, so CUDA context and NCCL buffers show up) and ``num_alloc_retries``.

The referee (:class:`Referee`): an independent count of what the process holds, so that memory the counters
and the trace cannot see (allocated at wrap time or inside C++, a communication library's buffers) is found.
On CPU it is glibc's allocator statistics (``mallinfo2``: the bytes malloc has handed out and not had back, in
every arena and every mapped chunk, all threads; torch's CPU allocator takes its memory from malloc), the CPU's
counterpart of ``memory_allocated``, read when the model is about to be built (the baseline: interpreter,
libraries, data), at each step's start, at every phase mark and at the step's end; on CUDA the driver's used
memory (``mem_get_info``). Each sample carries, in ``device["referee"]``, what the referee holds beyond the
counted state (``unattributed_bytes``: held at the step's end) and, on traced steps, per phase the referee's
growth since the step began against the trace's (``phases``): where they differ, by how much. Memory a strategy
allocates once and keeps outside the parameters and optimizer (DDP's reducer buckets, a pipeline's receive
buffers) is counted as held (``held_buffers``/``held_bytes``), so the measurement has nothing outside it.

``host_budget_bytes`` makes every ``mark`` compare the process RSS to a budget and raise
:class:`HostMemoryExceeded`, the CPU worker's stand-in for CUDA's out-of-memory error. Like CUDA's
caching allocator, which frees its cached blocks and retries before it raises, a mark over the budget
first hands the allocator's free heap pages back to the OS (glibc ``malloc_trim``) and raises only if
the process is still over: freed activations of earlier micro-batches stay resident in malloc's heap
(up to 214 MiB at a mark, measured in-process on ``tests/test_downshift.py``'s small-llama job at
1024 tokens, 1 × 4), so without it the check would fail on memory no tensor holds, by an amount that
changes from run to run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from typing import Any, Callable, Iterable

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "other")
PHASES = ("forward", "backward", "optimizer")
_MARK_PREFIX = "memfit.mark."
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostMemoryExceeded(RuntimeError):
    """A CPU worker's process memory passed its configured budget (out_of_memory on CPU)."""

    def __init__(self, rss_bytes: int, budget_bytes: int, *, phase: str | None = None,
                 before_release_bytes: int | None = None):
        self.rss_bytes = int(rss_bytes)
        self.budget_bytes = int(budget_bytes)
        self.phase = phase
        self.before_release_bytes = before_release_bytes
        where = f" during {phase}" if phase else ""
        released = ""
        if before_release_bytes is not None and before_release_bytes > self.rss_bytes:
            released = f" ({before_release_bytes / 2**20:.1f} MiB before the allocator's free pages went back to the OS)"
        super().__init__(
            f"process memory {self.rss_bytes / 2**20:.1f} MiB{released} exceeded the host memory budget "
            f"{self.budget_bytes / 2**20:.1f} MiB{where}"
        )


# --- counting tensors -------------------------------------------------------------------------


def process_rss_bytes() -> int:
    """Resident set size of this process; /proc is ~20× cheaper than psutil per call."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _find_mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = _MallInfo2, []
    return fn


_MALLINFO2 = _find_mallinfo2()


def heap_in_use_bytes() -> int | None:
    """The bytes malloc has handed out and not had back: chunks in use in every arena (``uordblks``) plus those
    mapped on their own (``hblkhd``), over all threads — glibc's own count, exact at the instant it is read
    (~10 µs); None where the C library has no mallinfo2."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return int(m.uordblks + m.hblkhd)


BASELINE_ATTR = "memfit_heap_baseline"


def note_process_baseline(model, heap_before: int | None) -> None:
    """Records on ``model`` what the process's heap held before it was built (interpreter, libraries, tokenizer,
    data): the referee's zero for the telemetry of that model. ``build_model`` reads the heap before it builds
    and calls this on what it built (workers/strategies/common.py); a wrapper (DDP, DeepSpeed, PEFT) reaches it
    through ``modules()``. A model built any other way has none, and the referee then counts from its start. On
    the model, not in the process: a process that builds several (a test session) gives each its own zero."""
    if heap_before is not None:
        setattr(model, BASELINE_ATTR, heap_before)


def heap_baseline_of(model) -> int | None:
    """The heap before ``model`` (or the model it wraps) was built, as :func:`note_process_baseline` noted it."""
    if model is None:
        return None
    for m in model.modules():
        value = getattr(m, BASELINE_ATTR, None)
        if value is not None:
            return int(value)
    return None


def file_mapped_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of these tensors' storages that live in a file mapping, not in malloc's heap: weights loaded from
    safetensors are memory-mapped from the file (copy-on-write pages once trained), which the process holds
    and mallinfo never counts. Read from /proc/self/maps; 0 where it cannot be read."""
    try:
        regions = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    regions.append((lo, hi))
    except OSError:
        return 0
    regions.sort()
    starts = [lo for lo, _ in regions]
    import bisect

    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        try:
            st = _local(t).untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr in seen or not n:
            continue
        seen.add(ptr)
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and regions[i][0] <= ptr < regions[i][1]:
            total += n
    return total


class Referee:
    """Reads the process's allocator statistics around a step (see the module docstring)."""

    def __init__(self, device: torch.device, counted_bytes: int = 0, mapped_bytes: int = 0,
                 baseline_bytes: int | None = None):
        """``baseline_bytes``: the heap before the model was built (:func:`heap_baseline_of`). Without one (a
        process that builds its model itself), everything held now is taken as counted: ``counted_bytes`` is what
        the counters hold now. ``mapped_bytes``: counted storages in a file mapping (:func:`file_mapped_bytes`),
        held but not malloc's."""
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.mapped = mapped_bytes
        self.baseline = baseline_bytes if not self.cuda else None
        if self.baseline is None and not self.cuda:
            now = heap_in_use_bytes()
            self.baseline = None if now is None else now - (counted_bytes - mapped_bytes)
        self.begin: int | None = None
        self.marks: list[tuple[str, int]] = []

    def read(self) -> int | None:
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total - free)
        return heap_in_use_bytes()

    def start(self) -> None:
        self.begin, self.marks = self.read(), []

    def mark(self, phase: str) -> None:
        if self.begin is not None:
            value = self.read()
            if value is not None:
                self.marks.append((phase, value))

    def held(self, counted_bytes: int) -> dict[str, Any] | None:
        """At the step's end: what the process holds beyond its baseline, and how much of it the counters do not
        account for."""
        now = self.read()
        if now is None or (self.baseline is None and not self.cuda):
            return None
        held = now - (self.baseline or 0) + (0 if self.cuda else self.mapped)
        return {"source": "mem_get_info" if self.cuda else "mallinfo2", "held_bytes": int(held),
                "file_mapped_bytes": int(self.mapped), "counted_bytes": int(counted_bytes),
                "unattributed_bytes": int(held - counted_bytes)}

    def phases(self, trace_marks: list[tuple[str, int]]) -> dict[str, dict[str, int]]:
        """Per phase, the referee's growth since the step began against the trace's at the same marks (the
        worst of a phase's marks: accumulation marks each phase once per micro-batch)."""
        out: dict[str, dict[str, int]] = {}
        if self.begin is None:
            return out
        for (phase, ref), (tphase, traced) in zip(self.marks, trace_marks):
            if phase != tphase:
                break
            delta = ref - self.begin
            row = {"referee_delta_bytes": int(delta), "trace_delta_bytes": int(traced),
                   "unattributed_bytes": int(delta - traced)}
            if phase not in out or abs(row["unattributed_bytes"]) > abs(out[phase]["unattributed_bytes"]):
                out[phase] = row
        return out


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def release_free_heap() -> bool:
    """Hand malloc's free pages back to the OS (glibc ``malloc_trim(0)``: every arena, holes included);
    False where the C library has no such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank actually holds (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return t.to_local()
    return t


class _Counter:
    """Sums bytes per unique storage, split by where the storage lives (device vs host)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> tuple[int, int]:
        on_device = on_host = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                nbytes = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
                key = (str(t.device), id(t))
                nbytes = t.numel() * t.element_size()
            if nbytes == 0 or key in self.seen:
                continue
            self.seen.add(key)
            if self.device.type != "cpu" and t.device.type == "cpu":
                on_host += nbytes
            else:
                on_device += nbytes
        return on_device, on_host


def _model_parameters(model) -> list[torch.Tensor]:
    params = []
    for p in model.parameters():
        ds = getattr(p, "ds_tensor", None)  # ZeRO-3: p.data is empty, the partition is ds_tensor
        params.append(ds if ds is not None else p)
        params.extend(_quant_state_tensors(getattr(p, "quant_state", None)))
    for m in model.modules():  # FSDP2 shards the 4-bit weight into a DTensor; Linear4bit keeps the state itself
        params.extend(_quant_state_tensors(getattr(m, "quant_state", None)))
    return params


def _quant_state_tensors(qs) -> list[torch.Tensor]:
    """A bitsandbytes 4-bit weight (Params4bit: packed uint8 codes, counted as the parameter) keeps its
    quantisation constants beside it in ``quant_state``: the block absmax, the NF4 code, and with double
    quantisation the offset and a nested state (absmax of the absmax, the 8-bit code). They are part of
    the parameter's memory, as service/memory/nf4.py plans it."""
    if qs is None:
        return []
    out = [getattr(qs, k, None) for k in ("absmax", "code", "offset")]
    nested = getattr(qs, "state2", None)
    if nested is not None:
        out += [getattr(nested, "absmax", None), getattr(nested, "code", None)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _ds_inner(optimizer):
    """(inner torch optimizer, deepspeed zero optimizer or None)."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "state") and hasattr(inner, "param_groups"):
        return inner, optimizer
    return optimizer, None


def _optimizer_tensors(optimizer, model_param_ids: set[int]) -> list[torch.Tensor]:
    """Optimizer states plus master copies that are not the model's own parameters."""
    if optimizer is None:
        return []
    inner, zero = _ds_inner(optimizer)
    out: list[torch.Tensor] = []
    for state in getattr(inner, "state", {}).values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            if id(p) not in model_param_ids:
                out.append(p)  # fp32 master partition (DeepSpeed) — optimizer state, not a parameter
    if zero is not None:
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            out.extend(t for t in getattr(zero, name, []) or [] if isinstance(t, torch.Tensor))
    return out


def _gradient_tensors(model, optimizer) -> list[torch.Tensor]:
    grads: list[torch.Tensor] = [p.grad for p in model.parameters() if p.grad is not None]
    # DeepSpeed ZeRO-1 with 16-bit weights accumulates each gradient in a copy of the accumulation dtype (fp32 by
    # default) kept on the parameter as ``grad_accum``, from its first backward until the next step's forward
    # (deepspeed/runtime/zero/stage_1_and_2.py: use_grad_accum_attribute, _fill_param_grad_accum_attribute,
    # clear_backward_seen_flag): a gradient no ``.grad`` shows.
    grads += [g for p in model.parameters() if isinstance(g := getattr(p, "grad_accum", None), torch.Tensor)]
    if optimizer is None:
        return grads
    inner, zero = _ds_inner(optimizer)
    if zero is not None:
        avg = getattr(zero, "averaged_gradients", None)  # ZeRO-1/2: this rank's reduced partitions
        if isinstance(avg, dict):
            for v in avg.values():
                grads.extend(t for t in (v or []) if isinstance(t, torch.Tensor))
        for name in ("grad_partitions_flat_buffer",):  # ZeRO-3: one flat buffer of partitions
            t = getattr(zero, name, None)
            if isinstance(t, torch.Tensor):
                grads.append(t)
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(zero, name, []) or []:
                if isinstance(t, torch.Tensor) and t.grad is not None:
                    grads.append(t.grad)
    return grads


def _buffer_tensors(model) -> list[torch.Tensor]:
    return [b for b in model.buffers()]


# --- the telemetry object the training loop drives ---------------------------------------------


class StepTelemetry:
    """Driven by the training loop: ``begin_step`` → ``mark(phase)``… → ``end_step``.

    ``end_step`` returns MemoryRecord-shaped dicts (without ``attempt`` and ``time``, which the
    sink adds) every ``every_steps`` steps: one ``phase="step"`` record with the counters, and on
    traced steps one record per phase with the phase peak.
    """

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device | str,
        model,
        optimizer,
        every_steps: int,
        trace_every_steps: int,
        host_budget_bytes: int | None = None,
        offload: dict | None = None,
        strategy: str = "ddp",
    ):
        self.rank = int(rank)
        self.device = torch.device(device)
        self.model = model
        self.optimizer = optimizer
        self.every_steps = max(1, int(every_steps))
        self.trace_every_steps = max(0, int(trace_every_steps))  # 0: counters only, no trace (benchmarks)
        self.host_budget_bytes = host_budget_bytes
        # Strategies pass booleans or the spec's strings ("none" / "cpu"): only a real offload counts.
        self.offload = {k: v not in (None, False, "", "none") for k, v in (offload or {}).items()}
        self.strategy = strategy
        self.plan: dict | None = None  # the planner's prediction, if the caller knows it
        self.suggestions: list[dict] | None = None
        # Tensors a strategy keeps across steps outside the model and the optimizer (a pipeline's receive
        # buffers, workers/strategies/pipeline.py: recv_buffers), counted with the model's buffers: on a CPU
        # worker the trace sees only what a step allocates, so memory held from an earlier step must be counted.
        self.held_buffers: Callable[[], Iterable[torch.Tensor]] | None = None
        # Parameters held outside the model, counted as parameters (DPO's frozen reference copy, workers/dpo.py).
        self.held_parameters: Callable[[], Iterable[torch.Tensor]] | None = None
        # Bytes a strategy keeps that no tensor reachable from Python holds (DDP's reducer buckets, allocated in C++
        # when the model is wrapped: workers/strategies/ddp.py: reducer_bucket_bytes), counted with the buffers.
        self.held_bytes: Callable[[], int] | None = None
        self.referee: Referee | None = None  # made below, once the counters can be read
        self._batches: list[list[int]] | None = None  # the step's micro-batches: each row's tokens
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._step: int | None = None
        self._sampled = False
        self._traced = False
        self._prof = None
        self._marks: list[tuple[str, int]] = []
        self._grad_bytes = (0, 0)
        self._cuda_phase_peaks: dict[str, int] = {}
        self._last: dict[str, Any] = {}  # latest counters, for the post-mortem
        self._phase_times_s: dict[str, float] = {}
        self._t0 = 0.0
        # Process memory that is not tensors (interpreter, libraries, allocator slack): RSS now minus
        # the tensors already built. A host-budget post-mortem reports it as its own category.
        try:
            live = self._live_bytes(self.counters())
            self._runtime_bytes = max(0, process_rss_bytes() - live)
            mapped = file_mapped_bytes([*_model_parameters(model), *_buffer_tensors(model)]) if model is not None else 0
        except Exception:  # noqa: BLE001 - telemetry must never stop a run from starting
            live, self._runtime_bytes, mapped = 0, 0, 0
        self.referee = Referee(self.device, live, mapped, heap_baseline_of(model))

    # -- cadence ---------------------------------------------------------------------------

    def is_sampled(self, step: int) -> bool:
        return step % self.every_steps == 0 or self.is_traced(step)

    def is_traced(self, step: int) -> bool:
        if not self.trace_every_steps:
            return False
        return step == 3 or step % self.trace_every_steps == 0

    # -- loop hooks ------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._step = step
        self._sampled = self.is_sampled(step)
        self._traced = self.is_traced(step)
        self._marks = []
        self._grad_bytes = (0, 0)
        self._cuda_phase_peaks = {}
        self._t0 = time.perf_counter()
        if not self._sampled:
            return
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if self._traced:
            self._base = self.counters()
            self._base_live_bytes = self._live_bytes(self._base)
            self._start_profiler()
            self.referee.start()  # after the profiler's own start-up allocations

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        if self.host_budget_bytes is not None:
            rss = process_rss_bytes()
            if rss > self.host_budget_bytes:
                before = rss
                if release_free_heap():
                    rss = process_rss_bytes()
                if rss > self.host_budget_bytes:
                    self._last = {"process_rss_bytes": rss, **self._last}
                    raise HostMemoryExceeded(rss, self.host_budget_bytes, phase=phase, before_release_bytes=before)
        if not self._sampled:
            return
        if self._prof is not None:
            with torch.profiler.record_function(_MARK_PREFIX + phase):
                pass
            self.referee.mark(phase)
        if phase == "backward":
            g = self._count_gradients()
            self._grad_bytes = (max(self._grad_bytes[0], g[0]), max(self._grad_bytes[1], g[1]))
        if self._cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            self._cuda_phase_peaks[phase] = max(self._cuda_phase_peaks.get(phase, 0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def note_batches(self, micro_batches: list[dict]) -> None:
        """The step's micro-batches, as each row's tokens (its attention mask's ones), for the sample: the
        service compares the step with the plan of these very micro-batches (service/memory/steps.py)."""
        if not self._sampled:
            return
        out = []
        for b in micro_batches:
            mask = b.get("attention_mask")
            out.append([int(n) for n in mask.sum(dim=1).tolist()] if mask is not None
                       else [int(b["input_ids"].shape[1])] * int(b["input_ids"].shape[0]))
        self._batches = out

    def end_step(self, step: int) -> list[dict]:
        if not self._sampled or step != self._step:
            return []
        trace = self._stop_profiler() if self._traced else None
        counters = self.counters()
        if self._grad_bytes != (0, 0):
            counters["gradients_bytes"], counters["host_gradients_bytes"] = self._grad_bytes
        counters["process_rss_bytes"] = process_rss_bytes()
        device_view = self.cuda_view() if self._cuda else {}
        if self._cuda_phase_peaks:
            device_view["phase_max_memory_allocated"] = dict(self._cuda_phase_peaks)
        record: dict[str, Any] = {
            "kind": "memory",
            "rank": self.rank,
            "step": step,
            "phase": "step",
            "source": "counters",
            **{k: counters[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "other_bytes")},
            **{k: counters[k] for k in ("host_parameters_bytes", "host_gradients_bytes", "host_optimizer_bytes")},
            "process_rss_bytes": counters["process_rss_bytes"],
            "device": device_view,
        }
        if self._batches is not None:
            record["device"]["micro_batches"], self._batches = self._batches, None
        held = self.referee.held(self._live_bytes(counters))
        if held is not None:
            record["device"]["referee"] = held
            if trace is not None:
                held["phases"] = self.referee.phases(trace["mark_live_bytes"])
        records = [record]
        if trace is not None:
            record["source"] = "profiler"
            record["peak_bytes"] = trace["peak_bytes"]
            record["activations_bytes"] = trace["activations_bytes"]
            named = sum(record[k] or 0 for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "other_bytes"))
            if self.device.type == "cpu":  # host-resident offloaded state is in the same RAM the profiler sees
                named += sum(record[k] or 0 for k in ("host_parameters_bytes", "host_gradients_bytes", "host_optimizer_bytes"))
            record["temporary_bytes"] = trace["peak_bytes"] - named - trace["activations_bytes"]
            record["device"]["peak_phase"] = trace["peak_phase"]
            for phase, peak in trace["phase_peak_bytes"].items():
                records.append(
                    {
                        "kind": "memory",
                        "rank": self.rank,
                        "step": step,
                        "phase": phase,
                        "source": "profiler",
                        "peak_bytes": peak,
                        "device": {},
                    }
                )
        elif self._cuda:
            record["source"] = "cuda"
            record["peak_bytes"] = int(max(self._cuda_phase_peaks.values(), default=0))
        self._last = {**record}
        return records

    # -- counters --------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Exact bytes of parameters, optimizer state, gradients and buffers now live on this rank."""
        c = _Counter(self.device)
        params = _model_parameters(self.model)
        p_dev, p_host = c.add(params)
        if self.held_parameters is not None:
            h_dev, h_host = c.add(self.held_parameters())
            p_dev, p_host = p_dev + h_dev, p_host + h_host
        model_ids = {id(p) for p in self.model.parameters()}
        model_ids.update(id(p) for p in params)
        o_dev, o_host = c.add(_optimizer_tensors(self.optimizer, model_ids))
        g_dev, g_host = c.add(_gradient_tensors(self.model, self.optimizer))
        b_dev, b_host = c.add(_buffer_tensors(self.model))
        if self.held_buffers is not None:
            h_dev, h_host = c.add(self.held_buffers())
            b_dev, b_host = b_dev + h_dev, b_host + h_host
        if self.held_bytes is not None:
            b_dev += int(self.held_bytes())
        out = {
            "parameters_bytes": p_dev,
            "gradients_bytes": g_dev,
            "optimizer_bytes": o_dev,
            "other_bytes": b_dev,
            "host_parameters_bytes": p_host,
            "host_gradients_bytes": g_host,
            "host_optimizer_bytes": o_host,
        }
        if self.device.type == "cpu":
            # On a CPU worker everything is "host"; offloaded state is reported as host_* so the
            # breakdown still says what the strategy moved off the (notional) device.
            if self.offload.get("param"):
                out["host_parameters_bytes"], out["parameters_bytes"] = out["parameters_bytes"], 0
            if self.offload.get("optimizer"):
                out["host_optimizer_bytes"], out["optimizer_bytes"] = out["optimizer_bytes"], 0
                out["host_gradients_bytes"], out["gradients_bytes"] = out["gradients_bytes"], 0
        out["other_bytes"] += b_host if self.device.type != "cpu" else 0
        return out

    def _count_gradients(self) -> tuple[int, int]:
        c = _Counter(self.device)
        dev, host = c.add(_gradient_tensors(self.model, self.optimizer))
        if self.device.type == "cpu" and self.offload.get("optimizer"):
            return 0, dev + host
        return dev, host

    def _live_bytes(self, counters: dict[str, int]) -> int:
        keys = ["parameters_bytes", "gradients_bytes", "optimizer_bytes", "other_bytes"]
        if self.device.type == "cpu":
            keys += ["host_parameters_bytes", "host_gradients_bytes", "host_optimizer_bytes"]
        return sum(counters[k] for k in keys)

    def cuda_view(self) -> dict[str, Any]:
        """The CUDA caching allocator's and the driver's view (GPU only; untested on CPU machines)."""
        if not self._cuda:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "memory_allocated": int(torch.cuda.memory_allocated(self.device)),
            "max_memory_allocated": int(torch.cuda.max_memory_allocated(self.device)),
            "memory_reserved": int(torch.cuda.memory_reserved(self.device)),
            "max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device)),
            "mem_get_info_free": int(free),
            "mem_get_info_total": int(total),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
            "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        }

    # -- profiler --------------------------------------------------------------------------

    def _start_profiler(self) -> None:
        self._prof = MemoryTrace(self.device)
        self._prof.start()
        with torch.profiler.record_function(_MARK_PREFIX + "begin"):
            pass

    def _stop_profiler(self) -> dict[str, Any] | None:
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        return summarize_profile(prof.stop(), self.device, self._base_live_bytes)

    # -- failure ---------------------------------------------------------------------------

    def post_mortem(self, exc: BaseException, *, step: int | None, phase: str | None) -> dict:
        """Where the memory was when ``exc`` happened: breakdown, dominant category, suggestions."""
        if self._prof is not None:
            try:
                self._prof.stop()
            except Exception:  # noqa: BLE001 - a half-finished trace must not hide the real failure
                pass
            self._prof = None
        try:
            breakdown: dict[str, Any] = dict(self.counters())
        except Exception:  # noqa: BLE001
            breakdown = {}
        breakdown["process_rss_bytes"] = process_rss_bytes()
        if self._cuda:
            try:
                breakdown["device"] = self.cuda_view()
            except Exception:  # noqa: BLE001
                pass
        if isinstance(exc, HostMemoryExceeded):
            breakdown["process_rss_bytes"] = max(breakdown["process_rss_bytes"], exc.rss_bytes)
            limit = exc.budget_bytes
            used = exc.rss_bytes
        elif self._cuda:
            used = breakdown.get("device", {}).get("memory_allocated", 0)
            limit = breakdown.get("device", {}).get("mem_get_info_total")
        else:
            used, limit = breakdown["process_rss_bytes"], self.host_budget_bytes
        state = {
            "parameters": breakdown.get("parameters_bytes", 0) + breakdown.get("host_parameters_bytes", 0),
            "gradients": breakdown.get("gradients_bytes", 0) + breakdown.get("host_gradients_bytes", 0),
            "optimizer": breakdown.get("optimizer_bytes", 0) + breakdown.get("host_optimizer_bytes", 0),
            "other": breakdown.get("other_bytes", 0),
        }
        if not self._cuda:  # RSS counts the process itself too: name that part instead of blaming activations
            state["process_runtime"] = min(self._runtime_bytes, max(0, used - sum(state.values())))
        # What is not model state was activations and temporaries of the phase that failed.
        state["activations_and_temporary"] = max(0, used - sum(state.values()))
        last_peak = self._last.get("activations_bytes")
        if last_peak:
            state["activations"] = int(last_peak)
            state["activations_and_temporary"] = max(0, state["activations_and_temporary"] - int(last_peak))
        dominant = max(state, key=lambda k: state[k])
        out: dict[str, Any] = {
            "rank": self.rank,
            "step": step,
            "phase": phase,
            "strategy": self.strategy,
            "message": str(exc),
            "used_bytes": int(used),
            "limit_bytes": int(limit) if limit is not None else None,
            "breakdown": breakdown,
            "categories_bytes": state,
            "dominant_category": dominant,
            "last_sample": dict(self._last),
        }
        if self.plan is not None:
            out["plan"] = self.plan
        if self.suggestions is not None:
            out["suggestions"] = self.suggestions
        return out


# --- the phases of a job that are not a training step --------------------------------------------------

JOB_PHASES = ("load", "eval", "checkpoint", "export", "sample")  # service/domain/records.py MemoryRecord.phase (sample: RL)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's resident memory (VmHWM) to its current RSS:
    ``echo 5 > /proc/self/clear_refs`` (Linux ≥ 4.0). False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _RssSampler:
    """Where VmHWM cannot be reset: the RSS sampled every ``interval_s`` on a thread, its maximum kept."""

    def __init__(self, interval_s: float = 0.01):
        import threading

        self.peak = process_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, process_rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, process_rss_bytes())


class PhaseMeter:
    """The peak memory of one rank over a phase of the job that is not a training step — loading the weights,
    an evaluation, saving a checkpoint, the export — where users' jobs run out of memory too (peers' issues:
    the host killed at load, eval-only and save-only out-of-memory failures).

    Host: the process's peak resident memory over the phase, exact — the kernel's high-water mark (VmHWM in
    /proc/self/status) reset when the phase starts (``reset_peak_rss``), or, where that is refused, the RSS
    sampled every 10 ms. What is resident counts: tensors, the allocator's free pages, mapped file pages. On
    CUDA the device's peak is the allocator's ``max_memory_allocated`` (reset at the phase's start) and
    ``max_memory_reserved``. ``records()`` returns MemoryRecord-shaped dicts (phase = the phase's name,
    ``process_rss_bytes`` = the host peak; the device peak and the phase's window in ``device``), which the
    strategies send with their next report."""

    def __init__(self, rank: int, device: torch.device | str):
        self.rank = int(rank)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._pending: list[dict] = []
        self.last: dict[str, dict] = {}

    def measure(self, phase: str, step: int, **extra):
        """A context manager around one phase; ``extra`` (and what the body sets on the yielded dict) goes
        with the record."""
        import contextlib

        if phase not in JOB_PHASES:
            raise ValueError(f"unknown job phase {phase!r}; expected one of {JOB_PHASES}")

        @contextlib.contextmanager
        def run():
            start_rss = process_rss_bytes()
            sampler = None if reset_peak_rss() else _RssSampler()
            if self._cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            info: dict[str, Any] = dict(extra)
            started = time.time()
            try:
                yield info
            finally:
                if self._cuda:
                    torch.cuda.synchronize(self.device)
                peak = sampler.stop() if sampler is not None else max(_status_bytes("VmHWM") or 0, process_rss_bytes())
                detail = {"started_at": started, "ended_at": time.time(), "pid": os.getpid(), "rss_start_bytes": start_rss,
                          "rss_end_bytes": process_rss_bytes(), "peak_source": "sampled" if sampler else "VmHWM", **info}
                if self._cuda:
                    detail.update(max_memory_allocated=int(torch.cuda.max_memory_allocated(self.device)),
                                  max_memory_reserved=int(torch.cuda.max_memory_reserved(self.device)))
                record = {"kind": "memory", "rank": self.rank, "step": int(step), "phase": phase, "source": "phase",
                          "process_rss_bytes": int(peak), "device": detail}
                self.last[phase] = record
                self._pending.append(record)

        return run()

    def records(self) -> list[dict]:
        """The phases measured since the last call (to send with the next report)."""
        out, self._pending = self._pending, []
        return out


class MemoryTrace:
    """The profiler's allocation events (and the marks) over one step, without its per-op events.

    ``torch.profiler.profile(profile_memory=True)`` records every operator too: about 3× the events
    of the allocations themselves, each timed on entry and exit and converted when the profiler
    stops. Those cost a traced CPU step ~12% of its time (memfit never reads them). Enabled with the
    user scope only, the same profiler records ``record_function`` ranges (the marks) and every
    allocation and free the allocator reports, and no operator: the same memory events (the same
    summary, byte for byte; tests/test_telemetry.py compares the two), at ~3% of a step.
    ``torch.autograd.profiler.profile`` enables it the same way, with every scope. Where these
    private entry points are missing (another torch), the public profiler is used instead."""

    def __init__(self, device: torch.device, pause_waits: bool = True):
        self.device = device
        self._pause = pause_waits and device.type == "cpu"  # _CollectiveWaits while recording
        self._public = None

    def _activities(self, kind):
        acts = {kind.CPU}
        if self.device.type == "cuda" and torch.cuda.is_available():
            acts.add(kind.CUDA)
        return acts

    def start(self) -> None:
        if self._pause:
            _WAITS.install()
        try:
            from torch._C._profiler import ProfilerActivity, RecordScope, _ExperimentalConfig
            from torch.autograd.profiler import ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler
        except ImportError:
            from torch.profiler import ProfilerActivity, profile

            self._public = profile(activities=list(self._activities(ProfilerActivity)), profile_memory=True,
                                   record_shapes=False, with_stack=False)
            self._public.__enter__()
            return
        # state, record_shapes, profile_memory, with_stack, with_flops, with_modules, experimental_config
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        acts = self._activities(ProfilerActivity)
        _prepare_profiler(config, acts)
        _enable_profiler(config, acts, {RecordScope.USER_SCOPE})

    def stop(self):
        """The recorded events (``_KinetoEvent``s)."""
        if self._pause:
            _WAITS.remove()
        if self._public is not None:
            prof, self._public = self._public, None
            prof.__exit__(None, None, None)
            return prof.profiler.kineto_results.events()
        from torch.autograd.profiler import _disable_profiler

        return _disable_profiler().events()


class _CollectiveWaits:
    """While a CPU step is traced, every collective's wait returns a moment later, so that the tensors the
    collective holds are freed on the thread the profiler sees.

    The profiler records a free only on a thread it profiles (c10/core/impl/alloc_cpu.cpp's
    ProfiledCPUMemoryReporter reports through c10::reportMemoryUsageToProfiler, which reads the calling
    thread's profiler state), and gloo's worker thread (ProcessGroupGloo::runLoop) is not one. That
    thread keeps a finished collective's work, with its input and output tensors, until after it has woken
    the waiting thread. When the caller drops those tensors before the worker has let go of the work — a
    ZeRO-3 gather buffer released right after a short forward, a tensor-parallel all-reduce output after the
    residual add — the last reference goes on gloo's thread,
    the free is never recorded, and the trace counts the tensor as live until the step ends: one more
    buffer at some steps and ranks and not at others, a race in the measurement, not in the memory
    (tests/test_telemetry.py shows it with a bare gloo group: a dropped all-gather output stays "live" in
    some traces without the pause, in none with it). A pause after the wait lets the worker finish first.
    Only traced steps pay it (~3 ms per collective); GPU traces read the CUDA allocator's own counters. FSDP2 on
    CPU runs every collective synchronously (its all-gathers and reduce-scatters wait on their Work before
    returning; the stream events it then waits on are no-ops), so the pause moves no allocation of the main
    thread: with it every FSDP2 config of bench/memory_accuracy.py peaks at one level at every step and rank,
    where without it the same config read up to four levels, by whole units, from step to step.

    A fixed pause is not enough on a loaded machine: gloo's thread may not be given a core within it (CI
    once read one decoder block's reduce-scatter buffer at one step of six, FSDP2 on two cores shared with
    another job's ranks). So after the pause the wait goes on, up to ``SETTLE_S``, while any of this
    process's gloo threads (``pt_gloo_runloop``) is runnable: one that has let go of its work sleeps on
    its queue again."""

    PAUSE_S = 0.003
    SETTLE_S = 0.05

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        if self._saved:
            return
        try:
            from torch._C._distributed_c10d import Work
            import torch.distributed._functional_collectives as funcol
        except ImportError:  # a torch without distributed
            return
        settle = self.settle

        def work_wait(work, *args, _wait=Work.wait, **kwargs):
            out = _wait(work, *args, **kwargs)
            settle()
            return out

        def wait_tensor(tensor, _wait=funcol.wait_tensor):
            out = _wait(tensor)
            settle()
            return out

        self._saved = [(Work, "wait", Work.wait), (funcol, "wait_tensor", funcol.wait_tensor)]
        Work.wait = work_wait
        funcol.wait_tensor = wait_tensor

    def settle(self) -> None:
        time.sleep(self.PAUSE_S)
        deadline = time.monotonic() + self.SETTLE_S
        while time.monotonic() < deadline and any(state == "R" for state in gloo_thread_states().values()):
            time.sleep(0.001)

    def remove(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved = []


_WAITS = _CollectiveWaits()
_thread_names: dict[str, str] = {}  # this process's thread ids -> the names they gave themselves


def gloo_thread_states() -> dict[str, str]:
    """The scheduler state (``R`` runnable, ``S`` sleeping, …: proc(5)) of each of this process's gloo worker
    threads (ProcessGroupGloo names them ``pt_gloo_runloop``), by thread id; {} off Linux."""
    try:
        tids = os.listdir("/proc/self/task")
        with open("/proc/self/comm") as f:
            inherited = f.read().strip()  # a new thread's name until it names itself (gloo's do as they start)
    except OSError:
        return {}
    states = {}
    for tid in tids:
        try:
            name = _thread_names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                if name != inherited:
                    _thread_names[tid] = name
            if name == "pt_gloo_runloop":
                with open(f"/proc/self/task/{tid}/stat") as f:
                    states[tid] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended meanwhile
            _thread_names.pop(tid, None)
    for gone in _thread_names.keys() - set(tids):  # thread ids are reused: forget the names of ended threads
        _thread_names.pop(gone, None)
    return states


def summarize_profile(events, device: torch.device, base_live_bytes: int) -> dict[str, Any]:
    """Running sum of the profiler's signed allocation sizes → absolute peak per phase.

    Phases are delimited by the ``memfit.mark.<phase>`` annotations that ``mark`` emits: an
    allocation belongs to the phase whose mark comes next. Only allocations on ``device`` count.
    ``events``: ``MemoryTrace.stop()``'s, or a ``torch.profiler.profile``'s
    ``prof.profiler.kineto_results.events()``.
    """
    want = device.type
    kinds: dict[Any, bool] = {}  # DeviceType -> whether it is ``device``'s (one str() per type, not per event)
    items: list[tuple[int, int, str | None]] = []  # (time, delta bytes, mark name)
    for e in events:
        name = e.name()
        if name == "[memory]":
            kind = e.device_type()
            mine = kinds.get(kind)
            if mine is None:
                mine = kinds[kind] = str(kind).rsplit(".", 1)[-1].lower() == want
            if mine:
                items.append((e.start_ns(), int(e.nbytes()), None))
        elif name.startswith(_MARK_PREFIX):
            items.append((e.start_ns(), 0, name[len(_MARK_PREFIX):]))
    items.sort(key=lambda x: x[0])
    live = 0
    seg_peak = 0
    peak = 0
    seg_start_live = 0
    phase_peaks: dict[str, int] = {}
    activations = 0
    peak_phase = None
    mark_live: list[tuple[str, int]] = []  # the live bytes at each mark, from the step's start (the referee's marks)
    for _, delta, mark in items:
        if mark is None:
            live += delta
            seg_peak = max(seg_peak, live)
            continue
        if mark == "begin":
            seg_peak, seg_start_live = live, live
            continue
        mark_live.append((mark, live))
        phase_peaks[mark] = max(phase_peaks.get(mark, 0), seg_peak)
        if mark == "forward":
            activations = max(activations, live - seg_start_live)
        if seg_peak > peak:
            peak, peak_phase = seg_peak, mark
        seg_peak, seg_start_live = live, live
    # Anything after the last mark (e.g. zero_grad) belongs to the optimizer phase.
    if seg_peak > peak:
        peak, peak_phase = seg_peak, "optimizer"
    phase_peaks["optimizer"] = max(phase_peaks.get("optimizer", 0), seg_peak)
    return {
        "peak_bytes": int(base_live_bytes + peak),
        "phase_peak_bytes": {k: int(base_live_bytes + v) for k, v in phase_peaks.items()},
        "activations_bytes": int(activations),
        "peak_phase": peak_phase,
        "end_delta_bytes": int(live),
        "mark_live_bytes": mark_live,
    }
