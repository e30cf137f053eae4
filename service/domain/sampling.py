"""Which rows every rank trains on at every optimizer step: one rule, torch-free, for the workers' sampler
(workers/data.py: StepSampler) and the planner (service/memory/steps.py), which can then say which rows each
rank's micro-batch holds at every step, and so how wide it is, before the run.

The data is an endless stream of epochs, each a seeded permutation of the rows (:func:`permutation`).
Optimizer step ``s`` consumes stream positions [s·G, (s+1)·G) with G = micro × accumulation × world;
micro-batch m of rank r takes the ``micro`` positions starting at s·G + (m·world + r)·micro. Resuming at step
s needs nothing but s, and the same global batch split differently (more accumulation, fewer ranks: a
downshift, an elastic resize) covers the same rows in the same step.

The rows are the training file's examples cut to ``max_seq_length`` or, with packing, the rows
service/domain/encoding.py packs them into (its ``pack``: the examples concatenated in file order and cut into
rows of ``max_seq_length``); their lengths are encoding's ``row_lengths``.

The permutation is memfit's own, not torch.randperm's (which the service cannot run): Fisher–Yates
(Durstenfeld's form) driven by SplitMix64 (Steele, Lea and Flood 2014), seeded with the job's seed and the
epoch. It is defined here, by this code, and never changes with a library's version. (Before it, the workers
drew torch.randperm: the same rows, in another order.)
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64's output function of a state."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def permutation(n: int, seed: int, epoch: int) -> array:
    """A permutation of range(n), as an ``array('L')``: for i from n − 1 down to 1, swap i with j = x mod (i + 1),
    x the next SplitMix64 output of a state that starts at mix(seed) + epoch·γ. (The modulo's bias is below
    n/2⁶⁴: nothing a training run could tell.)"""
    out = array("L", range(n))
    state = (_mix((seed * _GAMMA) & _MASK) + epoch * _GAMMA) & _MASK
    for i in range(n - 1, 0, -1):
        state = (state + _GAMMA) & _MASK
        j = _mix(state) % (i + 1)
        out[i], out[j] = out[j], out[i]
    return out


_PERMS: OrderedDict[tuple[int, int, int], array] = OrderedDict()
_PERMS_LOCK = threading.Lock()
_PERMS_KEPT = 16  # epochs kept per process (a 1M-row file: 8 MB each)


def cached_permutation(n: int, seed: int, epoch: int) -> array:
    """:func:`permutation`, kept for the latest epochs asked for (the workers walk one epoch at a time; the
    service asks for the epochs of the steps it compares)."""
    key = (n, seed, epoch)
    with _PERMS_LOCK:
        if key in _PERMS:
            _PERMS.move_to_end(key)
            return _PERMS[key]
    perm = permutation(n, seed, epoch)
    with _PERMS_LOCK:
        _PERMS[key] = perm
        while len(_PERMS) > _PERMS_KEPT:
            _PERMS.popitem(last=False)
    return perm


@dataclass
class StepOrder:
    """The stream of the module docstring, for one run's split of its global batch."""

    n_examples: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    seed: int
    _perm: tuple[int, array] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    def total_steps(self, n_epochs: int, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(n_epochs * self.n_examples / self.global_batch))

    def epoch_at(self, step: int) -> float:
        return step * self.global_batch / self.n_examples

    def row_at(self, position: int) -> int:
        """The row at a stream position."""
        epoch, i = divmod(position, self.n_examples)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, cached_permutation(self.n_examples, self.seed, epoch))
        return self._perm[1][i]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The rows of each micro-batch rank ``rank`` trains on at optimizer step ``step`` (0-based), in order."""
        base = step * self.global_batch
        out = []
        for m in range(self.accumulation):
            start = base + (m * self.world_size + rank) * self.micro_batch_size
            out.append([self.row_at(p) for p in range(start, start + self.micro_batch_size)])
        return out
