"""Writing what a job leaves on the storage volume without ever leaving a half-written folder that looks
finished: :class:`StorageFullError` (the volume is full, naming what was being written and where),
:class:`StorageQuotaError` and :func:`check_storage_budget` (the tenant's quota, checked before a write) and
:func:`publish_folder` (a folder written under a hidden name, then renamed into place whole).

**Object storage** (``MEMFIT_STORAGE_URL=s3://bucket/prefix``; the POSIX volume stays the default). The
store is service/domain/storage.py's :class:`ObjectStore`, re-exported here; its bucket mirrors the
volume's layout (the key ``jobs/<id>/attempts/<n>/model/config.json`` is what
``<MEMFIT_STORAGE_DIR>/jobs/<id>/attempts/<n>/model/config.json`` would be). What a reader needs:

- ``object_store(settings)`` → the store, or None on the volume; ``store.key_for(settings.storage_dir,
  path)`` → the key of a path of the volume's layout (a job's ``output_dir`` and what lies under it);
  ``StorageEscape`` for anything outside;
- ``store.list(prefix)`` → ``[(relative key, bytes)]``; ``store.size(key)`` (None: absent);
  ``store.get_bytes(key)``, ``store.iter_bytes(key)``, ``store.download(key, local)``,
  ``store.download_tree(prefix, local_dir)`` — e.g. an exported ``model/`` folder into a local
  directory to load; ``localize(uri, store, cache_dir)`` — one stored file (``s3://…``) as a local path;
- writes: ``put_bytes``, ``put_file``, ``upload_tree``, ``publish_tree`` (whole or not at all),
  ``copy_tree`` (server-side), ``delete``, ``delete_tree``.

In a Ray job, :func:`attach` (workers/run.py, from the RunRequest's ``object_store`` and ``output_uri``)
makes this process publish exports into the attempt's prefix (:func:`publish_folder`: written locally,
then :meth:`ObjectStore.publish_tree`, then the local copy removed) and count the quota there
(:func:`check_storage_budget`); Ray Train writes the checkpoints itself (workers/run.py: build_trainer
gives it the store's ``pyarrow.fs`` filesystem).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable

from service.domain.disk import folder_bytes
from service.domain.errors import find_storage_full
from service.domain.storage import (  # noqa: F401 - the storage API, re-exported (docstring above)
    ObjectStore,
    StorageEscape,
    is_remote,
    join,
    localize,
    object_store,
)

# This process's attempt on object storage: (its local folder, the store, the attempt's key); None on the volume.
_ATTEMPT: tuple[Path, ObjectStore, str] | None = None


def attach(output_dir: str | Path, store: ObjectStore | None, output_uri: str | None) -> None:
    """Make this process keep the attempt's exports in ``store`` under ``output_uri`` (the key mirroring
    ``output_dir``); without a store, everything stays on the volume."""
    global _ATTEMPT
    _ATTEMPT = (Path(output_dir), store, store.key_of(output_uri)) if store is not None and output_uri else None


def attached() -> tuple[Path, ObjectStore, str] | None:
    """The (local folder, store, key) of this process's attempt on object storage, or None."""
    return _ATTEMPT


def fetch_checkpoint(uri: str, into: str | Path) -> str:
    """A staged checkpoint (an ``s3://`` URI: RunRequest.resume_from on object storage) downloaded whole
    into the local folder ``into``; returns it."""
    if _ATTEMPT is None:
        raise StorageEscape(f"{uri!r} is in object storage, but this process has no store attached")
    store = _ATTEMPT[1]
    return str(store.download_tree(store.key_of(uri), into))


def remote_to_local(path: str | None) -> str | None:
    """A path Ray Train reports in the bucket (``bucket/prefix/jobs/…/ray/…/checkpoint_…``) as the path of
    the volume's layout under the attempt's folder, which ingest checks and records; others unchanged."""
    if path is None or _ATTEMPT is None:
        return path
    local, store, key = _ATTEMPT
    try:
        rel = store.key_of(path)
    except StorageEscape:
        return path
    if rel == key or not rel.startswith(key + "/"):
        return path
    return str(local / rel[len(key) + 1:])


class StorageFullError(OSError):
    """No space left on the storage volume for ``what``; ``str()`` names it and the path. An OSError
    with errno ENOSPC, so that it survives pickling through Ray and reads as one everywhere."""

    phase: str | None = None  # "checkpoint" or "export"

    @classmethod
    def writing(cls, what: str, path: str | Path, cause: BaseException, phase: str) -> "StorageFullError":
        detail = " ".join(str(cause).split())[:300]
        exc = cls(errno.ENOSPC, f"no space left on the storage volume while writing {what} to {path} ({detail})",
                  str(path))
        exc.phase = phase
        return exc


class StorageQuotaError(StorageFullError):
    """The tenant's storage quota (MEMFIT_QUOTA_STORAGE_BYTES) has no room for ``what``: an OSError with
    errno EDQUOT, raised before the write (workers/run.py reports it as ``storage_quota_exceeded``)."""

    @classmethod
    def refusing(cls, what: str, path: str | Path, adding: int, used: int, budget: int, phase: str) -> "StorageQuotaError":
        exc = cls(errno.EDQUOT, f"storage quota exceeded: {what} ({adding} bytes) would take this run's outputs to "
                                f"{used + adding} bytes, past the {budget} bytes the tenant's quota leaves it "
                                "(MEMFIT_QUOTA_STORAGE_BYTES); nothing was written", str(path))
        exc.phase = phase
        return exc


BUDGET_ENV = "MEMFIT_STORAGE_BUDGET_BYTES"  # set by the scheduler (service/jobs/quotas.py: storage_budget)


def check_storage_budget(what: str, adding: int, attempt_dir: str | Path | None, phase: str, where: str | Path,
                         pending: str | None = None) -> None:
    """Before ``adding`` bytes are written (or published, from the folder ``pending`` of the attempt's
    folder): StorageQuotaError when this run's outputs (its folder, less the checkpoint it resumed
    from, which was counted where it was made) would pass the budget the scheduler gave it. No budget
    (no quota): nothing to check."""
    budget = os.environ.get(BUDGET_ENV)
    if not budget or attempt_dir is None:
        return
    skip = ("resume", *((pending,) if pending else ()))
    if _ATTEMPT is not None:  # the attempt's outputs are in the bucket
        used = _ATTEMPT[1].bytes_under(_ATTEMPT[2], skip=skip)
    else:
        used = folder_bytes(Path(attempt_dir), skip=skip)
    if used + adding > int(budget):
        raise StorageQuotaError.refusing(what, where, adding, used, int(budget), phase)


def publish_folder(out: Path, name: str, write: Callable[[Path], object]) -> Path:
    """``write`` the folder ``out/name`` under the hidden name ``.name.part`` (which the artifacts
    routes never serve), then rename it into place; on any failure the partial folder is removed, and
    a full volume raises StorageFullError naming the folder. On object storage (:func:`attach`) the
    folder is then published to the attempt's prefix whole and its local copy removed; the path
    returned still names it in the volume's layout (what ingest records)."""
    final, partial = out / name, out / f".{name}.part"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        write(partial)
        # The tenant's quota, before the export is published: past it, the partial folder goes and the job fails.
        check_storage_budget(f"the final {name} folder", folder_bytes(partial), out, "export", final, pending=partial.name)
        if final.exists():  # a re-export (a resumed run that finished before): replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        if _ATTEMPT is not None and Path(out) == _ATTEMPT[0]:  # into the bucket whole, then no local copy
            _, store, key = _ATTEMPT
            try:
                store.publish_tree(final, join(key, name))
            finally:
                shutil.rmtree(final, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, StorageQuotaError):
            raise
        if find_storage_full(exc) is not None:
            raise StorageFullError.writing(f"the final {name} folder", final, exc, "export") from exc
        raise
    return final
