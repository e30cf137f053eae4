"""Chunked cross-entropy (training.loss_chunk_tokens, workers/chunked_loss.py) and activation offloading
(training.activation_offload, workers/activation_offload.py): the same loss and gradients as the plain
step, the full b·s·V logits never materialised, every strategy it applies to on gloo processes, the
spec's refusals, and the planner's per-chunk loss terms. The memory the planner predicts for chunked
configs is measured by ``bench/memory_accuracy.py --chunked``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # trains or fuzzes: not in `make test-fast`

from service.domain.errors import SpecInvalid  # noqa: E402
from service.domain.spec import JobSpec, SpecError, validate_spec  # noqa: E402
from service.memory.planner import plan  # noqa: E402
from service.memory.shape import shape_from_config  # noqa: E402
from workers.args import TrainArgs  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"


def _args(out, **kw) -> TrainArgs:
    base = dict(job_id="ftjob-chunk", output_dir=str(out), training_path=str(EXAMPLES / "chat.jsonl"),
                model="preset:tiny-llama", learning_rate=1e-2, micro_batch_size=2, max_steps=3, max_seq_length=64,
                checkpoint_every_steps=100, telemetry_every_steps=1, memory_trace_every_steps=1000, peft_merge=False)
    base.update(kw)
    return TrainArgs(**base)


# --- one process: loss, gradients, no full logits ----------------------------------------------------


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest number of elements any op produced while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _step(model_name: str, chunk: int | None, offload: bool = False, **kw):
    """One forward + backward of a fixed batch (some positions without a label) through the workers'
    own build_model and forward_loss_sum. Returns (loss sum, {name: grad}, largest tensor's elements,
    vocabulary size)."""
    from workers import steps as W
    from workers.models import build_preset
    from workers.strategies.common import autocast_dtype, build_model, training_regime

    args = _args("/tmp/unused", model=model_name, loss_chunk_tokens=chunk, **kw)
    model_dir = str(build_preset(model_name))  # before seeding: building a preset the first time draws numbers
    torch.manual_seed(0)
    model = build_model(args, model_dir)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 96), generator=g)
    labels = ids.clone()
    labels[0, :30] = -100  # a prompt without labels
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with LargestTensor() as largest:
        loss = W.forward_loss_sum(model, batch, torch.device("cpu"), autocast_dtype(training_regime(args)), offload)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, largest.numel, model.config.vocab_size


@pytest.mark.parametrize("model_name,kw,tol", [
    ("preset:tiny-llama", {}, 1e-5),
    ("preset:tiny-llama", {"precision": "bf16"}, 2e-2),  # bf16 matmuls of a chunk vs the whole batch
    ("preset:tiny-gpt2", {"peft_method": "lora"}, 1e-5),  # tied embeddings, a frozen head
    ("preset:tiny-qwen2", {"peft_method": "prompt_tuning"}, 1e-5),  # virtual tokens in front of the labels
], ids=["fp32", "bf16", "gpt2-lora", "qwen2-prompt"])
def test_chunked_loss_has_the_plain_loss_and_gradients_and_never_the_whole_logits(model_name, kw, tol):
    plain_loss, plain_grads, plain_largest, vocab = _step(model_name, None, **kw)
    loss, grads, largest, _ = _step(model_name, 40, **kw)  # 192 tokens: chunks of 40, 40, 40, 40, 32
    assert plain_largest >= 2 * 96 * vocab  # the plain step's logits (prompt tuning: with the virtual tokens)
    assert largest < 2 * 96 * vocab  # no tensor of the micro-batch's logits' size ever exists
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        scale = plain_grads[name].abs().max().clamp_min(1e-12)
        assert float((g - plain_grads[name]).abs().max() / scale) <= tol, name


def test_activation_offload_keeps_the_step_and_leaves_parameters_in_place():
    """On a CPU device the hooks copy into ordinary host memory (the spec refuses the knob on CPU
    workers; this checks the wiring a GPU job runs)."""
    from workers import activation_offload

    seen = {}
    real = activation_offload.OffloadToHost.__init__

    def spy(self, device, min_bytes=activation_offload.MIN_OFFLOAD_BYTES):
        real(self, device, min_bytes=1024)  # the tiny model's tensors are under the 1 MiB default
        seen["ctx"] = self

    activation_offload.OffloadToHost.__init__ = spy
    try:
        plain_loss, plain_grads, _, _ = _step("preset:tiny-llama", None)
        loss, grads, _, _ = _step("preset:tiny-llama", None, offload=True)
    finally:
        activation_offload.OffloadToHost.__init__ = real
    assert seen["ctx"].offloaded_bytes > 0
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=0, atol=0)


# --- every strategy it applies to, on 2 gloo ranks ---------------------------------------------------

STRATEGY_CASES = [
    dict(strategy="ddp"),
    dict(strategy="fsdp", precision="bf16"),  # the head in FSDP2's root unit, resharded after forward
    # ZeRO-3 gathers the head in its forward and again, by its pre-backward hook, for the recompute
    dict(strategy="deepspeed", ds_stage=3, peft_method="lora", model="preset:tiny-qwen2"),
]


def _train_both(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from workers.steps import WorkerEnv
    from workers.strategies import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    try:
        for i, case in enumerate(STRATEGY_CASES):
            pair = []
            for chunk in (None, 48):  # 128 tokens a micro-batch: chunks of 48, 48, 32
                env = WorkerEnv.local("cpu")
                train(_args(Path(out) / f"{i}-{chunk}", loss_chunk_tokens=chunk, max_steps=2, **case), env)
                pair.append([(r["loss"], r["grad_norm"]) for r in env.reports if r.get("kind") == "metrics"])
            results.append(pair)
        torch.save(results, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_chunked_loss_trains_as_the_plain_loss_under_ddp_fsdp2_and_deepspeed(tmp_path):
    """Loss and gradient norm of every step, chunked against plain: DDP fp32, FSDP2 bf16, ZeRO-3 with LoRA on
    tied embeddings. Step 1's gradient norm checks the gradients themselves; step 2 the update they made."""
    from workers.local import _free_port, start_processes

    start_processes(_train_both, (2, _free_port(), str(tmp_path)), 2)
    results = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for case, (plain, chunked) in zip(STRATEGY_CASES, results):
        assert len(plain) == len(chunked) == 2, case
        tol = 2e-2 if case.get("precision") == "bf16" else 1e-4
        for (loss0, norm0), (loss1, norm1) in zip(plain, chunked):
            assert loss1 == pytest.approx(loss0, rel=tol), case
            assert norm1 == pytest.approx(norm0, rel=tol), case


# --- the spec and the planner --------------------------------------------------------------------------

BASE = {"model": "preset:small-llama", "training_file": "file-x"}


def _problems(training: dict) -> list[tuple[str, str]]:
    try:
        validate_spec({**BASE, "training": training})
    except SpecError as exc:
        return [(p.param, p.message) for p in exc.problems]
    return []


def test_the_spec_refuses_what_is_not_built_naming_the_field():
    assert _problems({"loss_chunk_tokens": 512}) == []
    assert _problems({"loss_chunk_tokens": 64})[0][0] == "training.loss_chunk_tokens"  # below the bound
    (param, message), = _problems({"loss_chunk_tokens": 512, "strategy": "pipeline",
                                   "resources": {"num_workers": 2}, "hyperparameters": {"micro_batch_size": 2}})
    assert param == "training.loss_chunk_tokens" and "pipeline" in message
    (param, message), = _problems({"activation_offload": True})
    assert param == "training.activation_offload" and "needs GPUs" in message
    assert _problems({"activation_offload": True, "resources": {"gpus_per_worker": 1}}) == []


def _spec(**training) -> JobSpec:
    t = {"hyperparameters": {"micro_batch_size": 1, "max_seq_length": 2048},
         "resources": {"gpus_per_worker": 1, "gpu_type": "h100-80gb"}, **training}
    return JobSpec.model_validate({**BASE, "training": t})


LLAMA_1B = shape_from_config({  # Llama 3.2 1B: a 128k vocabulary on hidden 2048
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True})


def test_the_planner_counts_one_chunk_of_logits_and_offloaded_activations_on_the_host():
    plain = plan(_spec(precision="bf16"), LLAMA_1B)
    chunked = plan(_spec(precision="bf16", loss_chunk_tokens=256), LLAMA_1B)
    V, T = 128256, 2048
    # at the start of backward the plain loss holds its log-softmax and two gradients, each fp32 b·s·V; the
    # chunked one three of a chunk's (an eighth of them), and the head's weight gradient of one chunk
    assert plain.phases["backward"] - chunked.phases["backward"] > 1.9 * T * V * 4
    assert chunked.peak_bytes < plain.peak_bytes
    assert any("chunks of 256 tokens" in a for a in chunked.assumptions)
    larger = plan(_spec(precision="bf16", loss_chunk_tokens=1024), LLAMA_1B)
    assert chunked.phases["backward"] < larger.phases["backward"] < plain.phases["backward"]
    offloaded = plan(_spec(precision="bf16", activation_offload=True), LLAMA_1B)
    assert offloaded.per_rank.host.activations > 0
    assert offloaded.per_rank.device.activations < plain.per_rank.device.activations
    assert offloaded.peak_bytes < plain.peak_bytes


def test_a_model_that_caps_its_logits_after_the_head_is_refused_naming_the_field():
    gemma2 = shape_from_config({"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 1024,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                                "head_dim": 64, "vocab_size": 8000, "final_logit_softcapping": 30.0})
    plan(_spec(), gemma2)  # without chunking it plans as before
    with pytest.raises(SpecInvalid) as exc:
        plan(_spec(loss_chunk_tokens=512), gemma2)
    assert exc.value.param == "training.loss_chunk_tokens"
