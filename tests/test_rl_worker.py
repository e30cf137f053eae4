"""workers/rl.py's pieces without Ray: the group advantages and the clipped loss against hand-computed values, the
sampler's completions, and a score_model grader answered by a transformers engine of the tiny preset."""

from __future__ import annotations

import pytest
import torch

from service.domain.graders import ScoreModelGrader, grade_batch


def test_group_advantages_normalise_within_each_group():
    from workers.rl import group_advantages

    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]), 4)
    assert adv[:4].tolist() == pytest.approx([0.5 / (0.5 + 1e-4), -0.5 / (0.5 + 1e-4)] * 2, rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # a group whose samples score alike teaches nothing


def test_grpo_loss_is_the_policy_gradient_with_the_k3_kl():
    from workers.rl import grpo_loss

    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -0.5]])
    loss, kl = grpo_loss(logp, mask, torch.tensor([2.0, -1.0]), clip_epsilon=0.2, ref_logp=ref, kl_coef=0.1)
    k3 = lambda d: torch.exp(torch.tensor(d)) - d - 1  # noqa: E731
    assert kl.tolist() == pytest.approx([float(k3(-0.5)) / 2, float(k3(-0.5)) / 3], rel=1e-6)
    assert loss.tolist() == pytest.approx([-2 + 0.1 * kl[0].item(), 1 + 0.1 * kl[1].item()], rel=1e-6)
    loss.sum().backward()
    # d/dlogp of −A·ρ is −A per token (ρ = 1), averaged over the sequence's tokens; the KL's gradient beside it
    expected0 = (-2 + 0.1 * (1 - torch.exp(torch.tensor(-0.5)))) / 2
    assert logp.grad[0, 0].item() == pytest.approx(expected0.item(), rel=1e-5)
    assert logp.grad[0, 2].item() == 0.0


@pytest.fixture(scope="module")
def tiny():
    from workers.models import build_preset, load_model, load_tokenizer

    d = str(build_preset("preset:tiny-llama"))
    return d, load_model(d, "sdpa"), load_tokenizer(d)


def test_the_sampler_returns_n_completions_per_prompt_each_cut_after_eos(tiny):
    from workers.rl import sample

    _, model, tok = tiny
    torch.manual_seed(0)
    prompts = [tok("hello there")["input_ids"], tok("a")["input_ids"]]
    out = sample(model, prompts, 3, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_new_tokens=5,
                 temperature=1.0, top_p=1.0, device=torch.device("cpu"))
    assert len(out) == 6 and all(1 <= len(c) <= 5 for c in out)
    assert all(tok.eos_token_id not in c[:-1] for c in out)


def test_a_score_model_grader_is_answered_by_the_graders_model_on_an_engine(tiny):
    from workers.rl import EngineScorer

    model_dir, _, _ = tiny
    grader = ScoreModelGrader(type="score_model", name="judge", model="preset:tiny-llama", range=[0, 10],
                              sampling_params={"max_completions_tokens": 4, "seed": 1},
                              input=[{"role": "user", "content": "Score {{sample.output_text}} against {{item.r}}:"}])
    scorer = EngineScorer(lambda name: model_dir)
    try:
        scores = grade_batch(grader, [({"r": "x"}, "a"), ({"r": "y"}, "b")], model=scorer)
    finally:
        scorer.close()
    # a random tiny model rarely writes a number: each score is within range, and says why where it has none
    assert len(scores) == 2 and all(0 <= s.value <= 10 for s in scores)
    assert all(s.error is None or "holds no number" in s.error for s in scores)
    assert list(scorer.engines) == ["preset:tiny-llama"]
