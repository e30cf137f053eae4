"""What a job's ``model`` names — a preset, a local directory or a hub id — and whether it may be used.

The one home of that rule: job creation (service/jobs/crud.py), the scheduler's validation and run
request (service/scheduler/), the planner's shape lookup (service/memory/) and the workers
(workers/models.py) all call :func:`resolve_model`. No torch, no database, no network.

- ``preset:<name>``: one of service/domain/presets.py's PRESETS.
- A path (it starts with ``/``, ``.`` or ``~``, holds a backslash or more than one ``/``): once
  resolved (symlinks and ``..`` followed) it must lie inside one of the model directories
  (``MEMFIT_MODEL_DIRS``) and be a directory holding ``config.json``.
- A name (``tiny``, ``org/name``) that is a directory inside one of the model directories: that
  directory, which must hold ``config.json``.
- Otherwise ``org/name``: a Hugging Face hub id, loaded by the workers.

A worker is given the directory the scheduler resolved (``RunRequest.model_path``) and no model
directories: ``model_path`` wins over ``model`` and is only checked for ``config.json``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.domain.errors import UnprocessableEntity
from service.domain.presets import PRESET_PREFIX, PRESETS, preset_name

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
FORMS = "'preset:<name>', a directory under MEMFIT_MODEL_DIRS, or a hub id 'org/name'"


class ModelRefError(UnprocessableEntity):
    """A ``model`` that may not be used. ``code``: ``model_not_found`` (an unknown preset, a directory
    that is missing or has no config.json), ``model_not_allowed`` (a path outside MEMFIT_MODEL_DIRS)
    or ``invalid_model`` (none of the accepted forms)."""

    def __init__(self, code: str, message: str):
        super().__init__(message, param="model", code=code)


@dataclass(frozen=True)
class ModelRef:
    """A resolved ``model``: exactly one of ``preset``, ``path`` and ``hub_id`` is set, as ``kind`` says."""

    kind: Literal["preset", "local", "hub"]
    model: str  # as the job spec gives it
    preset: str | None = None  # the preset's name, without "preset:"
    path: Path | None = None  # the resolved local directory
    hub_id: str | None = None

    @property
    def local_dir(self) -> str | None:
        """The directory a run request carries as ``model_path`` (None for a preset or a hub id)."""
        return str(self.path) if self.path is not None else None


def resolve_model(model: str, model_dirs: Iterable[Path], *, model_path: str | None = None) -> ModelRef:
    """Classify and resolve ``model`` against ``model_dirs`` (see the module docstring); raises
    ModelRefError naming the problem. ``model_path`` is a directory already resolved for this model
    (a run request's); it wins and is only checked for config.json."""
    if model_path is not None:
        return ModelRef("local", model, path=_model_dir(Path(model_path), model_path))
    dirs = [Path(d).expanduser().resolve() for d in model_dirs]
    name = preset_name(model)
    if name is not None:
        if name not in PRESETS:
            known = ", ".join(PRESET_PREFIX + n for n in PRESETS)
            raise ModelRefError("model_not_found", f"unknown preset {model!r}; known: {known}")
        return ModelRef("preset", model, preset=name)
    if model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1:
        path = Path(model).expanduser().resolve()
        if not any(_inside(path, d) for d in dirs):
            raise ModelRefError("model_not_allowed", f"model {model!r} is a local path outside MEMFIT_MODEL_DIRS; "
                                                     "a local model must lie inside one of them")
        return ModelRef("local", model, path=_model_dir(path, model))
    for d in dirs:  # a name inside one of the model directories
        candidate = (d / model).resolve()
        if d in candidate.parents and candidate.is_dir():
            return ModelRef("local", model, path=_model_dir(candidate, model))
    if HUB_ID.match(model):
        return ModelRef("hub", model, hub_id=model)
    raise ModelRefError("invalid_model", f"model {model!r} is not {FORMS}")


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _model_dir(path: Path, model: str) -> Path:
    if not path.is_dir():
        raise ModelRefError("model_not_found", f"model directory {model!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelRefError("model_not_found", f"model directory {model!r} has no config.json")
    return path
