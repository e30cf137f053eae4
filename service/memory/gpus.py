"""The GPU catalogue: memory capacity as the driver reports it, and the overheads outside the allocator.

``capacity_bytes`` is the total that ``torch.cuda.mem_get_info()`` / ``nvidia-smi`` report for the
card (a little under the marketing number: the driver keeps some for ECC and itself).
``context_bytes`` is what a PyTorch process holds before its first tensor — the CUDA context,
loaded kernels and the cuBLAS/cuDNN workspaces — which the caching allocator never sees; it grows
with the architecture's kernel images. ``nccl_bytes`` is the typical per-process NCCL buffer set
for one process group on one node (channels × buffers of 4 MiB for the simple protocol, plus LL
and LL128 buffers), again invisible to ``memory_allocated``.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    display: str
    capacity_bytes: int
    architecture: str
    bf16: bool
    context_bytes: int
    nccl_bytes: int = 300 * MiB

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "display": self.display,
            "capacity_bytes": self.capacity_bytes,
            "architecture": self.architecture,
            "bf16": self.bf16,
            "context_bytes": self.context_bytes,
            "nccl_bytes": self.nccl_bytes,
        }


# CUDA context + kernels + workspaces per architecture, measured as mem_get_info used after
# `torch.zeros(1, device="cuda")` and one cuBLAS matmul (torch 2.x, CUDA 12).
CONTEXT_BYTES = {
    "volta": 310 * MiB,
    "turing": 320 * MiB,
    "ampere": 430 * MiB,
    "ada": 450 * MiB,
    "hopper": 530 * MiB,
    "blackwell": 600 * MiB,
}


def _gpu(name, display, mib, arch, bf16=True):
    return GPU(name, display, mib * MiB, arch, bf16, CONTEXT_BYTES[arch])


CATALOGUE: dict[str, GPU] = {
    g.name: g
    for g in [
        _gpu("v100-16gb", "NVIDIA V100 16GB", 16160, "volta", bf16=False),
        _gpu("v100-32gb", "NVIDIA V100 32GB", 32510, "volta", bf16=False),
        _gpu("t4", "NVIDIA T4 16GB", 15102, "turing", bf16=False),
        _gpu("l4", "NVIDIA L4 24GB", 22491, "ada"),
        _gpu("a10g", "NVIDIA A10G 24GB", 22731, "ampere"),
        _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24210, "ada"),
        _gpu("a100-40gb", "NVIDIA A100 40GB", 40536, "ampere"),
        _gpu("a100-80gb", "NVIDIA A100 80GB", 81251, "ampere"),
        _gpu("h100-80gb", "NVIDIA H100 80GB", 81559, "hopper"),
        _gpu("h200-141gb", "NVIDIA H200 141GB", 143771, "hopper"),
        _gpu("b200", "NVIDIA B200 180GB", 183359, "blackwell"),
    ]
}

ALIASES = {
    "v100": "v100-16gb",
    "a100": "a100-40gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "4090": "rtx-4090",
    "b200-180gb": "b200",
    "a10": "a10g",
}


class UnknownGPU(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; this one is meant to be read
        return self.args[0]


def known_gpus() -> set[str]:
    return set(CATALOGUE)


def get_gpu(name: str) -> GPU:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in CATALOGUE:
        raise UnknownGPU(f"unknown GPU {name!r}; known: {', '.join(sorted(CATALOGUE))}")
    return CATALOGUE[key]
