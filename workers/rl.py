"""Reinforcement fine-tuning (``method.type: "reinforcement"``, OpenAI's RFT) as GRPO: for each prompt of a
micro-batch the current policy samples ``n`` completions, the job's grader scores each
(service/domain/graders.py; python graders in service/domain/sandbox.py), and the policy is updated toward the
better ones. The DDP strategy runs it in its loop in place of workers/steps.py's ``accumulate_gradients``
(workers/strategies/common.py step_fns), so checkpoints, telemetry, evaluation and the export are the
supervised run's.

Per group of the n samples of one prompt (Shao et al. 2024, DeepSeekMath's GRPO; TRL's GRPOTrainer):

- advantage  A_i = (r_i − mean(r)) / (std(r) + 1e-4): a group whose samples score alike teaches nothing;
- per completion token t, with the probability ratio ρ = π(t) / π_old(t), the clipped policy-gradient loss
  −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A), plus kl_coef · (π_ref/π − log(π_ref/π) − 1) (the k3 estimator of the KL
  to the reference, Schulman 2020) when training.rl.kl_coef > 0;
- each sequence's loss is the mean over its completion tokens, and the step's the mean over every sequence of
  the global batch (each backward takes its sequences' sum × world / (sequences in the global batch), as
  workers/steps.py does, so DDP's averaging gives the mean over all ranks).

One update per sample (GRPO's μ = 1): π_old is the policy that sampled, so ρ is 1 in value and its gradient is
the policy gradient; the old log-probabilities are the training forward's own, detached — no second forward.

**The sampler** is the policy itself, in this training process: ``generate`` on the PEFT (or full) model as it
stands after the last optimizer step, with its KV cache, in eval mode and without a graph — on CPU workers the
transformers + peft path of the serving engine (workers/serving_engine.py) without a second copy of the weights,
so there is nothing to push after an update. Its memory is the job's ``sample`` phase, measured by the phase
meter on every rank each step and planned by service/memory/rl.py.

**The reference** (service/domain/spec.py rl_reference_mode): none (kl_coef 0), the PEFT base with its adapter
disabled, or a frozen copy of the base.

**score_model graders** are asked through a transformers engine of the grader's model
(workers/serving_engine.py TransformersEngine), loaded once on the rank, greedy unless its sampling_params say.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from service.domain.datafmt import read_jsonl
from service.domain.encoding import encode_prompt
from service.domain.graders import Grader, ScoreModelGrader, grade_batch, grader_names
from service.domain.sandbox import Limits, run_python_grader
from workers.data import collate
from workers.steps import all_reduce_sum, autocast, distributed, model_inputs, run_backward, shifted_labels

IGNORE = -100


# --- data ---------------------------------------------------------------------------------------------


@dataclass
class PromptData:
    """A reinforcement file: each row's prompt tokens (the chat template's assistant header last) and the row."""

    prompts: list[list[int]]
    rows: list[dict]
    pad_id: int
    fmt: str = "reinforcement"

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(path: str, tokenizer, max_prompt_tokens: int) -> PromptData:
    """The rows' prompts, each its last ``max_prompt_tokens`` tokens (the end of a prompt is what it asks)."""
    _, rows = read_jsonl(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return PromptData([encode_prompt(tokenizer, r)[-max_prompt_tokens:] for r in rows], rows, pad)


def prompt_step_batches(data: PromptData, sampler, step: int, rank: int) -> list[dict]:
    return [{"index": list(idx)} for idx in sampler.micro_batches(step, rank)]


# --- sampling -----------------------------------------------------------------------------------------


def unwrap(model):
    """The model ``generate`` runs on: under DDP's wrapper (the sampler needs no gradient synchronisation)."""
    return getattr(model, "module", model)


@torch.no_grad()
def sample(model, prompts: list[list[int]], n: int, *, pad_id: int, eos_id: int | None, max_new_tokens: int,
           temperature: float, top_p: float, device: torch.device, amp_dtype=None) -> list[list[int]]:
    """n completions for each prompt (prompt-major: prompt 0's n, then prompt 1's …), each cut after its first
    end-of-sequence token (kept: the policy learns to stop)."""
    policy = unwrap(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left-padded: every prompt ends where generation starts
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    was_training = policy.training
    policy.eval()
    try:
        with autocast(device, amp_dtype):
            out = policy.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                  temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  num_return_sequences=n, pad_token_id=pad_id, eos_token_id=eos_id, use_cache=True)
    finally:
        policy.train(was_training)
    completions = []
    for row in out[:, width:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id) + 1]
        elif pad_id != eos_id:
            while row and row[-1] == pad_id:
                row.pop()
        completions.append(row or ([eos_id] if eos_id is not None else [pad_id]))
    return completions


# --- the loss -------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(r − group mean) / (group std + 1e-4), the groups being consecutive runs of n rewards."""
    groups = rewards.view(-1, n)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True, unbiased=False) + 1e-4)).view(-1)


def token_logps(model, batch: dict, device: torch.device, amp_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's log-probability of its label, fp32, (rows, T); the label mask)."""
    with autocast(device, amp_dtype):
        logits = model(**model_inputs(batch, device)).logits
    target = shifted_labels(batch["labels"].to(device))
    logp = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE,
                            reduction="none").view(target.shape)
    return logp, target != IGNORE


def grpo_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, clip_epsilon: float,
              ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: (the clipped policy-gradient loss + kl_coef · KL, mean over its tokens; its mean KL, detached)."""
    ratio = torch.exp(logp - logp.detach())
    adv = advantages.to(logp.device).unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * adv)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        delta = ref_logp.to(logp.device) - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    tokens = mask.sum(-1).clamp(min=1)
    return (per_token * mask).sum(-1) / tokens, ((kl * mask).sum(-1) / tokens).detach()


# --- graders ----------------------------------------------------------------------------------------------


class EngineScorer:
    """score_model graders' answers from a transformers engine of the grader's model (loaded on first use)."""

    def __init__(self, resolve_model_dir: Callable[[str], str]):
        self.resolve, self.engines = resolve_model_dir, {}

    def __call__(self, grader: ScoreModelGrader, prompts: list[str]) -> list[str]:
        from workers.serving_engine import make_engine

        if grader.model not in self.engines:
            self.engines[grader.model] = make_engine("transformers", self.resolve(grader.model), max_batch=16)
        engine = self.engines[grader.model]
        params = grader.sampling_params
        sampling = {"max_tokens": (params.max_completions_tokens if params else None) or 8,
                    "temperature": (params.temperature if params and params.temperature is not None else 1e-5),
                    "top_p": (params.top_p if params and params.top_p is not None else 1.0),
                    "seed": params.seed if params else None}
        answers: list[list[str]] = [[] for _ in prompts]
        done = threading.Semaphore(0)

        def sink_for(i: int):
            def sink(event: dict) -> None:
                if event["event"] == "delta":
                    answers[i].append(event["text"])
                elif event["event"] in ("end", "error"):
                    done.release()
            return sink

        for i, prompt in enumerate(prompts):
            engine.submit({"kind": "completion", "prompt": prompt, "sampling": sampling}, None, sink_for(i))
        for _ in prompts:
            done.acquire(timeout=600)
        return ["".join(a) for a in answers]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def sampling_rounds(args, model) -> int:
    """training.rl.sampler_memory_fraction: rounds of a micro-batch's prompts whose KV cache stays within that
    share of the plan's capacity (service/memory/rl.py rounds_for, the planner's rule), from the model's config."""
    from service.memory.rl import rounds_for

    capacity = (args.plan or {}).get("capacity_bytes")
    if args.rl_sampler_memory_fraction is None or not capacity:
        return 1
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    row = 2 * layers * heads * head_dim * dtype_bytes * (args.max_seq_length)
    return rounds_for(args.micro_batch_size, args.rl_samples_per_prompt, row, capacity, args.rl_sampler_memory_fraction)


# --- one accumulated step, and the evaluation ----------------------------------------------------------------


class RLStep:
    """The step functions' state: the data, the grader, the reference, the phase meter that measures sampling."""

    def __init__(self, args, env, s, model, amp_dtype=None, *, copy=None, meter=None):
        from pydantic import TypeAdapter

        from workers.models import local_model_dir, resolve_model_dir

        self.args, self.env, self.s, self.model, self.amp_dtype, self.copy, self.meter = (
            args, env, s, model, amp_dtype, copy, meter)
        self.grader = TypeAdapter(Grader).validate_python(args.rl_grader)
        self.names = grader_names(self.grader)
        self.limits = Limits(timeout_s=args.rl_grader_timeout_s, memory_bytes=args.rl_grader_memory_bytes,
                             cpu_s=max(1, math.ceil(args.rl_grader_timeout_s)))
        self.scorer = EngineScorer(lambda m: local_model_dir(resolve_model_dir(m, None)))
        tok = s.tokenizer
        self.eos_id = tok.eos_token_id
        self.step = 0
        self.rounds = sampling_rounds(args, unwrap(model))

    # the reference's log-probabilities of a batch (no graph), or None without a KL term
    @torch.no_grad()
    def reference_logps(self, batch: dict) -> torch.Tensor | None:
        if self.args.rl_reference == "none":
            return None
        if self.args.rl_reference == "frozen_copy":
            return token_logps(self.copy, batch, self.env.device, self.amp_dtype)[0]
        from workers.dpo import _peft_model

        with _peft_model(self.model).disable_adapter():
            return token_logps(self.model, batch, self.env.device, self.amp_dtype)[0]

    def grade(self, rows: list[dict], texts: list[str]):
        python = lambda g, samples: run_python_grader(g, samples, self.limits)  # noqa: E731
        return grade_batch(self.grader, list(zip(rows, texts)), python=python, model=self.scorer)

    def generate(self, data: PromptData, idx: list[int], n: int) -> list[list[int]]:
        a = self.args
        return sample(self.model, [data.prompts[i] for i in idx], n, pad_id=data.pad_id, eos_id=self.eos_id,
                      max_new_tokens=a.rl_max_completion_tokens, temperature=a.rl_temperature, top_p=a.rl_top_p,
                      device=self.env.device, amp_dtype=self.amp_dtype)

    def sample_phase(self, step: int):
        if self.meter is None:
            return contextlib.nullcontext({})
        return self.meter.measure("sample", step)

    def accumulate(self, model, micro_batches: list[dict], *, device: torch.device, world_size: int, amp_dtype=None,
                   scaler=None, tel=None, no_sync: Callable | None = None, where: dict | None = None,
                   stats: dict | None = None, **_: Any):
        """workers/steps.py accumulate_gradients for GRPO: (mean loss over the global batch's sequences, sequences,
        tokens); ``stats`` gets the mean reward (and per grader), its std, the KL, the completion lengths."""
        where = where if where is not None else {}
        a, data, n = self.args, self.s.train, self.args.rl_samples_per_prompt
        self.step += 1
        step = getattr(tel, "_step", None) or self.step
        local_rows = sum(len(b["index"]) for b in micro_batches) * n
        global_rows = all_reduce_sum(local_rows, device)
        scale = world_size / max(global_rows, 1.0)
        k = len(self.names)
        sums = torch.zeros(6 + k, dtype=torch.float64)  # loss, reward, reward², kl, completion tokens, errors; graders
        rounds = self.rounds
        tokens = 0
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            idx = mb["index"]
            where["phase"] = "sample"
            with self.sample_phase(step) as info:
                completions: list[list[int]] = []
                per_round = -(-len(idx) // rounds)
                for r in range(0, len(idx), per_round):
                    completions += self.generate(data, idx[r:r + per_round], n)
                info["sequences"] = len(completions)
            rows = [data.rows[j] for j in idx for _ in range(n)]
            texts = [self.s.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
            scores = self.grade(rows, texts)
            rewards = torch.tensor([sc.value for sc in scores], dtype=torch.float32)
            advantages = group_advantages(rewards, n)
            seqs = []
            for j, comp in zip((j for j in idx for _ in range(n)), completions):
                prompt = data.prompts[j]
                seqs.append((prompt + comp, [IGNORE] * len(prompt) + comp))
            batch = collate(seqs, data.pad_id)
            tokens += int(batch["attention_mask"].sum())
            where["phase"] = "forward"
            ref = self.reference_logps(batch)
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx:
                logp, mask = token_logps(model, batch, device, amp_dtype)
                losses, kl = grpo_loss(logp, mask, advantages, clip_epsilon=a.rl_clip_epsilon, ref_logp=ref,
                                       kl_coef=a.rl_kl_coef)
                if tel is not None:
                    tel.mark("forward")
                where["phase"] = "backward"
                run_backward(losses.sum() * scale, None, scaler)
                if tel is not None:
                    tel.mark("backward")
            part = [float(losses.detach().sum()), float(rewards.sum()), float((rewards ** 2).sum()), float(kl.sum()),
                    float(sum(len(c) for c in completions)), float(sum(sc.error is not None for sc in scores))]
            per_grader = [sum((sc.parts.get(name, sc.value) if name != self.grader.name else sc.value)
                              for sc in scores) for name in self.names]
            sums += torch.tensor(part + per_grader, dtype=torch.float64)
        if distributed():
            import torch.distributed as dist

            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        total = max(global_rows, 1.0)
        means = (sums / total).tolist()
        if stats is not None:
            stats.update(mean_reward=means[1], reward_std=math.sqrt(max(means[2] - means[1] ** 2, 0.0)),
                         mean_completion_tokens=means[4], grader_error_rate=means[5],
                         grader_rewards=dict(zip(self.names, means[6:])))
            if a.rl_reference != "none":
                stats["kl"] = means[3]
        return means[0], int(global_rows), tokens

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """The validation prompts' mean reward (eval_samples each), across ranks; eval_loss None."""
        val = self.s.val
        if val is None:
            return None
        n = self.args.rl_eval_samples
        total, count = 0.0, 0
        mine = list(range(self.env.rank, len(val), self.env.world_size))
        micro = max(1, self.args.micro_batch_size)
        for start in range(0, len(mine), micro):
            idx = mine[start:start + micro]
            completions = self.generate(val, idx, n)
            texts = [self.s.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
            scores = self.grade([val.rows[j] for j in idx for _ in range(n)], texts)
            total += sum(sc.value for sc in scores)
            count += len(scores)
        total, count = all_reduce_sum(total, self.env.device), all_reduce_sum(count, self.env.device)
        return {"eval_loss": None, "eval_mean_reward": total / max(count, 1.0)}
