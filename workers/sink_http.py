"""The sink that delivers a run's records to the API's ingest endpoint, durably.

It runs inside the Ray Train controller (a `UserCallback` hands it one dict per rank and report) and
in the driver (the run's final failure record), so it must never block on the network or crash
training. Every record is first appended to the run's spool — the JSON-lines file
``metrics-attempt-N.jsonl`` (service/store/spool.py) — and a background thread posts the spool, from its
delivered offset on, in batches of `IngestBatch` JSON with the job's ingest token, moving the offset
forward after each stored batch. Disk is the buffer: memory holds one batch, nothing is dropped for
space, and whatever is undelivered when the process ends is still in the file, from where the
scheduler replays it once Ray says the run is over (service.scheduler, ``_replay_spool``).

Delivery rules:
- connection errors, timeouts, 5xx, 408 and 429 are retried with exponential backoff and jitter
  (a `Retry-After` header is honoured) for as long as the process lives; the server is idempotent by
  each record's dedupe key, so a batch that reached it before its answer was lost is stored once;
- 409 (job terminal or attempt stale) and 401/403/404/410 (token revoked or for another job) are
  final: the sink stops posting, since the server would refuse every later record too, and leaves
  the rest of the spool where it is;
- 400/413/422 (a malformed or too large batch) split the batch in halves until the one record the
  server refuses is alone; that record is skipped (counted in `rejected`), the others are stored;
- `close()` waits up to `close_timeout_s` for delivery; what is undelivered then stays in the spool,
  and the thread keeps retrying it until the process exits (or `abandon()`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import httpx

from service.store import spool as spool_file

log = logging.getLogger("memfit.sink_http")

_RETRY_STATUSES = frozenset({408, 429})
_STOP_STATUSES = frozenset({401, 403, 404, 409, 410})


class HttpSink:
    """Spools records to ``spool`` and posts them to ``url`` with ``Authorization: Bearer <token>``.

    Without ``spool`` it keeps its own temporary spool file (removed once everything is delivered)."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        spool: str | Path | None = None,
        batch_size: int = 200,
        flush_interval_s: float = 0.25,
        poll_s: float = 1.0,
        timeout_s: float = 10.0,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 10.0,
        close_timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.poll_s = poll_s  # how often an idle sink looks for lines another process appended
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.close_timeout_s = close_timeout_s
        self._own_spool = spool is None
        if spool is None:
            fd, name = tempfile.mkstemp(prefix="memfit-ingest-", suffix=".jsonl")
            os.close(fd)
            spool = name
        self.spool = Path(spool)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._offset = spool_file.delivered_offset(self.spool)
        if self._offset > spool_file.size(self.spool):  # a spool replaced under its old offset
            self._offset = 0
        self._cond = threading.Condition()
        self._woken = False
        self._closing = False
        self._abandoned = threading.Event()
        # What happened, for the caller and for tests.
        self.posted = 0  # records the server accepted
        self.rejected = 0  # single records the server refused as malformed (skipped)
        self.dropped = 0  # records the sink will not deliver: rejected, refused by a final answer, or written after one
        self.attempts = 0  # HTTP requests made
        self.stopped_reason: str | None = None  # set when a final answer stopped the sink
        self._thread = threading.Thread(target=self._run, name="memfit-http-sink", daemon=True)
        self._thread.start()

    # --- the sink interface ------------------------------------------------------------------

    def write(self, records: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
        """Spool one record or a list of them (service.domain.records dicts, as workers.sink's sinks take).
        Never waits on the network, never raises."""
        self.write_many([records] if isinstance(records, dict) else records)

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        records = list(records)
        if not records:
            return
        try:
            spool_file.append(self.spool, records)
        except (OSError, TypeError, ValueError) as exc:
            log.error("cannot spool %d records to %s: %s", len(records), self.spool, exc)
            self.dropped += len(records)
            return
        with self._cond:
            if self.stopped_reason is not None:
                self.dropped += len(records)
            self._woken = True
            self._cond.notify_all()

    # Names other sinks may use.
    emit = write_many
    __call__ = write

    @property
    def delivered_offset(self) -> int:
        return self._offset

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything spooled so far is dealt with: stored, skipped as malformed, or
        refused by a final answer. False when the timeout passed first (the sink keeps retrying)."""
        target = spool_file.size(self.spool)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.close_timeout_s)
        with self._cond:
            self._woken = True
            self._cond.notify_all()
            while self._offset < target and self.stopped_reason is None and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
            return self._offset >= target or self.stopped_reason is not None

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (default close_timeout_s) for delivery; True when it is complete.
        Otherwise the rest stays in the spool and the thread keeps retrying while the process lives."""
        with self._cond:
            already = self._closing
        done = self.flush(0 if already else timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if done:
            self._thread.join(self.poll_s + 5)
            if self._own_spool:
                self._remove_own_spool()
        elif not already:
            log.warning("%d bytes of records not delivered yet; they stay in %s (retried while this process "
                        "lives, replayed by the scheduler when the run has ended)",
                        spool_file.size(self.spool) - self._offset, self.spool)
        return done

    def abandon(self) -> None:
        """Stop retrying now (at the next back-off); the spool keeps what was not delivered."""
        self._abandoned.set()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self.poll_s + 5)

    def __enter__(self) -> "HttpSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self.stopped_reason is None and not self._abandoned.is_set():
                records, end = spool_file.read(self.spool, self._offset, max_records=self.batch_size)
                if records:
                    if self._deliver(records):
                        self._advance(end)
                    continue
                if end != self._offset:  # only unreadable lines: step over them
                    self._advance(end)
                    continue
                with self._cond:
                    self._cond.notify_all()  # flush() waiters: nothing is pending
                    if self._closing:
                        return
                    if not self._woken:
                        self._cond.wait(self.poll_s)
                    woken, self._woken = self._woken, False
                if woken and not self._closing:
                    # Let the rest of a report arrive so that one request carries several ranks/steps.
                    time.sleep(self.flush_interval_s)
        except Exception:  # noqa: BLE001 - a sink bug must never take training down
            log.exception("ingest sink stopped by an unexpected error; the spool %s keeps the records", self.spool)
        finally:
            self._client.close()
            with self._cond:
                self._cond.notify_all()

    def _advance(self, offset: int) -> None:
        with self._cond:
            self._offset = offset
            self._cond.notify_all()
        try:
            spool_file.mark_delivered(self.spool, offset)
        except OSError as exc:  # the next reader re-sends from an older offset: harmless
            log.warning("cannot record the delivered offset of %s: %s", self.spool, exc)

    def _deliver(self, records: list[dict[str, Any]]) -> bool:
        """Post until the server answers for these records. True when they are dealt with (stored, or
        the single malformed one skipped); False when the sink stopped or was abandoned."""
        body = json.dumps({"records": records}, default=spool_file._jsonable)
        failures = 0
        while not self._abandoned.is_set():
            retry_after: float | None = None
            self.attempts += 1
            try:
                response = self._client.post(self.url, content=body)
            except httpx.HTTPError as exc:  # connection refused, reset, timeout …
                reason = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 300:
                    self.posted += len(records)
                    return True
                if status >= 500 or status in _RETRY_STATUSES:
                    reason = f"HTTP {status}"
                    retry_after = _retry_after_s(response)
                elif status in _STOP_STATUSES:
                    with self._cond:
                        self.stopped_reason = f"HTTP {status}: {response.text[:500]}"
                        self.dropped += len(records)
                        self._cond.notify_all()
                    log.warning("ingest refused, sink stops (the spool %s keeps the rest): %s",
                                self.spool, self.stopped_reason)
                    return False
                elif len(records) > 1:  # find the record the server refuses; deliver the others
                    half = len(records) // 2
                    return self._deliver(records[:half]) and self._deliver(records[half:])
                else:
                    log.warning("ingest rejected a %s record (HTTP %d), skipping it: %s",
                                records[0].get("kind"), status, response.text[:500])
                    self.rejected += 1
                    self.dropped += 1
                    return True
            failures += 1
            delay = retry_after if retry_after is not None else self._backoff(failures)
            log.info("ingest post failed (%s); retry %d in %.2f s", reason, failures, delay)
            self._abandoned.wait(delay)
        return False

    def _backoff(self, failures: int) -> float:
        # "Equal jitter": uniform in [c/2, c] with c = min(cap, base·2^n) spreads the retries of many
        # controllers that lost the API at the same moment, yet never retries immediately.
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** min(failures - 1, 30)))
        return random.uniform(ceiling / 2, ceiling)

    def _remove_own_spool(self) -> None:
        for path in (self.spool, spool_file.delivered_path(self.spool)):
            try:
                path.unlink()
            except OSError:
                pass


def _retry_after_s(response: httpx.Response) -> float | None:
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = response.headers.get(header)
        if value:
            try:
                return min(60.0, max(0.0, float(value) * scale))
            except ValueError:
                return None
    return None
