"""The delivery spool: a run's records as JSON lines on disk, and how far the API has stored them.

A run's records (service.domain.records dicts) are appended to ``metrics-attempt-N.jsonl`` in the job's
storage *before* anyone tries to deliver them, so the file is the buffer: nothing is held only in
memory and nothing is dropped for space. Beside it, ``metrics-attempt-N.jsonl.delivered`` holds a
byte offset: every line before it has been stored by the API. Two readers deliver from that offset
through the same ingest code — the worker's HTTP sink (workers/sink_http.py) while the run is alive,
and the scheduler (service/scheduler/loop.py) when the run has ended with lines still undelivered.

Delivery is at least once: a reader may resend a line whose answer it lost, or two readers may send
the same line. The store is idempotent by each record's dedupe key, and an event record that carries
no key of its own gets one from its place in the file (``spool:<byte offset>``), which every reader
computes alike — so a line is stored once however often it is read.

Torch-free and database-free: both the workers and the scheduler import it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("memfit.spool")

DELIVERED_SUFFIX = ".delivered"


def delivered_path(spool: str | Path) -> Path:
    spool = Path(spool)
    return spool.with_name(spool.name + DELIVERED_SUFFIX)


def append(spool: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Append records as one write(2) on an O_APPEND descriptor, so lines of several writers (the
    controller, the driver) never interleave. Returns the bytes written."""
    data = "".join(json.dumps(r, default=_jsonable) + "\n" for r in records).encode()
    if not data:
        return 0
    spool = Path(spool)
    spool.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(spool, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole; loop only for the pathological short write
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return len(data)


def size(spool: str | Path) -> int:
    try:
        return Path(spool).stat().st_size
    except FileNotFoundError:
        return 0


def delivered_offset(spool: str | Path) -> int:
    """Bytes of the spool the API has stored (0 when nothing is recorded or the record is unreadable:
    re-reading from the start is safe, only slower)."""
    try:
        return max(0, int(delivered_path(spool).read_text().strip() or 0))
    except (FileNotFoundError, ValueError):
        return 0
    except OSError as exc:
        log.warning("cannot read %s: %s; delivering from the start", delivered_path(spool), exc)
        return 0


def mark_delivered(spool: str | Path, offset: int) -> None:
    """Record that everything before ``offset`` is stored. Atomic (a reader sees the old or the new
    number); a concurrent reader may write a smaller one afterwards, which only means re-sending."""
    path = delivered_path(spool)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(str(int(offset)))
    os.replace(tmp, path)


def read(spool: str | Path, offset: int, *, max_records: int = 500,
         max_bytes: int = 4 * 1024 * 1024) -> tuple[list[dict[str, Any]], int]:
    """Complete lines from ``offset`` on: (records, the offset after the last line consumed).

    A line still being written (no newline yet) is left for the next read. A line that is not a JSON
    object (a torn write from a crash) is skipped, and logged. Events without a dedupe key get
    ``spool:<offset of their line>``."""
    records: list[dict[str, Any]] = []
    try:
        f = open(spool, "rb")
    except FileNotFoundError:
        return records, offset
    with f:
        f.seek(offset)
        used = 0
        while len(records) < max_records and used < max_bytes:
            line = f.readline()
            if not line.endswith(b"\n"):
                break  # end of file, or a line still being appended
            at = offset
            offset += len(line)
            used += len(line)
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                log.warning("%s: skipping an unreadable line at byte %d", spool, at)
                continue
            if record.get("kind") == "event" and not record.get("dedupe"):
                record["dedupe"] = f"spool:{at}"
            records.append(record)
    return records, offset


def pending_bytes(spool: str | Path) -> int:
    return max(0, size(spool) - delivered_offset(spool))


def _jsonable(value: Any) -> Any:
    # numpy/torch scalars from ray.train.report dicts
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
