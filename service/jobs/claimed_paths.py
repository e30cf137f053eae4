"""What a worker reports is a claim: a path in an ingest record is believed only inside the attempt's own folder.

A run's records name files — a checkpoint's folder, the exported artefacts. The next attempt
hard-links the newest recorded checkpoint and loads it (service/scheduler/loop.py: _stage_resume),
and the artefacts routes serve from the folder, so a path taken on trust would let a leaked or forged
ingest token point memfit at another tenant's checkpoint, an upload, or anything else on the shared
volume. Hence:

- :func:`inside` accepts a path only when it resolves (symlinks followed, ``..`` folded) to somewhere
  under the attempt's own folder, and returns it *relative* to that folder — what the database
  stores. Anything else is :class:`PathOutsideAttempt`, a 422 naming the record's field, and the whole
  batch is refused;
- :func:`located` turns a stored path back into one on disk (relative → under the attempt's folder;
  an absolute path stored by an older memfit is returned as it is, and checked again where it is used);
- :func:`contained` is the check the scheduler repeats before it links a checkpoint into a new attempt:
  resolved, inside the job's own folders.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from service.domain.errors import UnprocessableEntity


class PathOutsideAttempt(UnprocessableEntity):
    code = "path_outside_attempt"


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def contained(folder: Path, path: Path) -> bool:
    """Whether ``path``, resolved (symlinks followed), lies in ``folder`` (resolved too) or is it."""
    try:
        return _real(path).is_relative_to(_real(folder))
    except (OSError, ValueError):
        return False


def inside(attempt_folder: Path, claimed: str, *, param: str) -> str:
    """``claimed`` (absolute, or relative to ``attempt_folder``) as a path relative to the attempt's
    folder, once it is proven to resolve inside it; PathOutsideAttempt (naming ``param``) otherwise."""
    if not claimed or "\x00" in claimed or any(ord(c) < 0x20 for c in claimed):
        raise PathOutsideAttempt(f"{param}: not a path inside the run's own folder", param=param)
    candidate = Path(claimed) if os.path.isabs(claimed) else attempt_folder / claimed
    root = _real(attempt_folder)
    resolved = _real(candidate)
    if resolved == root or not resolved.is_relative_to(root):
        raise PathOutsideAttempt(
            f"{param}: {claimed!r} is not inside the run's own folder (a worker reports only paths under "
            "its attempt's folder; symlinks and '..' are resolved first)", param=param)
    return PurePosixPath(resolved.relative_to(root)).as_posix()


def located(attempt_folder: Path, stored: str) -> Path:
    """Where a stored path lies: relative ones under the attempt's folder; an absolute one (stored
    before paths were stored relative) as it is — the caller checks it is inside the job's folders."""
    return Path(stored) if os.path.isabs(stored) else attempt_folder / stored
