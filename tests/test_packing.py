"""Packing done right: a packed row holds several examples, each positioned from 0 and attending only to
itself (a block-diagonal causal mask), so each example's loss is the one it has on its own — the padding of
a shorter packed row included. Without the isolation (one causal sequence, positions running on) the later
examples see the earlier ones and their losses change: the control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from service.domain.encoding import IGNORE, encode_example, pack, pack_segments, packed_position_ids
from workers.data import collate
from workers.steps import forward_loss_sum, model_inputs

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


def token_losses(model, batch: dict) -> torch.Tensor:
    """Each position's next-token loss (0 where it predicts no label), in fp32: (rows, width)."""
    with torch.no_grad():
        logits = model(**model_inputs(batch, torch.device("cpu"))).logits.float()
    target = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none")


@pytest.mark.parametrize("preset", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_a_packed_rows_examples_have_the_losses_they_have_alone(preset):
    from workers.models import build_preset, load_model, load_tokenizer

    model_dir = str(build_preset(preset))
    tok, model = load_tokenizer(model_dir), load_model(model_dir, "sdpa").eval()
    rows = [json.loads(line) for line in (DATA / "chat.jsonl").read_text().splitlines()[:12:2]]
    examples = [encode_example(tok, r, "chat") for r in rows]
    lengths = [len(ids) for ids, _ in examples]
    width = sum(lengths[:3])  # the first three fill a row exactly; the other three make a shorter, padded one
    segments = pack_segments(lengths, width)
    assert segments == [lengths[:3], lengths[3:]]
    packed = collate(pack(examples, width), tok.pad_token_id, [packed_position_ids(s) for s in segments])
    assert packed["position_ids"][1].tolist() == packed_position_ids(lengths[3:]) + list(range(width - sum(lengths[3:])))

    losses = token_losses(model, packed)
    starts = [(0, 0), (0, lengths[0]), (0, lengths[0] + lengths[1]), (1, 0), (1, lengths[3]), (1, lengths[3] + lengths[4])]
    for k, ((row, start), n) in enumerate(zip(starts, lengths)):
        alone = token_losses(model, collate([examples[k]], tok.pad_token_id))[0, : n - 1]
        together = losses[row, start : start + n - 1]  # the example's own predictions (its last predicts nothing)
        assert torch.allclose(together, alone, rtol=1e-4, atol=1e-5), (preset, k, (together - alone).abs().max())
        assert float(losses[row, start + n - 1]) == 0.0  # never a prediction of the next example's first token

    # The training loss of the packed micro-batch is the sum of the examples' own (forward_loss_sum: the workers' path).
    total = forward_loss_sum(model, packed, torch.device("cpu"), None).detach()
    separate = sum(forward_loss_sum(model, collate([e], tok.pad_token_id), torch.device("cpu"), None).detach()
                   for e in examples)
    assert float(total) == pytest.approx(float(separate), rel=1e-5)

    # The control: the same rows as one causal sequence each (a padding mask, positions running on).
    plain = {k: v for k, v in packed.items() if k != "position_ids"}
    leaked = token_losses(model, plain)
    row, start = starts[2]
    assert not torch.allclose(leaked[row, start : start + lengths[2] - 1], losses[row, start : start + lengths[2] - 1],
                              rtol=1e-3, atol=1e-4)


@pytest.mark.slow  # trains four steps
def test_a_packed_steps_peak_is_planned_as_a_masked_batch(tmp_path):
    """The planner plans packed rows of several examples as a masked micro-batch (the block-diagonal mask
    and the keys and values SDPA then keeps, activations/attention.py padding_mask_bytes): a real packed step's measured peak
    (small-llama, the example chat rows packed into rows of 256, 4 rows a micro-batch) is within 5% of that
    plan, as the supervised matrix's slice is (tests/test_memory_accuracy.py); planned unmasked it would be
    under by the mask's share."""
    from service.domain.model_ref import resolve_model
    from service.domain.spec import JobSpec
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model
    from workers.args import TrainArgs
    from workers.steps import (
        WorkerEnv,
        accumulate_gradients,
        clip_and_step,
        make_optimizer,
        make_telemetry,
        warmup_cosine,
    )
    from workers.strategies.common import build_model, prepare

    args = TrainArgs(job_id="ftjob-pack", output_dir=str(tmp_path), training_path=str(DATA / "chat.jsonl"),
                     model="preset:small-llama", micro_batch_size=4, max_seq_length=256, packing=True, max_steps=4,
                     memory_trace_every_steps=1, seed=0)
    env = WorkerEnv.local("cpu")
    s = prepare(args, env)
    torch.manual_seed(0)
    model = build_model(args, s.model_dir)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, 0, 4)
    tel = make_telemetry(args, env, model, optimizer, "ddp", {"optimizer": "none", "param": "none"})
    model.train()
    spec = JobSpec.model_validate({"model": args.model, "training_file": "file-x", "training": {
        "hyperparameters": {"micro_batch_size": 4, "max_seq_length": 256, "packing": True}}})
    shape = shape_for_model(resolve_model(spec.model, ()))
    from workers.data import step_batches

    for step in range(1, 5):
        batches = step_batches(s.train, s.sampler, step - 1, 0)
        assert "position_ids" in batches[0]
        tel.begin_step(step)
        accumulate_gradients(model, batches, device=env.device, world_size=1, tel=tel)
        clip_and_step(model, optimizer, scheduler, args.max_grad_norm)
        tel.mark("optimizer")
        records = [r for r in tel.end_step(step) if r["phase"] == "step"]
        if step < 3:
            continue
        [measured] = records
        width = batches[0]["input_ids"].shape[1]
        masked = plan(spec, shape, seq_length=width, padded=True).peak_bytes
        err = (masked - measured["peak_bytes"]) / measured["peak_bytes"]
        assert abs(err) <= 0.05, (step, width, masked, measured["peak_bytes"], f"{err:+.2%}")
        print(f"step {step}: width {width}, planned {masked}, measured {measured['peak_bytes']} ({err:+.2%}); "
              f"unmasked plan {plan(spec, shape, seq_length=width).peak_bytes}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_packed_job_over_http_trains_on_the_losses_its_examples_have_alone(shared_stack):
    """Over HTTP, through Ray: a job with ``packing: true`` whose six examples fit one row reports, at its first
    step (a LoRA adapter starts as the identity: B = 0), the token-mean loss the base model gives each example on
    its own. Recomputed here from the same seeded preset; the same row without the isolation (one causal sequence)
    gives another loss, outside the tolerance, so the comparison can tell the two apart."""
    from tests.factories import create_job, upload
    from workers.models import build_preset, load_model, load_tokenizer

    rows = [json.loads(line) for line in (DATA / "chat.jsonl").read_text().splitlines()[:12:2]]
    stack = shared_stack
    train = upload(stack.http, stack.key, rows, name="packed.jsonl")
    job = create_job(stack.http, stack.key, train, {
        "hyperparameters": {"max_steps": 1, "micro_batch_size": 1, "max_seq_length": 512, "packing": True},
        "peft": {"method": "lora", "r": 8}, "resources": {"num_workers": 1}, "checkpoint_every_steps": 1})
    stack.wait(job["id"], ("succeeded",), timeout=500)
    [step] = [e["data"] for e in stack.events(job["id"]) if e["type"] == "metrics" and e["data"]["rank"] == 0]
    assert step["step"] == 1

    model_dir = str(build_preset("preset:tiny-llama"))
    tok, model = load_tokenizer(model_dir), load_model(model_dir, "sdpa").eval()
    examples = [encode_example(tok, r, "chat") for r in rows]
    lengths = [len(ids) for ids, _ in examples]
    assert sum(lengths) <= 512  # one packed row: the step is every example, whole
    labels = sum(sum(1 for v in lab[1:] if v != IGNORE) for _, lab in examples)
    with torch.no_grad():
        alone = sum(float(forward_loss_sum(model, collate([e], tok.pad_token_id), torch.device("cpu"), None))
                    for e in examples) / labels
        packed = collate(pack(examples, 512), tok.pad_token_id, [packed_position_ids(lengths)])
        plain = {k: v for k, v in packed.items() if k != "position_ids"}
        leaked = float(forward_loss_sum(model, plain, torch.device("cpu"), None)) / labels
    # A random preset predicts almost uniformly, so attention across examples moves the loss only a little (here
    # 9e-6 of it): the job must match to float32's rounding, and the leaked row must lie well outside that.
    tolerance = 2e-6
    assert step["train_loss"] == pytest.approx(alone, rel=tolerance), (step["train_loss"], alone, leaked)
    assert abs(leaked - alone) > 3 * tolerance * alone, (leaked, alone)  # without isolation the loss is another
