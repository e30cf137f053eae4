"""FSDP2 checkpoints through torch.distributed.checkpoint, with real gloo processes (no Ray): each
rank writes only its own shard file, the files of every rank's folder merged into one (as Ray Train
merges them) load back at the same world size and at another (2 → 1, 2 → 4, 1 → 2) with the exact
parameters, optimizer states and schedule; a checkpoint in the earlier full ``state.pt`` format still
loads; training resumed from a sharded checkpoint repeats the uninterrupted run's losses (full and
LoRA, which saves only the adapter); the streamed export loads with ``from_pretrained`` and gives the
logits of the gathered export."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from workers.args import TrainArgs  # noqa: E402
from service.ports import free_port as _free_port  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"
VALIDATION = str(EXAMPLES / "chat-validation.jsonl")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen2_dir():
    """Tied input/output embeddings: the export writes the shared weight once."""
    from workers.models import build_preset

    return str(build_preset("preset:tiny-qwen2"))


# --- gloo processes -----------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, fn, args: tuple, nccl_like: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # DeepSpeed reads them
    torch.set_num_threads(1)
    backend = "gloo"
    if nccl_like:  # tests/nccl_like.py: a collective on a host tensor is refused, as NCCL refuses it
        from tests.nccl_like import install

        backend = install()
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args, nccl_like: bool = False) -> None:
    from workers.local import start_processes

    start_processes(_entry, (world, _free_port(), fn, args, nccl_like), world)


def _sharded(model_dir: str, world: int):
    from service.domain.training import regime
    from workers.models import load_model
    from workers.steps import make_optimizer, warmup_cosine
    from workers.strategies.fsdp import shard_fsdp2

    model = shard_fsdp2(load_model(model_dir), torch.device("cpu"), world, regime=regime("fsdp", "none", "fp32"),
                        reshard_after_forward=True, cpu_offload=False)
    optimizer = make_optimizer(model, 1e-2, 0.01)
    return model, optimizer, warmup_cosine(optimizer, 1, 10)


def _train_step(model, optimizer, scheduler, seed: int) -> float:
    from workers.steps import clip_and_step, token_loss_sum

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, 16), generator=g)
    loss = token_loss_sum(model(input_ids=ids).logits, ids) / ids.numel()
    loss.backward()
    clip_and_step(model, optimizer, scheduler, 1.0)
    return float(loss)


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """The gathered (reference) model and optimizer state; every rank calls it, rank 0 gets it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _export_args(out: Path) -> TrainArgs:
    return TrainArgs(job_id="ftjob-dcp", output_dir=str(out), training_path="", model="preset:tiny-qwen2",
                     strategy="fsdp")


def _save_worker(rank: int, world: int, model_dir: str, base: str) -> None:
    """Train two steps, then write: a sharded checkpoint into each rank's own folder, merged into one
    the way Ray Train merges every rank's report; the same state in the earlier ``state.pt`` format;
    the gathered reference; the streamed export (several files) and the gathered export beside it."""
    import torch.distributed as dist

    from workers import checkpoint as ckpt
    from workers.models import load_tokenizer

    torch.manual_seed(0)
    model, optimizer, scheduler = _sharded(model_dir, world)
    for step in range(2):
        _train_step(model, optimizer, scheduler, seed=100 * step + rank)
    base_p = Path(base)
    own = base_p / f"rank{rank}"
    own.mkdir(parents=True)
    ckpt.save_torch_state(str(own), model, optimizer, scheduler, step=2, strategy="fsdp", trained_tokens=64,
                          rank=rank, trainable_only=False)
    old = base_p / "old"
    old.mkdir(exist_ok=True)
    ckpt.save_full_state(str(old), model, optimizer, scheduler, rank=rank, trainable_only=False)
    ckpt.save_rng(str(old), rank)
    ckpt.write_meta(str(old), 2, "fsdp", 64, rank)
    model_sd, optim_sd = _full_state(model, optimizer)
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict()}, base_p / "ref.pt")
    tokenizer = load_tokenizer(model_dir)
    ckpt.export_model_streamed(_export_args(base_p / "streamed"), model, model_dir, tokenizer, rank,
                               max_shard_bytes=40_000)
    gathered = ckpt.full_model_state(model, trainable_only=False)
    if rank == 0:
        ckpt.export_artifacts(_export_args(base_p / "gathered"), gathered, model_dir, tokenizer)
    dist.barrier()
    if rank == 0:
        for r in range(world):  # Ray Train: every rank uploads its folder into the same checkpoint
            shutil.copytree(base_p / f"rank{r}", base_p / "merged", dirs_exist_ok=True)


def _load_worker(rank: int, world: int, model_dir: str, base: str, which: str) -> None:
    """A fresh run at ``world`` ranks loads the checkpoint: its gathered state equals the saved one
    exactly, and it trains on."""
    from workers import checkpoint as ckpt

    torch.manual_seed(1)
    model, optimizer, scheduler = _sharded(model_dir, world)
    meta = ckpt.load_torch_state(str(Path(base, which)), model, optimizer, scheduler, rank=rank,
                                 trainable_only=False)
    assert meta["step"] == 2 and meta["trained_tokens"] == 64
    model_sd, optim_sd = _full_state(model, optimizer)
    if rank == 0:
        ref = torch.load(Path(base, "ref.pt"), weights_only=False)
        assert model_sd.keys() == ref["model"].keys()
        for k, v in ref["model"].items():
            assert torch.equal(model_sd[k], v), k
        assert optim_sd["state"].keys() == ref["optimizer"]["state"].keys()
        for k, states in ref["optimizer"]["state"].items():
            for name, v in states.items():  # step, exp_avg, exp_avg_sq
                assert torch.equal(torch.as_tensor(optim_sd["state"][k][name]), torch.as_tensor(v)), (k, name)
        assert [g["lr"] for g in optim_sd["param_groups"]] == [g["lr"] for g in ref["optimizer"]["param_groups"]]
        assert scheduler.state_dict() == ref["scheduler"]
    loss = _train_step(model, optimizer, scheduler, seed=7 + rank)
    assert loss == loss  # finite: the loaded optimizer steps on


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory, qwen2_dir):
    base = tmp_path_factory.mktemp("saved-at-2")
    _spawn(_save_worker, 2, qwen2_dir, str(base))
    return base


def test_each_rank_writes_only_its_own_shard(saved_at_2):
    merged = saved_at_2 / "merged"
    assert sorted(p.name for p in (merged / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (merged / "state.pt").exists()
    assert {p.name for p in merged.iterdir()} == {"dcp", "scheduler.pt", "meta.json", "rng-rank0.pt", "rng-rank1.pt"}
    for r in (0, 1):  # a rank's own folder holds its shard only; the metadata comes from rank 0
        assert sorted(p.name for p in (saved_at_2 / f"rank{r}" / "dcp").iterdir()) == (
            [".metadata", "__0_0.distcp"] if r == 0 else ["__1_0.distcp"])
    # Each shard file holds about half of the bytes the full state.pt holds (plus DCP's per-tensor
    # framing, which is large next to this tiny model's 64-element norms).
    full = (saved_at_2 / "old" / "state.pt").stat().st_size
    parts = [(merged / "dcp" / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert all(0.4 * full < part < 0.65 * full for part in parts), (parts, full)
    assert abs(parts[0] - parts[1]) < 0.1 * max(parts), parts


@pytest.mark.parametrize("world, which", [(2, "merged"), (1, "merged"), (4, "merged"), (2, "old")],
                         ids=["2to2", "2to1", "2to4", "old-state-pt-2to2"])
def test_a_checkpoint_loads_exactly_at_any_world_size(saved_at_2, qwen2_dir, world, which):
    _spawn(_load_worker, world, qwen2_dir, str(saved_at_2), which)


def test_a_checkpoint_made_on_one_rank_loads_on_two(tmp_path, qwen2_dir):
    _spawn(_save_worker, 1, qwen2_dir, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "merged" / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]
    _spawn(_load_worker, 2, qwen2_dir, str(tmp_path), "merged")


def test_streamed_export_loads_and_matches_the_gathered_export(saved_at_2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    streamed, gathered = saved_at_2 / "streamed" / "model", saved_at_2 / "gathered" / "model"
    files = sorted(p.name for p in streamed.glob("*.safetensors"))
    assert len(files) > 2 and (streamed / "model.safetensors.index.json").is_file(), files  # several files
    assert not (saved_at_2 / "streamed" / ".model.part").exists()
    from safetensors import safe_open

    with safe_open(str(gathered / "model.safetensors"), "pt") as f:  # the same tensors, tied ones once
        assert set(json.loads((streamed / "model.safetensors.index.json").read_text())["weight_map"]) == set(f.keys())
    ref = torch.load(saved_at_2 / "ref.pt", weights_only=False)["model"]
    a = AutoModelForCausalLM.from_pretrained(streamed).eval()
    b = AutoModelForCausalLM.from_pretrained(gathered).eval()
    AutoTokenizer.from_pretrained(streamed)
    for name in ("config.json", "generation_config.json"):  # what save_pretrained wrote, the same
        assert json.loads((streamed / name).read_text()) == json.loads((gathered / name).read_text()), name
    sd = a.state_dict()
    for k, v in ref.items():  # the trained weights, not the base's
        assert torch.equal(sd[k], v), k
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=ids).logits, b(input_ids=ids).logits, rtol=0, atol=0)


# --- the strategy itself: resume repeats the uninterrupted run ----------------------------------


def _args(tmp_path, **kw) -> TrainArgs:
    base = dict(job_id="ftjob-dcp", output_dir=str(tmp_path / "out"), training_path=str(EXAMPLES / "completion.jsonl"),
                model="preset:tiny-llama", strategy="fsdp", learning_rate=1e-2, warmup_steps=2, micro_batch_size=4,
                max_steps=6, checkpoint_every_steps=3, eval_every_steps=3, telemetry_every_steps=1,
                memory_trace_every_steps=1000)
    base.update(kw)
    return TrainArgs(**base)


def _train_worker(rank: int, world: int, args_dict: dict, resume_dir: str | None, out: str) -> None:
    from workers.steps import WorkerEnv
    from workers.strategies import train

    env = WorkerEnv.local()
    env.resume_dir = resume_dir
    artifacts = train(TrainArgs(**args_dict), env)
    torch.save({"reports": env.reports, "artifacts": artifacts}, Path(out, f"rank{rank}.pt"))


def _train(args: TrainArgs, world: int, tmp_path: Path, resume_dir: str | None = None,
           nccl_like: bool = False) -> list[dict]:
    """The strategy on ``world`` gloo processes (workers/local.py's run_local, with a resume folder), under the
    NCCL-like backend when asked."""
    out = tmp_path / f"reports-{len(list(tmp_path.glob('reports-*')))}"
    out.mkdir()
    _spawn(_train_worker, world, args.to_dict(), resume_dir, str(out), nccl_like=nccl_like)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["reports"] if r.get("kind") == "metrics"}


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_fsdp_resumed_from_a_sharded_checkpoint_repeats_the_uninterrupted_losses(tmp_path, peft):
    import torch.distributed.checkpoint as dcp

    # under the NCCL-like backend, with an evaluation at each checkpoint: step, eval, checkpoint and export
    args = _args(tmp_path, peft_method=peft, validation_path=VALIDATION)
    first = _train(args, 2, tmp_path, nccl_like=True)
    assert [r["step"] for r in first[0]["reports"] if r.get("eval_loss")] == [3, 6]
    ckpt_dir = Path(args.output_dir) / "checkpoints" / "step-3"
    assert (ckpt_dir / "dcp" / "__1_0.distcp").is_file() and not (ckpt_dir / "state.pt").exists()
    saved = dcp.FileSystemReader(str(ckpt_dir / "dcp")).read_metadata().state_dict_metadata
    if peft == "lora":  # only the adapter and its optimizer state, never the frozen base
        assert saved and all("lora_" in k for k in saved if k.startswith(("model.", "optimizer.state."))), sorted(saved)
        assert first[0]["artifacts"]["adapter"] == "adapter"
    else:
        assert any(k.endswith("embed_tokens.weight") for k in saved)
        assert first[0]["artifacts"] == {"model": "model"} and first[1]["artifacts"] == {}
    resumed = _args(tmp_path, peft_method=peft, output_dir=str(tmp_path / "resumed"))
    second = _train(resumed, 2, tmp_path, resume_dir=str(ckpt_dir))
    want, got = _losses(first[0]), _losses(second[0])
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_each_rank_writes_its_own_partition_and_resumes(tmp_path, stage):
    """DeepSpeed's own checkpoint: one optimizer-state file per rank (each rank reads back only its
    own: ``elastic_checkpoint`` stays off), the module from rank 0 (ZeRO-2) or per rank (ZeRO-3);
    resuming repeats the losses."""
    args = _args(tmp_path, strategy="deepspeed", ds_stage=stage, validation_path=VALIDATION)
    first = _train(args, 2, tmp_path, nccl_like=True)  # under the NCCL-like backend, evaluating at each checkpoint
    assert [r["step"] for r in first[0]["reports"] if r.get("eval_loss")] == [3, 6]
    ckpt_dir = Path(args.output_dir) / "checkpoints" / "step-3"
    files = sorted(p.name for p in (ckpt_dir / "deepspeed" / "state").iterdir())
    # ZeRO-2: every rank holds the whole 16-bit module, rank 0 writes it; ZeRO-3: each rank its partition.
    module = (["mp_rank_00_model_states.pt"] if stage < 3
              else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
    assert files == sorted(module + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]), files
    resumed = _args(tmp_path, strategy="deepspeed", ds_stage=stage, output_dir=str(tmp_path / "resumed"))
    second = _train(resumed, 2, tmp_path, resume_dir=str(ckpt_dir))
    want, got = _losses(first[0]), _losses(second[0])
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
