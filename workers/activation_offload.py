"""Activation offloading (``training.activation_offload``): what the model's forward saves for backward
is copied to pinned host memory as it is saved and copied back when backward needs it, so the GPU holds
the activations of the block being computed instead of every block's.

torch.autograd.graph.save_on_cpu does the same but also copies the parameters that autograd saves
(every linear keeps its weight) and copies synchronously; this follows torchtune's OffloadActivations
(torchtune/training/_activation_offloading.py, its single-stream mode): parameters and tensors under
``MIN_OFFLOAD_BYTES`` stay where they are, and the copies are queued on the compute stream
(non-blocking into pinned memory), so the device memory of an offloaded tensor is reused only by work
queued after its copy, and the copy back is ordered before the backward op that reads it.

Only the model's forward runs under it (workers/steps.py forward_loss_sum): the loss's log-softmax is
needed first in backward and would only travel there and back. On a CPU worker the "host" is the same
memory, so the spec refuses the knob there (it needs GPUs, like fp16); on a CPU device these hooks
still run (copies into ordinary host memory), which is how the tests and ``bench/gpu_check.py --dry-run``
check the wiring and that training is unchanged.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

# Below this a tensor stays on the device: per-token statistics (RMSNorm's rsqrt, SDPA's log-sum-exp,
# the token ids) are < 1% of a block's activations and not worth two copies (torchtune: 1 KiB).
MIN_OFFLOAD_BYTES = 1 << 20


class OffloadToHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of ``device`` to host memory (pinned on CUDA) and back."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        pin = device.type == "cuda"
        self.offloaded_bytes = 0  # what went to the host in this context
        # One host copy per tensor: q, k and v (gate and up) projections save the same input. Keyed by the
        # tensor object while it lives (a finalizer drops the entry, so a reused id never hits).
        copies: dict[int, tuple] = {}

        def pack(t: torch.Tensor):
            if (isinstance(t, torch.nn.Parameter) or t.device.type != device.type or t.is_sparse
                    or t.numel() * t.element_size() < min_bytes):
                return t
            key = id(t)
            if key in copies:
                return copies[key]
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            self.offloaded_bytes += host.numel() * host.element_size()
            copies[key] = (t.device, host)
            weakref.finalize(t, copies.pop, key, None)
            return copies[key]

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            dev, host = packed
            return host.to(dev, non_blocking=pin)

        super().__init__(pack, unpack)


def offloading(device: torch.device, enabled: bool):
    """The context forward runs in: offload to host when ``enabled``, else nothing."""
    return OffloadToHost(device) if enabled else contextlib.nullcontext()
