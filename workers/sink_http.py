"""The sink that posts a run's records to the API's ingest endpoint.

It runs inside the Ray Train controller (a `UserCallback` hands it one dict per rank and report), so
it must never block or crash training: records go into a bounded in-memory queue and a background
thread posts them in batches as `IngestBatch` JSON with the job's ingest token.

Delivery rules:
- connection errors, timeouts, 5xx, 408 and 429 are retried with exponential backoff and full jitter
  (a `Retry-After` header is honoured); the server is idempotent by (job, attempt, rank, step, kind
  [, phase]), so a batch that reached the server before its answer was lost is stored once;
- any other 4xx is final: 409 (job terminal or attempt stale), 401/403/404 (token revoked or for
  another job) stop the sink — every later record is dropped, since the server will refuse it too;
  400/413/422 (a malformed batch) drop that batch only;
- when the queue is full the oldest metrics/memory sample is dropped (counted in `dropped`);
  checkpoint, event, result and failure records are never dropped for space;
- `close()` flushes what is queued, retrying until `close_timeout_s`, then gives up.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from typing import Any, Iterable

import httpx

log = logging.getLogger("memfit.sink_http")

# Sampled telemetry: losing one is harmless. Everything else changes the job's state.
_DROPPABLE = frozenset({"metrics", "memory"})
_RETRY_STATUSES = frozenset({408, 429})
_STOP_STATUSES = frozenset({401, 403, 404, 409, 410})


class HttpSink:
    """Batches records and posts them to ``url`` with ``Authorization: Bearer <token>``."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        batch_size: int = 200,
        flush_interval_s: float = 0.25,
        max_queue: int = 10_000,
        timeout_s: float = 10.0,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 10.0,
        close_timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_queue = max_queue
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.close_timeout_s = close_timeout_s
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Condition()
        self._closing = False
        self._deadline: float | None = None  # set by close(): retries stop after it
        self._inflight = 0
        # What happened, for the caller and for tests.
        self.posted = 0  # records the server accepted
        self.dropped = 0  # records dropped for space, after a final 4xx, or at close
        self.attempts = 0  # HTTP requests made
        self.stopped_reason: str | None = None  # set when a final answer stopped the sink
        self._thread = threading.Thread(target=self._run, name="memfit-http-sink", daemon=True)
        self._thread.start()

    # --- the sink interface ------------------------------------------------------------------

    def write(self, records: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
        """Queue one record or a list of them (service.records dicts, as workers.sink's sinks take).
        Never blocks on the network, never raises."""
        self.write_many([records] if isinstance(records, dict) else records)

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            for record in records:
                if self.stopped_reason is not None:
                    self.dropped += 1
                    continue
                if len(self._queue) >= self.max_queue:
                    # Drop the oldest sample; if only state-changing records are queued, keep them
                    # all (the bound is soft for those: they are few, one per checkpoint or event).
                    self._make_room()
                self._queue.append(record)
            self._lock.notify()

    # Names other sinks may use.
    emit = write_many
    __call__ = write

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued so far has been posted (or given up). True when empty."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.close_timeout_s)
        with self._lock:
            self._lock.notify()
            while (self._queue or self._inflight) and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(min(remaining, 0.05))
            return not self._queue

    def close(self) -> None:
        """Flush what is queued (retrying until close_timeout_s), then stop the thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._deadline = time.monotonic() + self.close_timeout_s
            self._lock.notify()
        self._thread.join(self.close_timeout_s + 5)
        with self._lock:
            if self._queue:
                self.dropped += len(self._queue)
                log.warning("ingest sink closed with %d records undelivered", len(self._queue))
                self._queue.clear()
        self._client.close()

    def __enter__(self) -> "HttpSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _make_room(self) -> bool:
        for i, record in enumerate(self._queue):
            if record.get("kind") in _DROPPABLE:
                del self._queue[i]
                self.dropped += 1
                return True
        return False

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue and self._closing:
                    return
                if not self._closing and len(self._queue) < self.batch_size:
                    # Let a few more records arrive so one request carries several ranks/steps.
                    self._lock.wait(self.flush_interval_s)
                n = min(self.batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self._inflight = n
            try:
                self._deliver(batch)
            except Exception:  # noqa: BLE001 - a sink bug must never take training down
                log.exception("ingest sink: dropping %d records after an unexpected error", len(batch))
                self.dropped += len(batch)
            with self._lock:
                self._inflight = 0
                self._lock.notify_all()

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        body = json.dumps({"records": batch}, default=_jsonable)
        failures = 0
        while True:
            if self.stopped_reason is not None:
                self.dropped += len(batch)
                return
            retry_after: float | None = None
            self.attempts += 1
            try:
                response = self._client.post(self.url, content=body)
            except httpx.HTTPError as exc:  # connection refused, reset, timeout …
                reason = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 300:
                    self.posted += len(batch)
                    return
                if status >= 500 or status in _RETRY_STATUSES:
                    reason = f"HTTP {status}"
                    retry_after = _retry_after_s(response)
                elif status in _STOP_STATUSES:
                    self.stopped_reason = f"HTTP {status}: {response.text[:500]}"
                    log.warning("ingest refused, sink stops: %s", self.stopped_reason)
                    self.dropped += len(batch)
                    with self._lock:
                        self.dropped += len(self._queue)
                        self._queue.clear()
                    return
                else:
                    log.warning("ingest rejected a batch of %d (HTTP %d): %s", len(batch), status, response.text[:500])
                    self.dropped += len(batch)
                    return
            failures += 1
            delay = retry_after if retry_after is not None else self._backoff(failures)
            deadline = self._deadline
            if deadline is not None and time.monotonic() + delay > deadline:
                log.warning("ingest sink giving up on %d records at close: %s", len(batch), reason)
                self.dropped += len(batch)
                return
            log.info("ingest post failed (%s); retry %d in %.2f s", reason, failures, delay)
            time.sleep(delay)

    def _backoff(self, failures: int) -> float:
        # "Equal jitter": uniform in [c/2, c] with c = min(cap, base·2^n) spreads the retries of many
        # controllers that lost the API at the same moment, yet never retries immediately.
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** (failures - 1)))
        return random.uniform(ceiling / 2, ceiling)


def _retry_after_s(response: httpx.Response) -> float | None:
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = response.headers.get(header)
        if value:
            try:
                return min(60.0, max(0.0, float(value) * scale))
            except ValueError:
                return None
    return None


def _jsonable(value: Any) -> Any:
    # numpy/torch scalars from ray.train.report dicts
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
