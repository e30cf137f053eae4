"""Whether the scheduler that `memfit serve` runs beside its API can reach Ray, for ``/readyz``.

`memfit serve` answers HTTP at once and brings the local Ray head up in the background; until the
scheduler has reached Ray, ``/readyz`` says why it is not ready (jobs posted meanwhile are stored and
wait in the queue). A file, not memory: uvicorn's ``--workers`` processes serve ``/readyz`` while the
scheduler runs in the command's own process. No file, no check: an API without an embedded scheduler
(``MEMFIT_SCHEDULER_ENABLED=0``, or the scheduler deployed on its own) does not depend on Ray.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from service.settings import Settings


def run_dir(settings: Settings) -> Path:
    """Where a command records what it started (service/scheduler/lifetime.py), next to the data it serves."""
    return settings.storage_dir / "run"


def _path(settings: Settings) -> Path:
    return run_dir(settings) / "ray-readiness.json"


def mark(settings: Settings, ready: bool, reason: str) -> None:
    path = _path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps({"ready": ready, "reason": reason, "pid": os.getpid()}))
    os.replace(part, path)  # readers see the old state or the new one, never half of it


def clear(settings: Settings) -> None:
    _path(settings).unlink(missing_ok=True)


def read(settings: Settings) -> tuple[bool, str] | None:
    """(ready, reason), or None where no embedded scheduler reports on Ray."""
    try:
        state = json.loads(_path(settings).read_text())
    except (OSError, ValueError):
        return None
    return bool(state.get("ready")), str(state.get("reason", ""))
