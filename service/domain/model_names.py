"""The names of what a fine-tuning job makes, as OpenAI writes them: the one rule (torch-free) that the
workers use when they report a result, the API when it names a checkpoint, and a server that serves the
models (``/v1/models``, chat completions with ``model="ft:…"``) when it finds the job behind a name.

- a job's model: ``ft:{base}:{suffix}:{job_id}``; without a suffix the segment is empty
  (``ft:{base}::{job_id}``), as OpenAI leaves it (``ft:gpt-3.5-turbo:org::7qTVM5AR``), so a name always
  has the same segments and a base that holds colons (``preset:tiny-llama``) parses back unambiguously;
- one of its checkpoints: the job's model name and ``:ckpt-step-{N}`` (OpenAI:
  ``ft:gpt-4o-mini-2024-07-18:my-org:custom_suffix:9ABel2dg:ckpt-step-88``).

OpenAI puts the organization between the base and the suffix; memfit's names leave it out (a model
name is looked up within its tenant, whose keys alone can reach it). The suffix is what
service.domain.spec.JobSpec.suffix allows: up to 64 letters, digits, '-' and '_' — never a colon.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "ft:"
CHECKPOINT_MARK = ":ckpt-step-"
SUFFIX_MAX_CHARS = 64
SUFFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]*")
JOB_ID_PREFIX = "ftjob-"
_CHECKPOINT_TAIL = re.compile(r":ckpt-step-(\d+)$")


class ModelNameError(ValueError):
    """A string that is not a memfit fine-tuned model name; the message says why."""


def check_suffix(suffix: str | None) -> str | None:
    """``suffix`` when a model name can carry it; raises ValueError saying why not."""
    if suffix is None:
        return None
    if len(suffix) > SUFFIX_MAX_CHARS:
        raise ValueError(f"suffix is longer than {SUFFIX_MAX_CHARS} characters")
    if not SUFFIX_PATTERN.fullmatch(suffix):
        raise ValueError("suffix may hold only letters, digits, '-' and '_'")
    return suffix


def fine_tuned_model_name(base: str, suffix: str | None, job_id: str) -> str:
    """The model a job makes: ``ft:{base}:{suffix}:{job_id}`` (an empty suffix segment without one)."""
    return f"{PREFIX}{base}:{check_suffix(suffix) or ''}:{job_id}"


def checkpoint_model_name(base: str, suffix: str | None, job_id: str, step: int) -> str:
    """The model of a job's checkpoint at optimizer step ``step``: the job's name and ``:ckpt-step-{step}``."""
    return f"{fine_tuned_model_name(base, suffix, job_id)}{CHECKPOINT_MARK}{int(step)}"


@dataclass(frozen=True)
class ModelName:
    """A parsed name: the base model, the suffix (None when empty), the job, and the checkpoint's step
    (None for the job's final model)."""

    base: str
    suffix: str | None
    job_id: str
    step: int | None = None

    def __str__(self) -> str:
        if self.step is None:
            return fine_tuned_model_name(self.base, self.suffix, self.job_id)
        return checkpoint_model_name(self.base, self.suffix, self.job_id, self.step)


def parse_model_name(name: str) -> ModelName:
    """The parts of a name :func:`fine_tuned_model_name` or :func:`checkpoint_model_name` made; raises
    ModelNameError for anything else (a base model's own name, another server's ``ft:`` name)."""
    if not isinstance(name, str) or not name.startswith(PREFIX):
        raise ModelNameError(f"{name!r} is not a fine-tuned model name (they start with {PREFIX!r})")
    rest, step = name[len(PREFIX):], None
    tail = _CHECKPOINT_TAIL.search(rest)
    if tail is not None:
        step, rest = int(tail.group(1)), rest[: tail.start()]
    base_and_suffix, sep, job_id = rest.rpartition(":")
    base, sep2, suffix = base_and_suffix.rpartition(":")
    if not (sep and sep2 and base and job_id.startswith(JOB_ID_PREFIX) and len(job_id) > len(JOB_ID_PREFIX)):
        raise ModelNameError(f"{name!r} is not ft:{{base}}:{{suffix}}:{{job_id}}[:ckpt-step-N]")
    if not SUFFIX_PATTERN.fullmatch(suffix) or len(suffix) > SUFFIX_MAX_CHARS:
        raise ModelNameError(f"{name!r}: the suffix segment {suffix!r} is not a suffix")
    return ModelName(base=base, suffix=suffix or None, job_id=job_id, step=step)
