"""Pipeline parallelism (workers/strategies/pipeline.py) on gloo processes: the same update as DDP
over the same global batch (both schedules, tied and untied embeddings, dp × pp), LoRA, resume from
the per-stage checkpoint, and an export that from_pretrained loads with the trained model's logits.
The dp × pp, LoRA and checkpointed runs run under the NCCL-like backend (tests/nccl_like.py: a collective
on a host tensor is refused, as NCCL refuses it): step, eval, checkpoint and export.
The HTTP and Ray path is tests/test_e2e.py -k pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # trains or fuzzes: not in `make test-fast`

from service.domain.training import in_flight_microbatches, stage_layers  # noqa: E402
from workers.args import TrainArgs  # noqa: E402
from workers.local import run_local  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"
NCCL_LIKE = "tests.nccl_like:install"  # tests/nccl_like.py: refuses collectives on host tensors, as NCCL does
VALIDATION = str(EXAMPLES / "chat-validation.jsonl")


def _args(out: Path, **kw) -> TrainArgs:
    base = dict(job_id="ftjob-pp", output_dir=str(out), training_path=str(EXAMPLES / "chat.jsonl"),
                model="preset:tiny-llama", learning_rate=1e-2, warmup_steps=2, micro_batch_size=4, accumulation=2,
                max_steps=4, max_seq_length=64, checkpoint_every_steps=100, telemetry_every_steps=1,
                memory_trace_every_steps=1000)
    base.update(kw)
    return TrainArgs(**base)


def _losses(ranks: list[dict]) -> list[float]:
    return [r["loss"] for r in ranks[0]["reports"] if r.get("kind") == "metrics"]


def _pipeline(out: Path, stages: int = 2, **kw) -> TrainArgs:
    return _args(out, strategy="pipeline", pipeline_stages=stages, pipeline_microbatches=kw.pop("chunks", 2), **kw)


def test_stage_split_is_even_and_keeps_the_ends_light():
    assert [len(r) for r in stage_layers(2, 2)] == [1, 1]
    assert [len(r) for r in stage_layers(5, 2)] == [3, 2]  # the extra block goes to the first, not the head's stage
    assert [len(r) for r in stage_layers(7, 3)] == [2, 3, 2]  # ... and to the middle before either end
    assert [list(r) for r in stage_layers(4, 4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        stage_layers(2, 3)
    assert in_flight_microbatches("gpipe", 4, 0, 8) == 8
    assert [in_flight_microbatches("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize("model,schedule", [("preset:tiny-llama", "1f1b"), ("preset:tiny-llama", "gpipe"),
                                            ("preset:tiny-gpt2", "1f1b")])
def test_pipeline_trains_exactly_as_ddp(tmp_path, model, schedule):
    """Two stages over the same global batch give DDP's losses step for step: the loss scaling, the
    accumulation over schedule runs, the gradient norm over stages and (GPT-2) the tied embedding
    whose two gradients live on the first and the last stage."""
    ddp = _losses(run_local(_args(tmp_path / "ddp", model=model), world_size=1))
    pp = _losses(run_local(_pipeline(tmp_path / "pp", model=model, pipeline_schedule=schedule), world_size=2))
    assert len(pp) == 4 and pp[-1] < pp[0]
    assert pp == pytest.approx(ddp, rel=1e-5)


def test_two_replicas_of_a_two_stage_pipeline_match_ddp_on_two_ranks(tmp_path):
    """A 2 × 2 mesh (dp × pp): the replicas sum their gradients per stage, as DDP's two ranks do."""
    ddp = _losses(run_local(_args(tmp_path / "ddp", model="preset:tiny-gpt2", micro_batch_size=2), world_size=2))
    pp = _losses(run_local(_pipeline(tmp_path / "pp", model="preset:tiny-gpt2", micro_batch_size=2), world_size=4,
                           worker_setup=NCCL_LIKE))
    assert pp == pytest.approx(ddp, rel=1e-5)


def test_lora_with_checkpointing_matches_ddp_and_exports_an_adapter(tmp_path):
    kw = dict(peft_method="lora", gradient_checkpointing=True, learning_rate=5e-2)
    ddp = _losses(run_local(_args(tmp_path / "ddp", **kw), world_size=1))
    ranks = run_local(_pipeline(tmp_path / "pp", **kw), world_size=2, worker_setup=NCCL_LIKE)
    assert _losses(ranks) == pytest.approx(ddp, rel=1e-5)
    assert ranks[0]["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    assert (tmp_path / "pp" / "adapter" / "adapter_model.safetensors").is_file()


def test_bf16_pipeline_trains(tmp_path):
    losses = _losses(run_local(_pipeline(tmp_path / "pp", precision="bf16", max_steps=6), world_size=2))
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_resume_from_the_per_stage_checkpoint_repeats_the_uninterrupted_run(tmp_path):
    full = _losses(run_local(_pipeline(tmp_path / "full", max_steps=6), world_size=2))
    # under the NCCL-like backend, with a validation file: every collective of the step, the evaluation, the
    # checkpoint and the export on the worker's device
    first = run_local(_pipeline(tmp_path / "first", max_steps=6, checkpoint_every_steps=3, eval_every_steps=3,
                                 validation_path=VALIDATION),
                      world_size=2, worker_setup=NCCL_LIKE)
    evals = [r["eval_loss"] for r in first[0]["reports"] if r.get("kind") == "metrics" and "eval_loss" in r]
    assert len(evals) == 2 and all(e > 0 for e in evals)  # at the checkpoints of steps 3 and 6
    step3 = tmp_path / "first" / "checkpoints" / "step-3"
    assert sorted(p.name for p in (step3 / "pipeline").iterdir()) == ["stage-0.pt", "stage-1.pt"]
    resumed = run_local(_pipeline(tmp_path / "resumed", max_steps=6), world_size=2, resume_dir=str(step3))
    steps = {r["step"]: r["loss"] for r in resumed[0]["reports"] if r.get("kind") == "metrics"}
    assert sorted(steps) == [4, 5, 6]
    assert [steps[s] for s in (4, 5, 6)] == pytest.approx(full[3:], rel=1e-5)
    assert _losses(first) == pytest.approx(full, rel=1e-5)


def test_export_is_one_folder_with_the_trained_logits(tmp_path):
    """The stages' weights gathered into one Hugging Face folder: from_pretrained loads it and gives the
    logits of the DDP run's export, which trained the same steps on the same data."""
    from transformers import AutoModelForCausalLM

    run_local(_args(tmp_path / "ddp", model="preset:tiny-gpt2"), world_size=1)
    run_local(_pipeline(tmp_path / "pp", model="preset:tiny-gpt2"), world_size=2)
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp" / "model")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "model")(ids).logits
    assert torch.allclose(got, want, atol=1e-5)


# --- the planner's stages ---------------------------------------------------------------------------


def _plan(training: dict, model: str = "preset:small-llama", stage: int | None = None):
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    spec = JobSpec.model_validate({"model": model, "training_file": "file-x", "training": training})
    return plan(spec, shape_for_model(resolve_model(spec.model, ())), None, stage=stage)


PP = {"strategy": "pipeline", "pipeline": {"stages": 2}, "resources": {"num_workers": 2},
      "hyperparameters": {"micro_batch_size": 4, "max_seq_length": 256}}


def test_each_stage_holds_its_blocks_and_its_end_of_the_model():
    """small-qwen2 (tied embeddings): stage 0 the embedding and blocks 0–1, stage 1 blocks 2–3, the final
    norm and its own copy of the shared weight as the LM head; together one more embedding than DDP."""
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model

    shape = shape_for_model(resolve_model("preset:small-qwen2", ()))
    first, last = (_plan(PP, "preset:small-qwen2", stage=k).model_states.device for k in (0, 1))
    embedding = shape.vocab * shape.hidden * 4
    assert first.parameters == (2 * shape.layer_params() * 4) + embedding
    assert last.parameters == (2 * shape.layer_params() + shape.hidden) * 4 + embedding
    assert first.parameters + last.parameters == shape.parameter_count() * 4 + embedding
    assert last.optimizer_states == 2 * last.gradients == 2 * last.parameters


def test_gpipe_keeps_every_chunk_and_1f1b_at_most_the_stages():
    gpipe = _plan({**PP, "pipeline": {"stages": 2, "schedule": "gpipe"}}, stage=0)
    one_f_one_b = _plan(PP, stage=0)
    assert gpipe.activations_saved_bytes == 2 * one_f_one_b.activations_saved_bytes  # 4 chunks vs 2 in flight
    fullest = _plan(PP)
    assert fullest.peak_bytes == max(_plan(PP, stage=k).peak_bytes for k in (0, 1))


def test_the_first_stage_plans_its_embedding_backward_beside_the_accumulated_gradient():
    """Rank 0's embedding backward after its first chunk (measured on gloo: the peak of its backward):
    every gradient, the dense vocab × hidden gradient aten::embedding_dense_backward makes beside the
    .grad it is added into, the gradient it reads, the one other chunk 1F1B still holds, chunk 0's output that
    Schedule1F1B's ``send_work`` still holds, and the stage's receive buffers (a gradient per chunk)."""
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model

    shape = shape_for_model(resolve_model("preset:small-llama", ()))
    first = _plan(PP, stage=0)
    dev = first.model_states.device
    rows, seq = 4 // 4, 256  # micro-batch 4 in 4 chunks (the default), seq 256
    held = dev.parameters + dev.gradients + dev.optimizer_states
    other_chunk = first.activations_saved_bytes // 2  # 1F1B's stage 0 holds 2 chunks at its peak, 1 then
    chunk_io = rows * seq * shape.hidden * 4
    assert first.phases["backward_embedding"] - held == (
        other_chunk + shape.vocab * shape.hidden * 4 + chunk_io + chunk_io + 4 * chunk_io)
    # no embedding trained (LoRA), no embedding (stage 1), or no earlier chunk's gradient: no such instant
    lora = {**PP, "peft": {"method": "lora"}}
    one = {**PP, "pipeline": {"stages": 2, "microbatches": 1}}
    for training, stage in ((lora, 0), (PP, 1), (one, 0)):
        assert "backward_embedding" not in _plan(training, stage=stage).phases


def test_an_interleaved_rank_keeps_what_each_finished_chunk_sent_until_the_step_ends():
    """torch's _PipelineScheduleRuntime waits its send Works (which hold the sent tensors) only when
    step() ends, so a chunk whose backward has run still holds its output and input gradient."""
    from types import SimpleNamespace

    from service.memory.planner import StageView, _rank_view

    def stage(k: int, per_chunk: int, sent: int) -> StageView:
        act = SimpleNamespace(saved=lambda checkpointing: per_chunk, logits_bytes=0, loss_saved_bytes=0)
        return StageView(k, range(k, k + 1), 0, 0, 0, act, 0, 1, sent=sent)

    order = [(1, 0), (1, 1), (1, 0), (0, 0)]  # F stage 0, F stage 1, B stage 1, B stage 0
    view = _rank_view(0, [stage(0, 10, 1), stage(1, 100, 1000)], order, False)
    assert view.saved_bytes == 10 + 1000  # not 10 + 100: stage 1's chunk is done but its sends are live


def test_1f1b_stages_plan_their_receive_buffers_and_the_sends_the_schedule_still_holds():
    """torch.distributed.pipelining keeps a receive buffer per chunk for each activation a stage after the first
    receives and each gradient a stage before the last receives; Schedule1F1B's ``send_work`` keeps chunk W−2's
    output (W warm-up forwards) and ``bwd_sends`` the last input gradient it sent, at every backward after the
    first. Stage 0's backward starts in its last block's MLP from the received gradient (a receive buffer): the
    product's backward, three T × intermediate gradients; stage 1's from the loss's two vocabulary-sized ones."""
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import _lora_targets, pipeline_stages, regime, trainable_parameters
    from service.memory.shape import shape_for_model

    shape = shape_for_model(resolve_model("preset:small-llama", ()))
    T, h = 1 * 256, shape.hidden  # micro-batch 4 in 4 chunks at seq 256

    def views(chunks: int):
        spec = JobSpec.model_validate({"model": "preset:small-llama", "training_file": "file-x", "training": {
            **PP, "pipeline": {"stages": 2, "microbatches": chunks},
            "hyperparameters": {"micro_batch_size": chunks, "max_seq_length": 256}}})
        return pipeline_stages(spec, shape, regime("pipeline", "none", "fp32"), _lora_targets(spec, shape),
                               trainable_parameters(spec, shape), chunks, 256)

    chunk_io = T * h * 4  # fp32 residual stream
    mlp_backward = 3 * T * shape.intermediate * 4
    loss = 2 * T * shape.vocab * 4
    first, last = views(4)
    assert (first.recv_buffers, last.recv_buffers) == (4 * chunk_io, 4 * chunk_io)
    assert first.act.loss_grad_bytes == mlp_backward + chunk_io  # + chunk 0's output in send_work
    assert last.act.loss_grad_bytes == loss + chunk_io  # + the last input gradient in bwd_sends
    first, last = views(1)  # one chunk: no backward after the first, nothing held
    assert (first.recv_buffers, last.recv_buffers) == (chunk_io, chunk_io)
    assert (first.act.loss_grad_bytes, last.act.loss_grad_bytes) == (mlp_backward, loss)


def test_a_pipeline_longer_than_the_model_is_refused_by_field():
    from service.domain.errors import SpecInvalid

    with pytest.raises(SpecInvalid) as exc:
        _plan({**PP, "pipeline": {"stages": 4}, "resources": {"num_workers": 4}}, "preset:tiny-llama")
    assert exc.value.param == "training.pipeline.stages" and "at least 4 decoder blocks" in str(exc.value)


# --- interleaved 1F1B ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["preset:small-llama", "preset:small-gpt2"])
def test_interleaved_1f1b_trains_exactly_as_1f1b(tmp_path, model):
    """Two ranks holding two model stages each (blocks 0 | 1 | 2 | 3 on ranks 0, 1, 0, 1): the same losses
    as 1F1B (and so DDP) on the same batches; GPT-2's tied embedding lives on rank 0's first stage and rank 1's
    last."""
    kw = dict(model=model, max_steps=3, learning_rate=5e-3)
    # 1F1B is DDP's update step for step (test_pipeline_trains_exactly_as_ddp): one reference run suffices
    one = _losses(run_local(_pipeline(tmp_path / "1f1b", **kw), world_size=2))
    inter = run_local(_pipeline(tmp_path / "i", pipeline_schedule="interleaved_1f1b", pipeline_local_stages=2,
                                checkpoint_every_steps=3, **kw), world_size=2)
    assert _losses(inter) == pytest.approx(one, rel=1e-5)
    assert _losses(inter)[-1] < _losses(inter)[0]
    import re

    stage_files = tmp_path / "i" / "checkpoints" / "step-3" / "pipeline"
    blocks = [{int(m.group(2)) for k in torch.load(stage_files / f"stage-{r}.pt", weights_only=False)["model"]
               if (m := re.search(r"\.(h|layers)\.(\d+)\.", k))} for r in (0, 1)]
    assert blocks == [{0, 2}, {1, 3}]  # each rank held two non-adjacent model stages


def test_interleaved_in_flight_follows_torchs_own_order():
    """The planner's count of chunks held per local stage (service/domain/training.py) against the
    operation order torch.distributed.pipelining builds for ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining.schedules import _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops

    from service.domain.training import interleaved_in_flight

    for ranks, local, n in [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 3), (2, 2, 6)]:
        for rank in range(ranks):
            per_round = n // max(1, n // ranks)
            warmup = _get_warmup_ops(rank, local, per_round, ranks, n, multiply_factor=2)
            ops = _get_1f1b_rank_ops(local, ranks, warmup, n * local - warmup, warmup, rank,
                                     lambda op: ((op // per_round) % local) * ranks + rank,
                                     lambda op: (local - 1 - ((op - warmup) // per_round) % local) * ranks + rank)
            held, seen = [0] * local, []
            for a in ops:
                if a is not None:
                    held[a.stage_index // ranks] += 1 if a.computation_type == _ComputationType.FORWARD else -1
                    seen.append(tuple(held))
            assert interleaved_in_flight(ranks, local, rank, n) == seen, (ranks, local, n, rank)
    assert max(map(sum, interleaved_in_flight(2, 2, 0, 4))) == 5  # W = (2-1)·2 + 2·(2-1-0) = 4 warm-up, + 1


def test_interleaved_1f1b_plans_each_rank_at_its_schedules_peak():
    inter = {**PP, "pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}}
    for k in (0, 1):
        p = _plan(inter, stage=k)
        assert any(a.startswith(f"stage {k}:") and f"{(5, 3)[k]} chunk(s) in flight" in a for a in p.assumptions)
        # the same blocks per rank as 1f1b (0, 2 | 1, 3 against 0–1 | 2–3): the same model states
    assert _plan(inter).peak_bytes == max(_plan(inter, stage=k).peak_bytes for k in (0, 1))


def test_the_spec_gives_the_workers_their_model_stages_per_rank():
    from service.domain.spec import RunRequest, validate_spec
    from workers.args import train_args

    def local(pipeline: dict) -> int:
        spec = validate_spec({"model": "preset:small-llama", "training_file": "file-x", "training": {
            "strategy": "pipeline", "resources": {"num_workers": 2}, "pipeline": pipeline}})
        req = RunRequest(job_id="ftjob-1", spec=spec, training_path="/x", output_dir="/y")
        return train_args(req).pipeline_local_stages

    assert local({"stages": 2, "schedule": "interleaved_1f1b"}) == 2
    assert local({"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 3}) == 3
    assert local({"stages": 2}) == 1
