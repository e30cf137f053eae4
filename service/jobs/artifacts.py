"""What a tenant may read of a job's output folder: the model artefacts, by an allowlist — on the volume,
or under the same key in the bucket of MEMFIT_STORAGE_URL (service/domain/storage.py).

The folder also holds what only memfit reads — Ray Train's run state under ``ray/``, the run's record
spool ``metrics-attempt-N.jsonl``, failure files, markers — so the artifacts routes
(``/v1/fine_tuning/jobs/{id}/artifacts[/{path}]``) list and serve a path only when it matches
:data:`ALLOWED`:

- ``adapter/…``, ``merged/…``, ``model/…``: the exported Hugging Face folders, whole;
- ``ray/<run>/checkpoint_<time>/meta.json`` (and ``checkpoints/<step>/meta.json`` of a local run):
  each checkpoint's metrics (its step, strategy and tokens so far), not its optimizer state;
- ``wandb/…`` and ``mlruns/…``: the job's W&B run logged offline and its MLflow store (workers/integrations.py).

Everything else is not found: other names, hidden or ``.part`` files, and any path that reaches a
file through ``..`` or a symlink — even one that points back inside the folder.
"""

from __future__ import annotations

import os
import stat
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from service.domain.storage import Download, StorageEscape, join, object_store
from service.settings import Settings
from service.store.models import Job

# One pattern per row, a glob per path segment; "**" (last) is one or more segments.
ALLOWED: tuple[tuple[str, ...], ...] = (
    ("adapter", "**"),
    ("merged", "**"),
    ("model", "**"),
    ("ray", "*", "checkpoint_*", "meta.json"),
    ("checkpoints", "*", "meta.json"),
    ("wandb", "**"),  # the W&B run logged offline (workers/integrations.py), for `wandb sync`
    ("mlruns", "**"),  # the MLflow store of an integration without a tracking server
)
MAX_FILES = 500


class FileNotInJob(LookupError):
    pass


def output_root(job: Job, settings: Settings) -> Path:
    return Path(job.output_dir) if job.output_dir else settings.storage_dir / "jobs" / job.id


def output_location(job: Job, settings: Settings) -> str:
    """The job's output folder as users are told it: its path on the volume, or its ``s3://`` URI."""
    return stored_location(settings, output_root(job, settings))


def stored_location(settings: Settings, path: Path) -> str:
    """Where a path of the volume's layout is kept: the path itself, or on object storage its object's URI."""
    store = object_store(settings)
    if store is None:
        return str(path)
    try:
        return store.uri(store.key_for(settings.storage_dir, path))
    except StorageEscape:
        return str(path)


def is_allowed(relpath: str) -> bool:
    """Whether a path relative to the output folder names an artefact a tenant may read."""
    parts = PurePosixPath(relpath).parts
    if not parts or any(_hidden(p) for p in parts):
        return False
    return any(_matches(pattern, parts) for pattern in ALLOWED)


def list_artifacts(job: Job, settings: Settings) -> list[dict[str, Any]]:
    """The allowed regular files under the job's output folder (symlinks are neither followed nor
    listed), as ``{"path", "bytes"}``, sorted; at most MAX_FILES."""
    root = output_root(job, settings)
    store = object_store(settings)
    if store is not None:  # the bucket mirrors the folder (service/domain/storage.py)
        try:
            prefix = store.key_for(settings.storage_dir, root)
        except StorageEscape:
            return []
        allowed = [{"path": rel, "bytes": size} for rel, size in store.list(prefix) if is_allowed(rel)]
        return allowed[:MAX_FILES]
    if not root.is_dir() or root.is_symlink():
        return []
    out: list[dict[str, Any]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # never follows symlinked folders
        rel = Path(dirpath).relative_to(root).parts
        dirnames[:] = sorted(d for d in dirnames if not _hidden(d) and _may_contain((*rel, d)))
        for name in sorted(filenames):
            relpath = PurePosixPath(*rel, name).as_posix()
            if not is_allowed(relpath):
                continue
            try:
                st = os.lstat(Path(dirpath) / name)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append({"path": relpath, "bytes": st.st_size})
            if len(out) >= MAX_FILES:
                return out
    return out


def artifact_file(job: Job, settings: Settings, relpath: str) -> Path | Download:
    """The allowed file ``relpath`` of the job's output folder (on object storage: a Download of its
    object). Raises FileNotInJob for anything else: absolute paths, ``.``/``..`` segments, names outside
    the allowlist, a symlink anywhere on the way, directories, missing files."""
    if not relpath or relpath.startswith(("/", "\\")) or "\x00" in relpath or "\\" in relpath:
        raise FileNotInJob(relpath)
    parts = relpath.split("/")
    if any(p in ("", ".", "..") for p in parts) or not is_allowed(relpath):
        raise FileNotInJob(relpath)
    root = output_root(job, settings)
    store = object_store(settings)
    if store is not None:
        try:
            key = join(store.key_for(settings.storage_dir, root), relpath)
        except StorageEscape:
            raise FileNotInJob(relpath) from None
        size = store.size(key)
        if size is None:
            raise FileNotInJob(relpath)
        return Download(store, key, size)
    path = root
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            raise FileNotInJob(relpath)
        for i, part in enumerate(parts):
            path = path / part
            mode = os.lstat(path).st_mode
            last = i == len(parts) - 1
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
                raise FileNotInJob(relpath)
    except OSError:
        raise FileNotInJob(relpath) from None
    return path


def _hidden(name: str) -> bool:
    return name.startswith(".") or name.endswith(".part")


def _matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if pattern[-1] == "**":
        head = pattern[:-1]
        return len(parts) > len(head) and all(fnmatchcase(p, g) for p, g in zip(parts, head))
    return len(parts) == len(pattern) and all(fnmatchcase(p, g) for p, g in zip(parts, pattern))


def _may_contain(parts: tuple[str, ...]) -> bool:
    """Whether an allowed file may lie under the folder ``parts`` (so the walk enters it)."""
    for pattern in ALLOWED:
        head = pattern[:-1]  # a folder is never the pattern's last segment
        if pattern[-1] == "**" and len(parts) >= len(head):
            if all(fnmatchcase(p, g) for p, g in zip(parts, head)):
                return True
        elif len(parts) <= len(head) and all(fnmatchcase(p, g) for p, g in zip(parts, head)):
            return True
    return False
