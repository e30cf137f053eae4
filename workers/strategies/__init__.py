"""One training function per strategy, each in its own module with its loop in plain sight: ddp.py,
fsdp.py, deepspeed.py, pipeline.py, tensor.py. common.py holds what they share before and after the loop (data,
the model as built, eval, the per-step cadence), qat.py the QAT transform; the step itself is
workers/steps.py, checkpoints workers/checkpoint.py, data workers/data.py.

Every function takes flat ``TrainArgs`` and a ``WorkerEnv`` (rank, device, report) and runs the same
on CPU/gloo and CUDA/nccl: the device comes from the environment, GPU-only pieces (fp16 grad
scaling, pinned memory, DeepSpeed's compiled optimizers) are switched on by the device type. The
dtypes each holds and computes in come from service/domain/training.py's regime, the planner's.
"""

from __future__ import annotations

from workers.args import TrainArgs
from workers.steps import WorkerEnv
from workers.strategies.common import build_model, prepare
from workers.strategies.ddp import train_ddp
from workers.strategies.deepspeed import deepspeed_config, train_deepspeed
from workers.strategies.fsdp import shard_fsdp2, train_fsdp
from workers.strategies.pipeline import train_pipeline
from workers.strategies.qat import qat_export
from workers.strategies.tensor import train_tensor

__all__ = ["STRATEGIES", "build_model", "deepspeed_config", "prepare", "qat_export", "shard_fsdp2", "train"]

STRATEGIES = {"ddp": train_ddp, "fsdp": train_fsdp, "deepspeed": train_deepspeed, "pipeline": train_pipeline,
              "tensor": train_tensor}


def train(args: TrainArgs, env: WorkerEnv) -> dict:
    return STRATEGIES[args.strategy](args, env)
