"""DPO (workers/dpo.py) without Ray: one step's loss, rewards and gradients are the hand-computed ones; a
short run on the example preference data (the right colour preferred over a wrong one) learns — its loss
falls and its preference accuracy rises; and it runs under DDP, FSDP2 and ZeRO with each kind of reference
(the PEFT base with its adapter disabled, a frozen copy, log-probabilities precomputed before training)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # trains (gloo processes, no Ray)

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


@pytest.fixture(scope="module")
def model_dir():
    from workers.models import build_preset

    return str(build_preset("preset:tiny-llama"))


def hand_logp(model, ids: list[int], labels: list[int]) -> torch.Tensor:
    """Σ over the labelled tokens of log p(token | the tokens before it): one row, no padding, by hand."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[t - 1, labels[t]] for t in range(1, len(ids)) if labels[t] != -100)


def test_a_dpo_steps_loss_rewards_and_gradients_are_the_hand_computed_ones(model_dir):
    from workers.dpo import Reference, dpo_accumulate, load_preferences, pair_batch
    from workers.models import load_model, load_tokenizer
    from workers.peft_setup import apply_peft

    torch.manual_seed(0)
    model = apply_peft(load_model(model_dir), "lora", r=4, alpha=8.0, dropout=0.0, targets="auto", num_virtual_tokens=0)
    with torch.no_grad():  # a trained adapter (LoRA's B starts at 0: the policy would be the reference)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    data = load_preferences(str(DATA / "preference.jsonl"), load_tokenizer(model_dir), 64)
    beta, idx = 0.3, [0, 1, 2]
    stats: dict = {}
    loss, pairs, _ = dpo_accumulate(model, [pair_batch(data, idx)], reference=Reference("adapter_disabled", model,
                                    torch.device("cpu")), beta=beta, device=torch.device("cpu"), world_size=1,
                                    stats=stats)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    losses, chosen_rewards, rejected_rewards, scale = [], [], [], 0.0
    for i in idx:
        (c_ids, c_labels), (r_ids, r_labels) = data.pairs[i]
        with torch.no_grad(), model.disable_adapter():
            ref_c, ref_r = hand_logp(model, c_ids, c_labels), hand_logp(model, r_ids, r_labels)
        scale += beta * 2 * float(abs(ref_c) + abs(ref_r)) / 3
        chosen = beta * (hand_logp(model, c_ids, c_labels) - ref_c)
        rejected = beta * (hand_logp(model, r_ids, r_labels) - ref_r)
        losses.append(-torch.log(torch.sigmoid(chosen - rejected)))
        chosen_rewards.append(float(chosen.detach()))
        rejected_rewards.append(float(rejected.detach()))
    hand = torch.stack(losses).mean()
    hand.backward()
    assert pairs == 3 and loss == pytest.approx(float(hand), rel=1e-5)
    margins = [c - r for c, r in zip(chosen_rewards, rejected_rewards)]
    # A reward is β·(a difference of two log-prob sums of tens each): the padded batch and the one-row forward
    # round those sums apart by ~1e-7 of their size (fp32, another reduction order), which a small margin
    # keeps in absolute terms. The tolerance is that rounding: 1e-6 of the sums the rewards are made of.
    tol = 1e-6 * scale
    assert stats["reward_margin"] == pytest.approx(sum(margins) / 3, rel=1e-4, abs=tol)
    assert stats["preference_accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 3)
    assert stats["chosen_reward"] == pytest.approx(sum(chosen_rewards) / 3, rel=1e-4, abs=tol)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), name


def dpo_args(tmp_path, **overrides):
    from workers.args import TrainArgs

    base = dict(job_id="ftjob-dpo", output_dir=str(tmp_path / "out"), training_path=str(DATA / "preference.jsonl"),
                model="preset:tiny-llama", method="dpo", dpo_beta=0.1, micro_batch_size=4, max_seq_length=64,
                max_steps=8, learning_rate=3e-3, peft_method="lora", peft_r=8, checkpoint_every_steps=100,
                memory_trace_every_steps=1000, seed=3)
    return TrainArgs(**{**base, **overrides})


def metrics(reports: list[dict]) -> list[dict]:
    return [r for r in reports if r.get("kind") == "metrics"]


def test_dpo_learns_the_preferences(tmp_path):
    """DDP, LoRA, the base with its adapter disabled as reference: at step 1 the policy is the reference
    (every reward 0, loss log 2); by step 8 the loss has fallen and most pairs prefer the right colour."""
    from workers.local import run_local

    args = dpo_args(tmp_path, validation_path=str(DATA / "preference-validation.jsonl"), eval_every_steps=4)
    [rank0] = run_local(args)
    steps = metrics(rank0["reports"])
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[0]["preference_accuracy"] == 0.0
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.1
    assert steps[-1]["preference_accuracy"] >= 0.75 and steps[-1]["reward_margin"] > 0
    evals = [m for m in steps if "eval_loss" in m]
    assert [m["step"] for m in evals] == [4, 8] and evals[-1]["eval_preference_accuracy"] >= 0.75
    assert evals[-1]["full_eval_loss"] == evals[-1]["eval_loss"] < math.log(2)


@pytest.mark.parametrize("strategy, peft, reference, world", [
    ("fsdp", "none", "precomputed", 2),          # FSDP2: a full fine-tune, the reference log-probs computed once
    ("deepspeed", "lora", "adapter_disabled", 2),  # ZeRO-2 with the adapter switched off for the reference
    ("ddp", "none", "frozen_copy", 1),           # a frozen copy of the base beside the trained model
], ids=["fsdp2-precomputed", "zero2-adapter-disabled", "ddp-frozen-copy"])
def test_dpo_runs_under_each_strategy_and_reference(tmp_path, strategy, peft, reference, world):
    from workers.local import run_local

    args = dpo_args(tmp_path, strategy=strategy, peft_method=peft, dpo_reference=reference, max_steps=3,
                    micro_batch_size=2, learning_rate=1e-3 if peft == "none" else 3e-3, checkpoint_every_steps=2)
    ranks = run_local(args, world_size=world)
    for rank in ranks:
        steps = metrics(rank["reports"])
        assert [m["step"] for m in steps] == [1, 2, 3]
        assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as its reference
        assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["reward_margin"] > 0
    if reference == "precomputed":  # kept with every checkpoint, so a resumed run has the very same reference
        from workers.dpo import REFERENCE_FILE

        tables = torch.load(Path(args.output_dir, "checkpoints", "step-2", REFERENCE_FILE), weights_only=True)
        assert tables["train"].shape == (64, 2) and bool((tables["train"] < 0).all())


@pytest.mark.parametrize("peft, precision, reference", [
    ("lora", "bf16", "adapter_disabled"),  # no second model: the policy's step with 2m rows
    ("none", "fp32", "frozen_copy"),       # a full fine-tune beside a frozen copy of the base
], ids=["lora-bf16-adapter-disabled", "full-fp32-frozen-copy"])
def test_a_dpo_steps_peak_is_planned_within_the_sft_bound(tmp_path, peft, precision, reference):
    """service/memory/dpo.py against what telemetry measures on real DPO steps (small-llama, the example
    preference rows, 4 pairs a micro-batch): every step's peak within 5%, as the supervised matrix's slice
    (tests/test_memory_accuracy.py), and parameters (the frozen copy's included) within 1%. (precomputed holds
    what adapter_disabled does less nothing: the policy's step alone, measured within 5% too when written.)"""
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory import dpo as dpo_plan
    from service.memory.shape import shape_for_model
    from workers.steps import WorkerEnv, clip_and_step, make_optimizer, make_telemetry, warmup_cosine
    from workers.strategies.common import autocast_dtype, build_model, prepare, step_fns, training_regime

    args = dpo_args(tmp_path, model="preset:small-llama", peft_method=peft, precision=precision, dpo_reference=reference,
                    max_steps=4, memory_trace_every_steps=1)
    env = WorkerEnv.local("cpu")
    s = prepare(args, env)
    torch.manual_seed(0)
    model = build_model(args, s.model_dir)
    amp = autocast_dtype(training_regime(args))
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, 0, 4)
    fns = step_fns(args, env, s, model, amp)
    tel = make_telemetry(args, env, model, optimizer, "ddp", {"optimizer": "none", "param": "none"})
    tel.held_parameters = fns.held_parameters  # as the strategies do: the frozen copy counts as parameters
    model.train()
    spec = JobSpec.model_validate({
        "model": args.model, "training_file": "file-x", "method": {"type": "dpo"},
        "training": {"peft": {"method": peft}, "precision": precision, "dpo_reference": reference,
                     "hyperparameters": {"micro_batch_size": 4, "max_seq_length": 64}}})
    shape = shape_for_model(resolve_model(spec.model, ()))
    for step in range(1, 5):
        batches = fns.batches(step - 1, 0)
        tel.begin_step(step)
        fns.accumulate(model, batches, device=env.device, world_size=1, amp_dtype=amp, tel=tel)
        clip_and_step(model, optimizer, scheduler, args.max_grad_norm)
        tel.mark("optimizer")
        records = [r for r in tel.end_step(step) if r["phase"] == "step"]
        if step < 3:
            continue
        [measured] = records
        width = batches[0]["input_ids"].shape[1]  # this step's rows, padded to their longest
        planned = dpo_plan.plan(spec, shape, seq_length=width, padded=True)
        err = (planned.peak_bytes - measured["peak_bytes"]) / measured["peak_bytes"]
        assert abs(err) <= 0.05, (step, width, planned.peak_bytes, measured["peak_bytes"], f"{err:+.2%}")
        print(f"{reference} step {step}: width {width}, planned {planned.peak_bytes}, measured "
              f"{measured['peak_bytes']} ({err:+.2%})")
        assert abs(planned.model_states.device.parameters - measured["parameters_bytes"]) <= \
            0.01 * measured["parameters_bytes"] + 4096, (planned.model_states.device.parameters, measured)
