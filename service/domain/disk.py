"""Bytes on disk, as the storage quota counts them (service/jobs/quotas.py) and the workers check them
before a checkpoint or export is written (workers/checkpoint.py): no database, no torch."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def folder_bytes(folder: Path, seen: set[tuple[int, int]] | None = None, *, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the regular files under ``folder`` (symlinks neither followed nor counted), each file
    once however many hard links it has (a resumed attempt links its predecessor's checkpoint);
    ``seen`` carries the (device, inode) pairs already counted across calls; ``skip``: top-level names left out."""
    seen = set() if seen is None else seen
    total = 0
    stack = [Path(folder)]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            if current == Path(folder) and entry.name in skip:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
            elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total
