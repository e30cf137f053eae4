"""Named points in the scheduler where a chaos test can stop it dead.

With ``MEMFIT_TEST_PAUSE_AT=<point>:<marker file>`` in its environment, the scheduler reaching
``<point>`` writes the marker file and sleeps there, so that the test can SIGKILL it at exactly that
point (tests/test_scheduler_faults.py). The points:

- ``claim`` — inside the claim's transaction, after the job's row was updated, before the commit;
- ``before_submit`` — the claim is committed (attempt, lease, token), nothing was sent to Ray;
- ``after_submit`` — Ray accepted the submission, the scheduler has not recorded it.

Unset — always, outside those tests — a point costs one environment lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "MEMFIT_TEST_PAUSE_AT"


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    where, _, marker = spec.partition(":")
    if where != name:
        return
    if marker:
        Path(marker).write_text(str(os.getpid()))
    while True:  # until the test kills us
        time.sleep(3600)
