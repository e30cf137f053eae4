"""ZeRO-Infinity's offload to a local disk — DeepSpeed ``offload_optimizer`` / ``offload_param`` with ``device:
"nvme"`` — planned, and refused at admission where it cannot run.

Where a rank's bytes go (deepspeed/runtime/zero/stage3.py, deepspeed/runtime/swap_tensor/): the offloaded states
move to files under ``nvme_path`` — with the optimizer, the fp32 master partition and AdamW's two moments (12 bytes
per trainable parameter ÷ ranks); with the parameters, their 16-bit partition (2 bytes per parameter ÷ ranks) — and
the host keeps the buffers they are swapped through, sizes memfit sets (service/domain/training.py NVME_*): the
optimizer's ``buffer_count`` sub-groups of fp32 (OptimizerSwapper), the parameters' ``buffer_count`` buffers of
``buffer_size`` 16-bit elements (AsyncPartitionedParameterSwapper). The gradient partition stays in host memory, as
with the CPU offload, and the CPU optimizer steps each sub-group as it is swapped in. On a GPU worker the buffers
are pinned (torch's pinned allocator rounds each to a power of two: service/memory/host.py).

Admission. The swap runs through DeepSpeed's ``async_io`` op, which DeepSpeed compiles on first use and which needs
libaio (its shared library and headers: Debian's ``libaio-dev``) and a C++ compiler. :func:`async_io_problem` checks
them on the API's host (a cluster of like nodes is assumed; the worker checks again with DeepSpeed's own builder
before it trains), and the disk's free space at ``nvme_path`` where the API's host sees that path: either missing is
a 422 naming ``training.deepspeed``.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from pathlib import Path

from service.domain.plan import Breakdown, DiskPlan
from service.domain.spec import JobSpec
from service.domain.training import (
    NVME_OPTIMIZER_BUFFERS,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP_ELEMENTS,
    nvme_param_buffer_elements,
)

INCLUDE_DIRS = ("/usr/include", "/usr/local/include", "/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu")


def wanted(spec: JobSpec) -> bool:
    ds = spec.training.deepspeed
    return "nvme" in (ds.offload_optimizer, ds.offload_param)


def swap(spec: JobSpec, host: Breakdown, *, world: int, parameters: int, trainable: int, largest_numel: int,
         param_bytes: int, on_gpu: bool) -> tuple[int, int]:
    """Replace, in ``host``, what the planner counted as offloaded to host memory by what an nvme offload keeps
    there (the swap buffers); returns (bytes a rank writes to the disk, its host buffer bytes)."""
    from service.memory.host import pinned_rounding

    ds = spec.training.deepspeed
    disk = 0
    buffers: list[int] = []
    if ds.offload_optimizer == "nvme":
        part = -(-trainable // world)
        disk += 12 * part
        sub_group = min(NVME_SUB_GROUP_ELEMENTS, part)
        buffers += [4 * sub_group] * NVME_OPTIMIZER_BUFFERS
        host.optimizer_states = 4 * sub_group * NVME_OPTIMIZER_BUFFERS
    if ds.offload_param == "nvme":
        disk += param_bytes * -(-parameters // world)
        elements = nvme_param_buffer_elements(largest_numel)
        buffers += [param_bytes * elements] * NVME_PARAM_BUFFERS
        host.parameters = param_bytes * elements * NVME_PARAM_BUFFERS
    if on_gpu:
        host.overhead += pinned_rounding(buffers)
    return disk, sum(buffers)


def disk_plan(spec: JobSpec, per_rank_bytes: int, buffer_bytes: int, *, ranks_on_node: int | None = None) -> DiskPlan:
    """What the ranks of one node write under ``nvme_path``, against the free space there when this host sees it."""
    ds, res = spec.training.deepspeed, spec.training.resources
    k = ranks_on_node or res.num_workers
    path = ds.nvme_path or ""
    out = DiskPlan(path=path, per_rank_bytes=per_rank_bytes, ranks_on_node=k, node_bytes=k * per_rank_bytes,
                   host_buffer_bytes=buffer_bytes)
    free = free_bytes(path)
    if free is None:
        out.notes.append(f"{path} is not on the API's host: its free space is not checked here (each node's disk "
                         "must hold node_bytes)")
        return out
    out.free_bytes, out.checked = free, True
    out.fits = out.node_bytes <= free
    return out


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem of ``path``, None when the path does not exist on this host."""
    if not path or not Path(path).is_dir():
        return None
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def async_io_problem() -> str | None:
    """Why DeepSpeed's async_io op cannot build on this host, or None: its prerequisites as DeepSpeed's
    AsyncIOBuilder checks them (op_builder/async_io.py: libaio's library and headers, a C++ compiler)."""
    missing = []
    if not ctypes.util.find_library("aio"):
        missing.append("libaio's shared library (libaio.so)")
    includes = [d for d in (*os.environ.get("CPATH", "").split(":"), *INCLUDE_DIRS) if d]
    if not any(Path(d, "libaio.h").is_file() for d in includes):
        missing.append("libaio's headers (libaio.h: Debian/Ubuntu libaio-dev, RHEL libaio-devel)")
    if not (shutil.which("c++") or shutil.which("g++")):
        missing.append("a C++ compiler (c++/g++)")
    if not missing:
        return None
    return ("offload to nvme runs through DeepSpeed's async_io op, which compiles on first use and cannot build "
            f"here: missing {'; '.join(missing)}; install them on every node (or offload to cpu)")
