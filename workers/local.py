"""Run a strategy without Ray: one process, or N processes joined by torch.distributed (gloo on CPU).

The benchmarks use it to measure the very training functions the Ray workers run, without Ray's
fixed start-up cost; tests use it for single-process checks (PEFT methods, accumulation).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, args_dict: dict, out_dir: str, device: str,
            resume_dir: str | None = None) -> None:
    import torch.distributed as dist

    from workers.args import TrainArgs
    from workers.steps import WorkerEnv
    from workers.strategies import train

    faulthandler.enable(all_threads=True)  # a fatal signal (gloo's std::terminate) prints every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world_size)
    try:
        env = WorkerEnv.local(device)
        env.resume_dir = resume_dir
        artifacts = train(TrainArgs(**args_dict), env)
        torch.save({"reports": env.reports, "artifacts": artifacts}, Path(out_dir, f"rank{rank}.pt"))
        # No rank closes its gloo connections while another is still at work: a peer's close reaching gloo's
        # loop thread outside a collective can end that process with an uncaught gloo::IoException (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_local(args, world_size: int = 1, device: str = "cpu", resume_dir: str | None = None) -> list[dict]:
    """Train with ``args`` (a TrainArgs) on ``world_size`` processes, from the checkpoint in
    ``resume_dir`` if given; returns each rank's {"reports": [...], "artifacts": {...}}. World size 1
    runs in this process."""
    from workers.steps import WorkerEnv
    from workers.strategies import train

    if world_size == 1 and args.strategy != "deepspeed" and args.strategy != "fsdp":
        env = WorkerEnv.local(device)
        env.resume_dir = resume_dir
        artifacts = train(args, env)
        return [{"reports": env.reports, "artifacts": artifacts}]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_worker, args=(world_size, _free_port(), args.to_dict(), out, device, resume_dir),
                               nprocs=world_size, join=True, start_method="spawn")
        except mp.ProcessExitedException as exc:
            done = sorted(int(p.stem[4:]) for p in Path(out).glob("rank*.pt"))
            exc.add_note(f"ranks that had written their result before the failure: {done or 'none'} of {world_size}"
                         " (the failed rank's stack, if it was a fatal signal, is in its stderr)")
            raise
        return [torch.load(Path(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
