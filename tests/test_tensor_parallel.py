"""Tensor parallelism (workers/strategies/tensor.py) on gloo processes: the same update as a single
process over the same global batch (full fine-tune and LoRA, with checkpointing), bf16, resume from
the sharded checkpoint, and an export that from_pretrained loads with the trained model's logits;
and the planner's per-rank shard sizes. The HTTP and Ray path is tests/test_e2e.py -k tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains or starts servers: not in `make test-fast`

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"
NCCL_LIKE = "tests.nccl_like:install"  # tests/nccl_like.py: refuses collectives on host tensors, as NCCL does


# --- admission and the planner's shards (no torch) ------------------------------------------------


def _plan(training: dict, model: str = "preset:small-llama"):
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    spec = JobSpec.model_validate({"model": model, "training_file": "file-x", "training": training})
    return plan(spec, shape_for_model(resolve_model(spec.model, ())), None)


TP = {"strategy": "tensor", "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 4, "max_seq_length": 256}}


def test_a_model_whose_heads_the_ranks_cannot_share_is_refused_by_field():
    from service.domain.errors import SpecInvalid

    with pytest.raises(SpecInvalid) as exc:  # small-qwen2: 2 key/value heads over 4 ranks
        _plan({**TP, "resources": {"num_workers": 4}}, "preset:small-qwen2")
    assert exc.value.param == "training.tensor_parallel.size" and "num_key_value_heads (2)" in str(exc.value)
    with pytest.raises(SpecInvalid) as exc:  # tiny-gpt2: 4 heads over 8 ranks
        _plan({**TP, "resources": {"num_workers": 8}}, "preset:tiny-gpt2")
    assert exc.value.param == "training.tensor_parallel.size" and "num_attention_heads (4)" in str(exc.value)


def test_each_rank_holds_its_share_of_every_block_and_the_rest_whole():
    """small-llama over 2 ranks: q/k/v/o/gate/up/down halved, and (8000 divides by 2) the embedding's and
    the LM head's vocabulary rows; the norms whole; the optimizer's two moments of what each rank trains (and a step per tensor);
    the plan still names the whole model's counts. Over 3 ranks (3 ∤ 8000) the embedding and head whole."""
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model
    from service.memory.tensor_parallel import rank_shape

    shape = shape_for_model(resolve_model("preset:small-llama", ()))
    h, i, q, kv, L, V = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim, shape.num_layers, shape.vocab
    assert not shape.tied_embeddings and V == 8000
    split = L * (h * q + 2 * h * kv + q * h + 3 * h * i) + 2 * V * h  # the blocks, the embedding and the head
    whole = shape.parameter_count() - split
    assert rank_shape(shape, 3).vocab == V and rank_shape(shape, 2).vocab == V // 2
    tp = _plan(TP)
    assert tp.parameter_count == shape.parameter_count()
    assert tp.model_states.device.parameters == (split // 2 + whole) * 4
    # AdamW's two moments of what each rank trains, and its 0-dim fp32 ``step`` per tensor (on the CPU): per block
    # q/k/v/o/gate/up/down and two norms; the embedding, the head and the final norm
    steps = 4 * (L * 9 + 3)
    assert tp.model_states.device.gradients == (split // 2 + whole) * 4
    assert tp.model_states.device.optimizer_states == 2 * (split // 2 + whole) * 4 + steps
    # LoRA on the attention: lora_A whole and lora_B halved on q/k/v, lora_A halved and lora_B whole on o
    lora = _plan({**TP, "peft": {"method": "lora", "r": 8}})
    r = 8
    adapter = L * r * ((h + q // 2) + 2 * (h + kv // 2) + (q // 2 + h))
    assert lora.trainable_parameter_count == L * r * ((h + q) + 2 * (h + kv) + (q + h))
    assert lora.model_states.device.gradients == adapter * 4
    # 1/2 of the heads and columns: the attention's and the MLP's activations shrink, the residual stream's not
    ddp = _plan({**TP, "strategy": "ddp", "resources": {"num_workers": 1}})
    assert ddp.activations_saved_bytes / 2 < tp.activations_saved_bytes < ddp.activations_saved_bytes


# --- the worker on gloo processes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_local():
    pytest.importorskip("torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workers.local import run_local

    return run_local


def _args(out: Path, **kw):
    from workers.args import TrainArgs

    base = dict(job_id="ftjob-tp", output_dir=str(out), training_path=str(EXAMPLES / "chat.jsonl"),
                model="preset:tiny-llama", learning_rate=1e-2, warmup_steps=2, micro_batch_size=4, accumulation=2,
                max_steps=4, max_seq_length=64, checkpoint_every_steps=100, telemetry_every_steps=1,
                memory_trace_every_steps=1000)
    base.update(kw)
    return TrainArgs(**base)


def _tensor(out: Path, **kw):
    return _args(out, strategy="tensor", **kw)


def _losses(ranks: list[dict]) -> list[float]:
    return [r["loss"] for r in ranks[0]["reports"] if r.get("kind") == "metrics"]


@pytest.mark.parametrize("model", ["preset:tiny-llama", "preset:tiny-qwen2", "preset:tiny-gpt2"])
def test_tensor_parallel_trains_exactly_as_one_process(tmp_path, run_local, model):
    """Two ranks, each with half the heads and MLP columns, give the single process's losses step for
    step (full fine-tune: every split weight, the replicated embeddings, norms and head, clipping).
    GPT-2's fused c_attn is regrouped so each rank's share is its own heads' q, k and v: its export
    puts the columns back, and loads with the single process's logits."""
    one_ranks = run_local(_args(tmp_path / "one", model=model), world_size=1)
    # under the NCCL-like backend: DTensor's functional collectives, the vocabulary-parallel loss, the export's gathers
    tp_ranks = run_local(_tensor(tmp_path / "tp", model=model), world_size=2, worker_setup=NCCL_LIKE)
    one, tp = _losses(one_ranks), _losses(tp_ranks)
    assert len(tp) == 4 and tp[-1] < tp[0]
    assert tp == pytest.approx(one, rel=1e-5)
    # really split: each rank holds the planner's share (half of every block's projections)
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model
    from service.memory.tensor_parallel import rank_shape

    shape = shape_for_model(resolve_model(model, ()))
    held = [m["parameters_bytes"] for r in tp_ranks[0]["reports"] if r.get("kind") == "metrics"
            for m in r["memory"] if "parameters_bytes" in m]
    assert held[0] == rank_shape(shape, 2).parameter_count() * 4 < shape.parameter_count() * 4
    if model == "preset:tiny-gpt2":
        import torch
        from transformers import AutoModelForCausalLM

        ids = torch.arange(1, 33).unsqueeze(0)
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "model")(ids).logits
            got = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "model")(ids).logits
        assert torch.allclose(got, want, atol=1e-3)


def _vocab_step(rank: int, world: int, port: int, out: str) -> None:
    """One forward and backward of tiny-gpt2 split over ``world`` ranks, as the loop runs it: what the
    logits, the tied embedding/head and the step's collectives look like on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from workers.models import resolve_model_dir
    from workers.steps import forward_loss_sum
    from workers.strategies.common import build_model
    from workers.strategies.tensor import loss_context, make_mesh, parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        torch.manual_seed(0)
        model = parallelize(build_model(_args(Path(out), model="preset:tiny-gpt2"),
                                        resolve_model_dir("preset:tiny-gpt2", None)), make_mesh(world, rank, world, cpu),
                            cpu, False)
        ids = torch.randint(0, 512, (2, 16))
        labels = ids.clone()
        labels[:, :4] = -100
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        logits: list = []
        model.lm_head.register_forward_hook(lambda _m, _a, o: logits.append(o))
        with CommDebugMode() as comms, loss_context(model, world):
            loss = forward_loss_sum(model, batch, cpu, None)
            loss.backward()
        wte = model.transformer.wte.weight
        torch.save({"logits_local": tuple(logits[0].to_local().shape), "logits_global": tuple(logits[0].shape),
                    "tied": model.lm_head.weight is wte, "wte_local": tuple(wte.to_local().shape),
                    "wpe_local": tuple(getattr(model.transformer.wpe.weight, "_local_tensor", model.transformer.wpe.weight).shape),
                    "comms": {str(k): v for k, v in comms.get_comm_counts().items()}, "loss": float(loss)},
                   Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_vocabulary_is_split_and_its_logits_never_gathered(tmp_path):
    """tiny-gpt2 (vocabulary 512, embedding and head tied) over 2 ranks: each holds 256 rows of the one
    tied weight (the position embedding whole), its logits are a DTensor whose local share is 256 wide,
    and no collective of the step gathers anything: cross-entropy and its backward reduce over the
    group under loss_parallel (without it, F.cross_entropy would all-gather the logits to replicate them)."""
    torch = pytest.importorskip("torch")

    from workers.local import _free_port, start_processes
    from workers.models import build_preset

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_preset("preset:tiny-gpt2")
    start_processes(_vocab_step, (2, _free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["logits_global"] == (2, 16, 512) and r["logits_local"] == (2, 16, 256)
        assert r["tied"] and r["wte_local"] == (256, 64) and r["wpe_local"] == (1024, 64)
        assert not [k for k in r["comms"] if "gather" in k], r["comms"]
    assert ranks[0]["loss"] == ranks[1]["loss"] > 0


def test_gpt2_lora_on_the_fused_attention_matches_ddp_and_merges_in_order(tmp_path, run_local):
    """LoRA on GPT-2's c_attn (its lora_B regrouped with the base's columns), c_proj and c_fc: DDP's
    losses, and the exported adapter merges into the model DDP's adapter merges into."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.models import build_preset

    # built here first: a spawned rank that builds the preset draws its random weights from the RNG that
    # then initialises lora_A, and only DDP's run would be the one to build it on a cold cache
    build_preset("preset:tiny-gpt2")
    kw = dict(model="preset:tiny-gpt2", peft_method="lora", learning_rate=1e-2, peft_targets=["c_attn", "c_proj", "c_fc"])
    # DDP on two ranks under the NCCL-like backend, with an evaluation and a checkpoint: its step's, eval's,
    # checkpoint's and export's collectives on the worker's device
    ddp_ranks = run_local(_args(tmp_path / "ddp", micro_batch_size=2, validation_path=str(EXAMPLES / "chat-validation.jsonl"),
                                checkpoint_every_steps=2, eval_every_steps=2, **kw), world_size=2, worker_setup=NCCL_LIKE)
    assert [r["step"] for r in ddp_ranks[0]["reports"] if r.get("eval_loss")] == [2, 4]
    ddp = _losses(ddp_ranks)
    ranks = run_local(_tensor(tmp_path / "tp", **kw), world_size=2)
    assert _losses(ranks) == pytest.approx(ddp, rel=1e-5)
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp" / "merged")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "merged")(ids).logits
    assert torch.allclose(got, want, atol=1e-3)


def test_attention_dropout_draws_per_rank_masks_and_leaves_the_shared_stream_in_step():
    """sync_dropout on GPT-2 with dropout in the attention and the residual stream, as ranks 0 and 1 of
    a tp group run it (one process each, from the same seed): the heads' dropout masks differ between
    the ranks (each has its own stream), and after the forward both ranks' generators are in the same
    state, so the replicated residual stream's dropout drew the same numbers on both."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.models import resolve_model_dir
    from workers.strategies.tensor import sync_dropout

    cfg = AutoConfig.from_pretrained(resolve_model_dir("preset:tiny-gpt2", None))
    cfg.update({"attn_pdrop": 0.5, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "_attn_implementation": "eager"})
    ids = torch.arange(1, 17).unsqueeze(0)
    seen, states = [], []
    for tp_rank in (0, 1):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).train()
        sync_dropout(model, tp_rank, torch.device("cpu"))
        heads: list = []
        model.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda _m, a: heads.append(a[0].detach()))
        torch.manual_seed(1)
        model(ids)
        seen.append(heads[0])
        states.append(torch.get_rng_state())
    assert not torch.equal(seen[0], seen[1])
    assert torch.equal(states[0], states[1])


def test_lora_with_checkpointing_matches_ddp_and_exports_an_adapter(tmp_path, run_local):
    kw = dict(peft_method="lora", gradient_checkpointing=True, learning_rate=5e-2,
              peft_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # against DDP on two ranks (the same global batch); whichever process builds the preset, every run's lora_A
    # starts from the same RNG state (workers/models.py forks the RNG for the build)
    ddp = _losses(run_local(_args(tmp_path / "ddp", micro_batch_size=2, **kw), world_size=2))
    ranks = run_local(_tensor(tmp_path / "tp", **kw), world_size=2)
    assert _losses(ranks) == pytest.approx(ddp, rel=1e-5)
    assert ranks[0]["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    assert (tmp_path / "tp" / "adapter" / "adapter_model.safetensors").is_file()


def test_bf16_tensor_parallel_trains(tmp_path, run_local):
    losses = _losses(run_local(_tensor(tmp_path / "tp", precision="bf16", max_steps=6), world_size=2))
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_resume_from_the_sharded_checkpoint_repeats_the_uninterrupted_run(tmp_path, run_local):
    kw = dict(peft_method="lora", max_steps=6, learning_rate=5e-2)
    full = _losses(run_local(_tensor(tmp_path / "full", **kw), world_size=2))
    # under the NCCL-like backend, with an evaluation at each checkpoint
    first = run_local(_tensor(tmp_path / "first", checkpoint_every_steps=3, eval_every_steps=3,
                              validation_path=str(EXAMPLES / "chat-validation.jsonl"), **kw),
                      world_size=2, worker_setup=NCCL_LIKE)
    assert [r["step"] for r in first[0]["reports"] if r.get("eval_loss")] == [3, 6]
    step3 = tmp_path / "first" / "checkpoints" / "step-3"
    assert (step3 / "dcp" / ".metadata").is_file()
    resumed = run_local(_tensor(tmp_path / "resumed", **kw), world_size=2, resume_dir=str(step3))
    steps = {r["step"]: r["loss"] for r in resumed[0]["reports"] if r.get("kind") == "metrics"}
    assert sorted(steps) == [4, 5, 6]
    assert [steps[s] for s in (4, 5, 6)] == pytest.approx(full[3:], rel=1e-5)
    assert _losses(first) == pytest.approx(full, rel=1e-5)


def test_export_is_one_folder_with_the_trained_logits(tmp_path, run_local):
    """The shards gathered into one Hugging Face folder: from_pretrained loads it and gives the logits
    of the single process's export, which trained the same steps on the same data."""
    import torch
    from transformers import AutoModelForCausalLM

    run_local(_args(tmp_path / "one"), world_size=1)
    run_local(_tensor(tmp_path / "tp"), world_size=2)
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "model")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "model")(ids).logits
    # fp32 rounding only: a row-wise layer sums its two halves' partial products in another order than
    # one matmul does, and four AdamW steps at lr 1e-2 carry the ~1e-7 differences to ~1e-4 in the logits
    assert torch.allclose(got, want, atol=1e-3)
    from workers.models import resolve_model_dir

    with torch.no_grad():  # ... far below what the training changed
        base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("preset:tiny-llama", None))(ids).logits
    assert (got - base).abs().max() > 100 * (got - want).abs().max()


def test_two_replicas_of_a_two_way_split_match_ddp_on_two_ranks(tmp_path, run_local):
    """A 2 × 2 mesh (dp × tp): FSDP2 over the replicas of each rank's share, as DDP's two ranks."""
    ddp = _losses(run_local(_args(tmp_path / "ddp", micro_batch_size=2), world_size=2))
    tp = _losses(run_local(_tensor(tmp_path / "tp", micro_batch_size=2, tensor_parallel_size=2), world_size=4))
    assert tp == pytest.approx(ddp, rel=1e-5)


def test_a_two_by_two_mesh_resumes_and_exports(tmp_path, run_local):
    """FSDP2 × TP: the DCP checkpoint of a 2 × 2 mesh resumes with the uninterrupted run's losses, and
    the gathered export loads with the logits of the same training on one process's DDP twin."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = dict(micro_batch_size=2, tensor_parallel_size=2, max_steps=4)
    full = _losses(run_local(_tensor(tmp_path / "full", **kw), world_size=4))
    run_local(_tensor(tmp_path / "first", checkpoint_every_steps=2, **kw), world_size=4)
    resumed = run_local(_tensor(tmp_path / "resumed", **kw), world_size=4,
                        resume_dir=str(tmp_path / "first" / "checkpoints" / "step-2"))
    steps = {r["step"]: r["loss"] for r in resumed[0]["reports"] if r.get("kind") == "metrics"}
    assert [steps[s] for s in (3, 4)] == pytest.approx(full[2:], rel=1e-5)
    run_local(_args(tmp_path / "ddp", micro_batch_size=2), world_size=2)
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp" / "model")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "model")(ids).logits
    assert torch.allclose(got, want, atol=1e-3)
