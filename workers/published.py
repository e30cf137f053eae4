"""Directories built once and shared: safe when any number of processes, on any number of nodes,
build the same one at once; atomic for readers; self-healing after a crash.

A directory is *published* when it holds a seal, ``.memfit-seal.json``: the build's key and the
name and size of every file in it, written last. The rules:

- a builder writes into a private temporary directory beside the target (a unique name, never a
  pid: pids repeat across nodes and containers), seals it, and renames it onto the target — one
  ``rename(2)``, so a reader sees nothing or the whole thing;
- a reader trusts only a seal whose key matches and whose files are all there at their sizes;
- a target that exists without a valid seal (a half-built folder left by a crash, or files some
  other program wrote there) is not an answer: it is renamed aside and replaced, never merged into;
- when two builders race, the first rename wins and the second finds a valid seal and discards its
  own copy (the build must be deterministic, so both copies are the same);
- a file lock on the same host only saves duplicate work; correctness never depends on it, since
  ``flock`` is not reliable on the network filesystems several nodes share.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

SEAL = ".memfit-seal.json"
# Temporary builds and set-aside folders older than this belong to a builder that died.
ABANDONED_AFTER_S = 3600.0


class PublishError(RuntimeError):
    """The directory could not be published (another process kept replacing it, or I/O failed)."""


def is_published(target: Path, key: str) -> bool:
    """True when ``target`` holds a valid seal for ``key``: every sealed file present, at its size."""
    try:
        seal = json.loads((target / SEAL).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(seal, dict) or seal.get("key") != key or not isinstance(seal.get("files"), dict):
        return False
    for name, size in seal["files"].items():
        try:
            if (target / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def publish_once(target: Path, key: str, build: Callable[[Path], None], *, lock: bool = True) -> Path:
    """Return ``target`` once it is published for ``key``, calling ``build(tmp_dir)`` if needed.

    ``build`` fills an empty directory; it may run in several processes at once (on different
    nodes), so it must produce the same content every time. ``lock=False`` skips the host lock:
    what builders on different nodes of a shared filesystem get.
    """
    target = Path(target)
    if is_published(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _host_lock(target.parent / f".{target.name}.lock", enabled=lock):
        if is_published(target, key):  # built by the process that held the lock before us
            return target
        _sweep_abandoned(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
        try:
            build(tmp)
            _seal(tmp, key)
            _rename_into_place(tmp, target, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename won
    return target


def _seal(directory: Path, key: str) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != SEAL}
    tmp = directory / f"{SEAL}.part"
    with open(tmp, "w") as f:
        json.dump({"key": key, "files": files, "sealed_at": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / SEAL)
    _fsync_dir(directory)


def _rename_into_place(tmp: Path, target: Path, key: str, attempts: int = 5) -> None:
    for _ in range(attempts):
        try:
            os.rename(tmp, target)  # fails when target is a non-empty directory; replaces an empty one
            _fsync_dir(target.parent)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        if is_published(target, key):
            return  # another builder (another node, or a lock-less filesystem) won the race
        _set_aside(target, key)
    raise PublishError(f"could not publish {target}: something keeps writing there")


def _set_aside(target: Path, key: str) -> None:
    """Move an unsealed or foreign ``target`` out of the way (one atomic rename), then delete it."""
    aside = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return
    if is_published(aside, key):
        # Between our check and the rename another builder replaced the poison with a good copy:
        # put it back (if nothing took its place meanwhile) rather than delete it under its readers.
        with contextlib.suppress(OSError):
            os.rename(aside, target)
            return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _sweep_abandoned(target: Path) -> None:
    """Delete build and set-aside folders of ``target`` that no live builder can still own."""
    cutoff = time.time() - ABANDONED_AFTER_S
    for prefix in (f".{target.name}.build-", f".{target.name}.stale-"):
        for path in target.parent.glob(prefix + "*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _host_lock(path: Path, enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: the rename protocol alone is still correct
            pass
        yield


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
