"""Tensor parallelism (workers/strategies/tensor.py): each rank of a group of ``tensor_parallel.size`` computes
1/size of every block's heads and MLP columns (and of the vocabulary where size divides it), a model of its own
(service/memory/tensor_parallel.py: rank_shape, applied in service/memory/job.py); the rest of the workers are
data-parallel replicas of the group, sharded by FSDP2 when there are several (strategies/fsdp.py), whole when
there is one (as DDP over one rank: no buckets).
"""

from __future__ import annotations

from service.memory.job import PlannedJob
from service.memory.precision import StateBytes
from service.memory.strategies import ddp, fsdp
from service.memory.strategies.terms import StrategyTerms


def states(job: PlannedJob, sb: StateBytes, adam_steps: int) -> StrategyTerms:
    if job.world == 1:
        return ddp.states(job, sb, adam_steps)
    return fsdp.states(job, sb, adam_steps)


def vocab_split(job: PlannedJob) -> bool:
    """The rank holds a share of the vocabulary: its loss runs under loss_parallel (activations/head.py)."""
    return job.strategy == "tensor" and job.shape.vocab != job.model_shape.vocab
