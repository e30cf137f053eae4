"""Pipeline parallelism: one stage per worker. Accepted by the spec, not yet run by the workers."""

from __future__ import annotations

from workers.args import TrainArgs
from workers.steps import WorkerEnv


def train_pipeline(args: TrainArgs, env: WorkerEnv) -> dict:
    raise NotImplementedError(
        "training.strategy 'pipeline' is not available in this version of the workers; use ddp, fsdp or deepspeed"
    )
