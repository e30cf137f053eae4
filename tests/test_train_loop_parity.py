"""What the training loop's speed-ups (bench/train_overhead.py) must not change: the loss and its
gradients, the optimizer CPU workers run, and what telemetry samples."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
F = torch.nn.functional


def shifted_logits_loss_sum(logits, labels):
    """The loss as workers/steps.py computed it before: the logits sliced and copied, not the labels shifted."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_shifting_the_labels_gives_the_same_loss_and_the_same_gradients(amp_dtype):
    from workers.models import build_preset, load_model
    from workers.steps import token_loss_sum

    torch.manual_seed(0)
    model = load_model(str(build_preset("preset:tiny-llama")))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, 40))
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt
    labels[1, 30:] = -100  # a shorter, right-padded row
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    losses, grads = [], []
    for loss_fn in (shifted_logits_loss_sum, token_loss_sum):
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = m(input_ids=ids, attention_mask=mask).logits
        loss = loss_fn(logits, labels)
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)  # the same terms, summed in another order
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name  # each logit's gradient is the same, bit for bit


def test_prompt_tuning_logits_longer_than_labels_count_only_the_last_positions():
    from workers.steps import token_loss_sum

    torch.manual_seed(0)
    logits = torch.randn(2, 30, 50)
    labels = torch.randint(0, 50, (2, 20))
    labels[0, :5] = -100
    expected = shifted_logits_loss_sum(logits[:, -20:], labels)
    assert float(token_loss_sum(logits, labels)) == pytest.approx(float(expected), rel=1e-6)


def test_cpu_workers_keep_the_per_tensor_adamw_and_the_step_returns_host_values():
    from workers.models import build_preset, load_model
    from workers.steps import clip_and_step, host_value, make_optimizer, warmup_cosine

    model = load_model(str(build_preset("preset:tiny-llama")))
    opt = make_optimizer(model, 1e-3, 0.0)
    # torch's default on CPU tensors is the for-loop (foreach and fused are for accelerators): the
    # loss trajectories and resume checks pinned elsewhere ran with it and still do.
    assert not opt.defaults.get("fused") and opt.defaults.get("foreach") in (None, False)
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [p for g in opt.param_groups for p in g["params"]]
    assert _default_to_fused_or_foreach(params, False, False) == (False, False)
    model(input_ids=torch.randint(0, model.config.vocab_size, (2, 16))).logits.sum().backward()
    norm = clip_and_step(model, opt, warmup_cosine(opt, 0, 10), 1.0)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.device.type == "cpu"
    assert isinstance(host_value(norm), float) and host_value(norm) > 0
    assert host_value(None) is None and host_value(1.5) == 1.5


def test_trace_every_zero_samples_counters_and_never_traces():
    from workers.models import build_preset, load_model
    from workers.steps import make_optimizer
    from workers.telemetry import StepTelemetry

    model = load_model(str(build_preset("preset:tiny-llama")))
    opt = make_optimizer(model, 1e-3, 0.0)
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=0)
    assert not any(tel.is_traced(s) for s in range(1, 31)) and all(tel.is_sampled(s) for s in range(1, 31))
    for step in (1, 2, 3):
        tel.begin_step(step)
        for phase in ("forward", "backward", "optimizer"):
            tel.mark(phase)
        (record,) = tel.end_step(step)
        assert record["source"] == "counters" and record["parameters_bytes"] > 0 and "peak_bytes" not in record
    default = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=10)
    assert [s for s in range(1, 31) if default.is_traced(s)] == [3, 10, 20, 30]
