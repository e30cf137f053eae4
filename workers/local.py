"""Run a strategy without Ray: one process, or N processes joined by torch.distributed (gloo on CPU).

The benchmarks use it to measure the very training functions the Ray workers run, without Ray's
fixed start-up cost; tests use it for single-process checks (PEFT methods, accumulation).

On CPU the ranks are forked from one fork server per process that has imported torch, transformers, peft
and the strategies once (about 8 CPU-seconds a rank otherwise, the bulk of a short gloo run); each rank then
takes the caller's environment as it is at the call. On a GPU they are spawned: nothing that may have touched
CUDA is ever forked.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from pathlib import Path

import torch
from service.ports import free_port as _free_port


def _worker(rank: int, world_size: int, port: int, args_dict: dict, out_dir: str, device: str,
            resume_dir: str | None = None, worker_setup: str | None = None) -> None:
    import torch.distributed as dist

    from workers.args import TrainArgs
    from workers.steps import WorkerEnv
    from workers.strategies import train

    faulthandler.enable(all_threads=True)  # a fatal signal (gloo's std::terminate) prints every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    backend = "gloo" if device == "cpu" else "nccl"
    if worker_setup:  # "module:function" run first in the worker; it returns the backend to use
        backend = _call(worker_setup)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
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


# What every rank imports before its first step: the fork server imports it once.
_PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "workers.args", "workers.steps", "workers.strategies"]


def start_processes(fn, args: tuple, nprocs: int, device: str = "cpu") -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs), joined: ranks forked from the preloaded fork
    server on CPU (each with this process's current environment), spawned on a GPU."""
    import torch.multiprocessing as mp

    if device != "cpu":
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    forkserver_context()
    mp.start_processes(with_environ, args=(fn, dict(os.environ), os.getcwd(), *args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def forkserver_context():
    """multiprocessing's fork-server context, its server preloading what a rank imports (read when it starts).
    A process started from it runs ``with_environ`` to take the caller's environment: see start_processes."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def with_environ(rank: int, fn, environ: dict, cwd: str, *args) -> None:
    """A forked rank: the caller's environment and folder (the server's are those of its own start), then fn."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fn(rank, *args)


def _call(ref: str):
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)()


def run_local(args, world_size: int = 1, device: str = "cpu", resume_dir: str | None = None,
              worker_setup: str | None = None) -> list[dict]:
    """Train with ``args`` (a TrainArgs) on ``world_size`` processes, from the checkpoint in
    ``resume_dir`` if given; returns each rank's {"reports": [...], "artifacts": {...}}. World size 1
    runs in this process (unless ``worker_setup`` is given). ``worker_setup`` ("module:function") runs in
    each worker before its process group starts and returns the torch.distributed backend to use (the
    tests' NCCL-like backend: tests/nccl_like.py)."""
    from workers.steps import WorkerEnv
    from workers.strategies import train

    if world_size == 1 and args.strategy != "deepspeed" and args.strategy != "fsdp" and not worker_setup:
        env = WorkerEnv.local(device)
        env.resume_dir = resume_dir
        artifacts = train(args, env)
        return [{"reports": env.reports, "artifacts": artifacts}]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        try:
            start_processes(_worker, (world_size, _free_port(), args.to_dict(), out, device, resume_dir, worker_setup),
                            world_size, device)
        except mp.ProcessExitedException as exc:
            done = sorted(int(p.stem[4:]) for p in Path(out).glob("rank*.pt"))
            exc.add_note(f"ranks that had written their result before the failure: {done or 'none'} of {world_size}"
                         " (the failed rank's stack, if it was a fatal signal, is in its stderr)")
            raise
        return [torch.load(Path(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
