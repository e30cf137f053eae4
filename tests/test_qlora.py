"""QLoRA on CPU workers: bitsandbytes' CPU backend loads the base in 4-bit NF4 (double quantisation),
peft trains a LoRA adapter on it, and the export merges the adapter into the dequantised base. Runs the
strategy function the Ray workers run (workers/local.py run_local), one process."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

from tests.test_workers_train import _args as train_args  # noqa: E402
from workers.args import TrainArgs  # noqa: E402
from workers.local import run_local  # noqa: E402

pytestmark = pytest.mark.slow  # trains on gloo processes: not in `make test-fast`


def _args(tmp_path, **kw) -> TrainArgs:
    """tests/test_workers_train.py's run, on a 4-bit base."""
    return train_args(tmp_path, **{"job_id": "ftjob-qlora", "peft_method": "qlora", "learning_rate": 3e-2, **kw})


LEARNED = 0.25  # nats per label token the trained adapter takes off the training set's loss, at least (0.45 measured)


def test_qlora_trains_on_a_4bit_base_on_cpu_resumes_saves_and_merges(tmp_path):
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from workers.data import load_dataset
    from workers.models import load_tokenizer, resolve_model_dir
    from workers.peft_setup import load_quantized
    from workers.steps import WorkerEnv
    from workers.strategies import build_model
    from workers.strategies.common import evaluate

    args = _args(tmp_path, checkpoint_every_steps=9)
    model_dir = str(resolve_model_dir(args.model))
    model = build_model(args, model_dir)
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 7  # every projection of both blocks; lm_head stays dense
    qs = four_bit[0].weight.quant_state
    assert four_bit[0].weight.dtype == torch.uint8 and qs.quant_type == "nf4" and qs.nested  # double quantisation
    # prepare_model_for_kbit_training: what is not 4-bit (embeddings, norms, lm_head) is fp32; the adapter trains
    assert {p.dtype for p in model.parameters() if p.dtype != torch.uint8} == {torch.float32}
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    del model

    (result,) = run_local(args)
    losses = [r["loss"] for r in result["reports"] if r.get("kind") == "metrics"]
    # each step's loss is of another batch (they differ by ±0.3 here): that it learns is measured below on
    # the whole training set, with the adapter on and off
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    out = Path(args.output_dir)
    assert result["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    # resumed from the step-9 checkpoint (the adapter and its optimizer state; the base is reloaded in 4 bits):
    # steps 10-12 repeat with the same losses
    (resumed,) = run_local(args, resume_dir=str(out / "checkpoints" / "step-9"))
    again = {r["step"]: r["loss"] for r in resumed["reports"] if r.get("kind") == "metrics"}
    assert sorted(again) == [10, 11, 12] and [again[s] for s in (10, 11, 12)] == pytest.approx(losses[9:], rel=1e-5)

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    with torch.no_grad():
        # the trained adapter on the 4-bit base it was trained against
        adapted = PeftModel.from_pretrained(load_quantized(model_dir, "sdpa", torch.float32), str(out / "adapter")).eval()
        adapted_logits = adapted(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
        assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())  # a plain fp32 checkpoint
        merged_logits = merged(input_ids=ids).logits
        # the same adapter on the original fp32 weights: off by the 4-bit rounding of the base
        on_fp32 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(out / "adapter")).eval()
        fp32_logits = on_fp32(input_ids=ids).logits
    # the adapter learned: the training set's loss per label token (the workers' own eval loss) with it,
    # against the same 4-bit base without it
    data = load_dataset(args.training_path, load_tokenizer(model_dir), args.max_seq_length)
    one_process = WorkerEnv(rank=0, world_size=1, device=torch.device("cpu"))
    with torch.no_grad():
        trained = evaluate(adapted, data, args, one_process)
        with adapted.disable_adapter():
            untrained = evaluate(adapted, data, args, one_process)
    assert trained < untrained - LEARNED, (trained, untrained)
    # merged into the dequantised base: what the adapter model computes, up to float rounding
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-4, atol=1e-4)
    # and NF4 really quantised the base: the fp32 weights give other logits, within 4-bit error of them
    gap = (fp32_logits - adapted_logits).abs().max().item()
    assert 1e-3 < gap < 0.25 * fp32_logits.abs().max().item(), gap


def test_qlora_under_fsdp2_on_two_gloo_ranks_shards_the_4bit_codes_and_learns(tmp_path):
    """FSDP2 shards the packed 4-bit codes, stored in the dtype it gathers in (bnb_4bit_quant_storage = the
    compute dtype, bf16 here): the ranks learn together and the export merges; each rank holds half the codes."""
    from transformers import AutoModelForCausalLM

    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    args = _args(tmp_path, strategy="fsdp", precision="bf16", micro_batch_size=4, learning_rate=5e-3, max_steps=6)
    results = run_local(args, world_size=2)
    losses = [[r["loss"] for r in res["reports"] if r.get("kind") == "metrics"] for res in results]
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0] - 0.2, losses
    assert results[0]["artifacts"] == {"adapter": "adapter", "merged": "merged"}
    AutoModelForCausalLM.from_pretrained(Path(args.output_dir) / "merged")
    spec = JobSpec.model_validate({"model": args.model, "training_file": "file-x", "training": {
        "strategy": "fsdp", "precision": "bf16", "peft": {"method": "qlora"}, "resources": {"num_workers": 2}}})
    planned = plan(spec, shape_for_model(resolve_model(args.model, ()))).model_states.device.parameters
    for res in results:  # each rank: half the codes and the fp32 rest, the whole constants (service/memory/nf4.py)
        state = [m for r in res["reports"] if r.get("kind") == "metrics" for m in r.get("memory", [])
                 if "parameters_bytes" in m][-1]  # the last step's sample (phase records carry no categories)
        assert state["parameters_bytes"] == planned


@pytest.mark.parametrize("model, precision", [("preset:tiny-llama", "bf16"), ("preset:tiny-qwen2", "fp32")])
def test_planned_parameters_are_the_bytes_bitsandbytes_holds(tmp_path, model, precision):
    """The planner's QLoRA parameters (service/memory/nf4.py) equal what telemetry counts on the real 4-bit model:
    packed codes and every quantisation constant (workers/telemetry.py counts a Params4bit's quant_state), the
    fp32 dense parameters, the adapter, and the quantised linears' biases in the compute dtype after a forward."""
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model
    from workers.models import resolve_model_dir
    from workers.steps import WorkerEnv, make_optimizer, make_telemetry
    from workers.strategies import build_model
    from workers.strategies.common import autocast_dtype, training_regime

    args = _args(tmp_path, model=model, precision=precision)
    m = build_model(args, str(resolve_model_dir(model)))
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype(training_regime(args)) is not None):
        m(input_ids=ids)
    tel = make_telemetry(args, WorkerEnv.local("cpu"), m, make_optimizer(m, 1e-3, 0.0), "ddp",
                         {"optimizer": "none", "param": "none"})
    spec = JobSpec.model_validate({"model": model, "training_file": "file-x", "training": {
        "precision": precision, "peft": {"method": "qlora"}}})
    planned = plan(spec, shape_for_model(resolve_model(model, ()))).model_states.device.parameters
    assert tel.counters()["parameters_bytes"] == planned


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qlora_job_over_http_on_cpu_workers_succeeds_and_merges(new_database, ray_head, tmp_path_factory):
    """The whole path: the API accepts qlora on CPU workers, the scheduler submits it to Ray, two DDP ranks
    train LoRA on the 4-bit base, and the job ends with an adapter and a merged model; its measured peak is
    the plan's (the same planner the admission used)."""
    from transformers import AutoModelForCausalLM

    from tests.stack import Stack

    with new_database() as url:
        stack = Stack(url, tmp_path_factory.mktemp("qlora-storage"), ray_head)
        stack.start_scheduler()
        try:
            job_id = stack.create(peft={"method": "qlora", "r": 8}, hyperparameters={"max_steps": 4},
                                  checkpoint_every_steps=4, memory_trace_every_steps=2)
            job = stack.wait(job_id, ("succeeded",))
            assert stack.metrics_steps(job_id, 0) == stack.metrics_steps(job_id, 1) == [1, 2, 3, 4]
            artifacts = stack.artifacts(job)
            assert (Path(artifacts["adapter"]) / "adapter_config.json").exists()
            merged = AutoModelForCausalLM.from_pretrained(artifacts["merged"])
            assert merged.config.to_dict().get("quantization_config") is None  # a plain model, not a 4-bit one
            view = stack.http.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=stack.auth).json()
            assert "QLoRA" in " ".join(view["plan"]["assumptions"])
            for rank in ("0", "1"):
                assert view["errors"][rank]["total"] == pytest.approx(0, abs=0.03), (view["predicted"], view["measured_peaks"])
        finally:
            stack.close()
