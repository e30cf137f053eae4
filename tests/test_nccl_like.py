"""The NCCL-like backend of tests/nccl_like.py on two gloo processes: it refuses a collective on a host tensor
(made without ``device=``, as the pipeline's loss and token counts once were, which NCCL refuses) with NCCL's
own message, through ``torch.distributed`` and through the functional collectives DTensor runs, and takes
tensors made on the worker's device, moved there, or computed from the model's weights. Every strategy's
step, eval, checkpoint and export run under it in their own tests (workers/local.py ``run_local(...,
worker_setup=NCCL_LIKE)``: test_pipeline.py, test_tensor_parallel.py, test_checkpoint_sharded.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # starts processes

NCCL_LIKE = "tests.nccl_like:install"


def _probe(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tests.nccl_like import HostTensorRefused, install

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = install()
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cpu")
    seen: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
            seen[name] = "ok"
        except HostTensorRefused as exc:
            seen[name] = f"refused: {exc}"

    try:
        # the pipeline's former loss sum: a host tensor (no device=) all-reduced
        attempt("host_all_reduce", lambda: dist.all_reduce(torch.tensor(1.0, dtype=torch.float64)))
        # ... and derived from one: still on the host
        attempt("derived_all_reduce", lambda: dist.all_reduce(torch.zeros(()).double().pow(2)))
        attempt("device_all_reduce", lambda: dist.all_reduce(torch.tensor(1.0, dtype=torch.float64, device=device)))
        attempt("moved_all_reduce", lambda: dist.all_reduce(torch.ones(3).to(device)))
        attempt("host_all_gather", lambda: dist.all_gather_into_tensor(torch.empty(2 * world, device=device),
                                                                       torch.ones(2)))
        attempt("host_funcol", lambda: funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)))
        attempt("device_funcol", lambda: funcol.wait_tensor(
            funcol.all_reduce(torch.ones(2, device=device), "sum", dist.group.WORLD)))
        layer = torch.nn.Linear(4, 4).to(device)  # a module moved to the device: its weights and outputs are on it
        attempt("module_output", lambda: dist.all_reduce(layer(torch.ones(2, 4, device=device)).detach()))
        attempt("object_collective", lambda: dist.all_gather_object([None] * world, {"rank": rank}))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        attempt("dtensor", lambda: distribute_tensor(torch.arange(8.0, device=device).reshape(4, 2), mesh,
                                                     [Shard(0)]).full_tensor())
        if rank == 0:
            torch.save(seen, Path(out, "seen.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_host_tensors_are_refused_as_nccl_refuses_them_and_device_tensors_pass(tmp_path):
    from workers.local import _free_port, start_processes

    start_processes(_probe, (2, _free_port(), str(tmp_path)), 2)
    seen = torch.load(tmp_path / "seen.pt")
    refused = {k for k, v in seen.items() if v != "ok"}
    assert refused == {"host_all_reduce", "derived_all_reduce", "host_all_gather", "host_funcol"}, seen
    assert "No backend type associated with device type cpu" in seen["host_all_reduce"]
    assert "shape ()" in seen["host_all_reduce"] and "torch.float64" in seen["host_all_reduce"]
