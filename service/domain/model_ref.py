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

What is refused, so that a job spec cannot make the service read or fetch outside what it allows
(tests/test_paths.py holds the table): control characters (a NUL byte included) and names over
:data:`MAX_CHARS` (``invalid_model``); URLs and other ``scheme:`` forms — ``http://169.254.169.254/…``,
``file:///…``, ``hf://…`` — (``invalid_model``: memfit never fetches a model from a URL; the workers
reach the Hub only by id, at the endpoint of their own environment); a hub id outside the safe
charset or with ``..``, ``--``, ``@rev``, ``:tag`` (``invalid_model``); a path, a name, a symlinked
directory, or any symlink inside the model directory that resolves outside every model directory
(``model_not_allowed``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.domain.errors import UnprocessableEntity
from service.domain.presets import PRESET_PREFIX, PRESETS, preset_name

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
FORMS = "'preset:<name>', a directory under MEMFIT_MODEL_DIRS, or a hub id 'org/name'"
MAX_CHARS = 512  # JobSpec.model's max_length
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")  # http:, file:, hf:, s3: (not a drive letter: C:\\…)
MAX_ENTRIES = 10_000  # a model directory's entries checked for symlinks out of the model directories


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
    _check_text(model)
    dirs = [Path(d).expanduser().resolve() for d in model_dirs]
    name = preset_name(model)
    if name is not None:
        if name not in PRESETS:
            known = ", ".join(PRESET_PREFIX + n for n in PRESETS)
            raise ModelRefError("model_not_found", f"unknown preset {model!r}; known: {known}")
        return ModelRef("preset", model, preset=name)
    if SCHEME.match(model):
        raise ModelRefError("invalid_model", f"model {model!r} is a URL or a '<scheme>:' form; memfit never fetches "
                                             f"a model from a URL: give {FORMS}")
    if model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1:
        path = _resolve(Path(model).expanduser(), model)
        if not any(_inside(path, d) for d in dirs):
            raise ModelRefError("model_not_allowed", f"model {model!r} is a local path outside MEMFIT_MODEL_DIRS; "
                                                     "a local model must lie inside one of them")
        return ModelRef("local", model, path=_model_dir(path, model, dirs))
    for d in dirs:  # a name inside one of the model directories
        if not _exists(d / model):
            continue
        candidate = _resolve(d / model, model)
        if candidate == d:  # "", "org/..": the model directory itself is no model
            continue
        if not any(_inside(candidate, x) for x in dirs):
            raise ModelRefError("model_not_allowed", f"model {model!r} is a symlink in {d} to a folder outside "
                                                     "MEMFIT_MODEL_DIRS; a local model must lie inside one of them")
        if candidate.is_dir():
            return ModelRef("local", model, path=_model_dir(candidate, model, dirs))
    if HUB_ID.match(model):
        if any(bad in model for bad in ("..", "--")) or model.endswith("."):
            raise ModelRefError("invalid_model", f"model {model!r} is not a valid hub id: it may not hold '..' "
                                                 "or '--' nor end with '.'")
        return ModelRef("hub", model, hub_id=model)
    raise ModelRefError("invalid_model", f"model {model!r} is not {FORMS}")


def _check_text(model: str) -> None:
    if len(model) > MAX_CHARS:
        raise ModelRefError("invalid_model", f"model is {len(model)} characters long; at most {MAX_CHARS}")
    if any(ord(c) < 32 or ord(c) == 127 for c in model):
        raise ModelRefError("invalid_model", f"model {model!r} holds a control character (a NUL byte, a newline …)")


def _resolve(path: Path, model: str) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long for the filesystem …
        why = getattr(exc, "strerror", None) or exc
        raise ModelRefError("model_not_found", f"model {model!r} cannot be resolved: {why}") from None


def _exists(path: Path) -> bool:
    """Whether ``path`` is there (a symlink counts, even a dangling one); a name the filesystem
    cannot hold (ENAMETOOLONG, ENOTDIR …) is not."""
    try:
        os.lstat(path)
        return True
    except OSError:
        return False


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _model_dir(path: Path, model: str, dirs: list[Path] | None = None) -> Path:
    if not path.is_dir():
        raise ModelRefError("model_not_found", f"model directory {model!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelRefError("model_not_found", f"model directory {model!r} has no config.json")
    if dirs:
        escape = _link_out(path, dirs)
        if escape is not None:
            raise ModelRefError("model_not_allowed", f"model directory {model!r} holds {escape}, a symlink to a path "
                                                     "outside MEMFIT_MODEL_DIRS; every file a model reads must lie "
                                                     "inside them")
    return path


def _link_out(path: Path, dirs: list[Path]) -> str | None:
    """The first entry under ``path`` (relative) that is a symlink resolving outside every model
    directory, or None. A Hugging Face cache snapshot's links to its blobs stay inside the cache."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(path):  # does not follow symlinked folders
        for name in (*dirnames, *filenames):
            seen += 1
            if seen > MAX_ENTRIES:
                return None
            entry = Path(dirpath) / name
            if entry.is_symlink():
                try:
                    target = entry.resolve()
                except (OSError, RuntimeError):
                    return str(entry.relative_to(path))
                if not any(_inside(target, d) for d in dirs):
                    return str(entry.relative_to(path))
    return None
