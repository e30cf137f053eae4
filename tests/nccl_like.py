"""A test-only process-group backend that refuses what NCCL refuses, on a machine with no GPU.

Under NCCL every tensor a collective is given must live on the group's device (a CUDA tensor); a tensor
left on the host fails with "No backend type associated with device type cpu". Gloo takes both, so a
collective on a host tensor — ``dist.all_reduce(torch.tensor(x))`` where ``torch.tensor(x, device=d)`` was
meant — passes every CPU test and fails the first step on GPUs. This module makes that class of defect
visible on CPU, in two parts:

- **a fake accelerator** (:class:`HostTensors`, a ``TorchFunctionMode`` active for the whole worker): the
  workers' device stays ``cpu``, but a tensor is marked *host* when it is made the way it would land on
  the host under CUDA — a factory (``torch.tensor``, ``torch.zeros`` …) called without ``device=``, or
  ``.cpu()`` — and the mark follows it through every op whose tensor inputs are all host tensors, as a
  device does. A tensor made with ``device=…``, or moved with ``.to(device)`` (``Module.to`` too), is on
  the accelerator. Weights read from files (safetensors) and everything computed from them are device
  tensors, as they are once a CUDA worker has moved its model.
- **the backend** (:class:`NcclLikeProcessGroup`, registered as ``nccl_like`` with
  ``torch.distributed.Backend.register_backend``): gloo underneath, but every collective refuses a host
  tensor with NCCL's own message. It sees what ``torch.distributed``'s functions hand it; the functional
  collectives DTensor runs (``torch.ops._c10d_functional.*``) go to the C++ backend without passing
  through Python, so :class:`HostTensors` checks those where they are called.

``install()`` registers both in a worker process and returns the backend name to pass to
``init_process_group`` (workers/local.py ``run_local(..., worker_setup="tests.nccl_like:install")``).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

BACKEND = "nccl_like"
_MARK = "_memfit_on_host"

# Factories that put their result on the default device (the host, under CUDA) unless given ``device=``.
_FACTORIES = {getattr(torch, n) for n in (
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "scalar_tensor", "empty_strided", "frombuffer", "from_file",
    "tril_indices", "triu_indices") if hasattr(torch, n)}
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


class HostTensorRefused(RuntimeError):
    """What NCCL raises for a host tensor (the message is NCCL's, so a test reads what a GPU job would)."""


def on_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _mark(obj, host: bool) -> None:
    if isinstance(obj, torch.Tensor):
        try:
            if host:
                setattr(obj, _MARK, True)
            elif getattr(obj, _MARK, False):
                delattr(obj, _MARK)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            pass
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _mark(o, host)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def refuse_host_tensors(what: str, tensors) -> None:
    for t in tensors:
        if on_host(t):
            raise HostTensorRefused(
                f"{what}: a tensor of shape {tuple(t.shape)} ({t.dtype}) is on the host, not on the process group's "
                "device: NCCL refuses it (\"No backend type associated with device type cpu\"). Create it with "
                "device=<the worker's device> or move it there before the collective.")


def _moves_to_device(args, kwargs) -> bool | None:
    """For ``Tensor.to``: True when a device is named (the result is on it), None when only a dtype is."""
    if "device" in (kwargs or {}) and kwargs["device"] is not None:
        return True
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)):
            return True
        if isinstance(a, torch.Tensor):  # to(other): other's device
            return not on_host(a)
    return None


class HostTensors(TorchFunctionMode):
    """Marks host tensors (module docstring) and refuses functional collectives on them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", None)
        if namespace in _COLLECTIVE_NAMESPACES:
            refuse_host_tensors(f"torch.ops.{namespace}.{getattr(func, '__name__', func)}", _tensors(args, kwargs))
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            _mark(out, kwargs.get("device") is None)
            return out
        if func is torch.Tensor.to:
            moved = _moves_to_device(args, kwargs)
            if moved is not None:
                _mark(out, not moved)
                return out
        elif func is torch.Tensor.cpu:
            if out is not args[0]:
                _mark(out, True)
            return out
        elif func is torch.Tensor.cuda:
            _mark(out, False)
            return out
        inputs = _tensors(args, kwargs)
        if inputs and all(on_host(t) for t in inputs):  # only host tensors in: the result is on the host
            ids = {id(t) for t in inputs}
            if isinstance(out, torch.Tensor):
                if id(out) not in ids:
                    _mark(out, True)
            elif isinstance(out, (list, tuple)):
                _mark([o for o in out if id(o) not in ids], True)
        return out


# --- the backend ------------------------------------------------------------------------------------

# Every collective a ProcessGroup has in Python (torch 2.13's names); each checks its tensors, then gloo runs it.
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
               "all_gather_single", "all_gather_single_coalesced", "_allgather_base", "broadcast", "reduce",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
               "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "alltoall", "alltoall_base",
               "all_to_all_single", "gather", "scatter", "send", "recv", "recv_anysource")


class NcclLikeProcessGroup(dist.ProcessGroup):
    """Gloo underneath; every collective refuses host tensors first (module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        from torch._C._distributed_c10d import ProcessGroupGloo

        super().__init__(rank, size)
        gloo = ProcessGroupGloo(store, rank, size, timeout)
        # A ProcessGroup with gloo registered for "cpu": what the collectives are forwarded to (calling this
        # object's own C++ methods from Python would come back here).
        self._gloo = dist.ProcessGroup(store, rank, size)
        self._gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._gloo._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        # ... and the same backend registered here, so that the C++ functional collectives (which resolve a
        # group by name and call its backend directly: HostTensors checks them) and group names work.
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

    def getBackendName(self) -> str:
        return BACKEND

    def barrier(self, *args, **kwargs):
        return self._gloo.barrier(*args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):
        return self._gloo.monitored_barrier(*args, **kwargs)


def _collective(name: str):
    def method(self, *args, **kwargs):
        from torch.utils._pytree import tree_leaves

        refuse_host_tensors(f"{BACKEND} {name}", [t for t in tree_leaves([list(args), list(kwargs.values())])
                                                   if isinstance(t, torch.Tensor)])
        return getattr(self._gloo, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in COLLECTIVES:
    setattr(NcclLikeProcessGroup, _name, _collective(_name))


def _create(store, rank: int, size: int, timeout: timedelta) -> NcclLikeProcessGroup:
    return NcclLikeProcessGroup(store, rank, size, timeout)


_MODE: HostTensors | None = None


def install() -> str:
    """Register the backend and start marking host tensors in this process; returns the backend's name."""
    global _MODE
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    if _MODE is None:
        _MODE = HostTensors()
        _MODE.__enter__()
    return BACKEND
