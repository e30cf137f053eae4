"""Where workers' reports go: sinks that take service.domain.records-shaped dicts, and the Ray Train callback
that turns per-rank reports into those records.

Workers call ``ray.train.report(metrics)`` with one dict per rank (see workers/steps.py Progress):
``kind`` "metrics" (step, loss, learning_rate, grad_norm, tokens_per_s, … plus ``memory``: a list of
MemoryRecord-shaped dicts) or "result" (rank 0 carries ``result``: fine_tuned_model, artifacts…).
:class:`RecordCallback` runs inside the Ray Train controller actor — not the driver — so it is built
from plain data (paths, URL, token) and opens its sinks there, on first use.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from service.store import spool

log = logging.getLogger(__name__)

try:
    from ray.train import UserCallback
except ImportError:  # pragma: no cover - the sink is importable without the [train] extra
    UserCallback = object

METRIC_FIELDS = ("rank", "step", "total_steps", "epoch", "loss", "eval_loss", "learning_rate", "grad_norm",
                 "tokens_per_s", "trained_tokens", "step_time_s", "mean_token_accuracy", "eval_mean_token_accuracy",
                 "full_eval_loss", "full_eval_mean_token_accuracy", "reward_margin", "preference_accuracy",
                 "chosen_reward", "rejected_reward", "eval_reward_margin", "eval_preference_accuracy", "mean_reward",
                 "reward_std", "grader_rewards", "kl", "mean_completion_tokens", "grader_error_rate", "eval_mean_reward")
# What a checkpoint's metrics keep of its step's (api/schemas.py names them as OpenAI does)
CHECKPOINT_METRIC_FIELDS = ("loss", "eval_loss", "learning_rate", "mean_token_accuracy", "eval_mean_token_accuracy",
                            "full_eval_loss", "full_eval_mean_token_accuracy", "reward_margin", "preference_accuracy",
                            "mean_reward", "eval_mean_reward")
MEMORY_FIELDS = ("rank", "step", "phase", "source", "parameters_bytes", "gradients_bytes", "optimizer_bytes",
                 "activations_bytes", "temporary_bytes", "other_bytes", "peak_bytes", "host_parameters_bytes",
                 "host_gradients_bytes", "host_optimizer_bytes", "process_rss_bytes", "device")


class MetricsSink(Protocol):
    def write(self, records: list[dict]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line, each batch in one write(2) (service.store.spool.append), so the file
    is complete after every write and several processes (controller, driver) may append."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, records: list[dict]) -> None:
        spool.append(self.path, records)

    def close(self) -> None:
        pass


INGEST_WAIT_ENV = "MEMFIT_WORKER_INGEST_WAIT_S"


def make_sinks(run_request) -> list[MetricsSink]:
    """With ``ingest_url``: the API's HttpSink, spooling to ``metrics_path`` — the JSON-lines file is
    its buffer on disk and what the scheduler replays from, so it is written once, by that sink. With
    ``metrics_path`` alone: a JsonlSink. ``run_request`` is a RunRequest or any object/dict with those
    fields. How long closing the HttpSink waits for the API is MEMFIT_WORKER_INGEST_WAIT_S (default
    60 s; the scheduler forwards MEMFIT_WORKER_* variables into the Ray job)."""
    get = run_request.get if isinstance(run_request, dict) else lambda k: getattr(run_request, k, None)
    if get("ingest_url"):
        try:
            from workers.sink_http import HttpSink
        except ImportError as exc:
            log.warning("ingest_url is set but workers.sink_http is unavailable (%s); metrics go to JSON lines only", exc)
        else:
            return [HttpSink(get("ingest_url"), get("ingest_token"), spool=get("metrics_path"),
                             close_timeout_s=_ingest_wait_s())]
    return [JsonlSink(get("metrics_path"))] if get("metrics_path") else []


def _ingest_wait_s() -> float:
    raw = os.environ.get(INGEST_WAIT_ENV, "60")
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using 60", INGEST_WAIT_ENV, raw)
        return 60.0


# --- per-rank reports → records -----------------------------------------------------------------


def _clean(d: dict, fields: tuple[str, ...]) -> dict:
    return {k: d[k] for k in fields if k in d and d[k] is not None}


def report_to_records(per_rank: list[dict], checkpoint_path: str | None, attempt: int, now: float | None = None) -> list[dict]:
    """Turn one report (a dict per rank) into service.domain.records dicts, attempt and time stamped."""
    now = time.time() if now is None else now
    stamp = {"attempt": attempt, "time": now}
    records: list[dict] = []
    endings: list[dict] = []  # a result or failure goes last: ingest stores nothing after the run's last word
    for rank, m in enumerate(per_rank):
        if not m:
            continue
        kind = m.get("kind", "metrics")
        if kind == "metrics":
            records.append({"kind": "metrics", **stamp, **_clean({"rank": rank, **m}, METRIC_FIELDS)})
            for mem in m.get("memory") or []:
                records.append({"kind": "memory", **stamp, **_clean({"rank": rank, **mem}, MEMORY_FIELDS)})
            for ev in m.get("events") or []:
                records.append({"kind": "event", **stamp, **_clean(ev, ("level", "message", "data", "dedupe"))})
        elif kind == "result" and m.get("memory"):  # the last phases (checkpoint, export) of every rank
            for mem in m["memory"]:
                records.append({"kind": "memory", **stamp, **_clean({"rank": rank, **mem}, MEMORY_FIELDS)})
        if kind == "result" and m.get("result"):
            r = m["result"]
            endings.append({"kind": "result", **stamp, "fine_tuned_model": r["fine_tuned_model"],
                            "artifacts": r.get("artifacts", {}), "trained_tokens": r.get("trained_tokens"),
                            "metrics": r.get("metrics", {})})
        if m.get("failure"):
            f = m["failure"]
            endings.append({"kind": "failure", **stamp, **{k: f.get(k) for k in ("code", "message", "rank", "step", "phase")},
                            "details": f.get("details") or {}})
    if checkpoint_path is not None and per_rank and per_rank[0]:
        first = per_rank[0]
        records.append({"kind": "checkpoint", **stamp, "step": int(first.get("step", 0)), "path": checkpoint_path,
                        "metrics": _clean(first, CHECKPOINT_METRIC_FIELDS)})
    return records + endings


def failure_records(output_dir: str | Path, attempt: int, since: float = 0.0) -> list[dict]:
    """Structured failures workers wrote beside the outputs (failure-rank<r>.json), newest run only."""
    out = []
    for path in sorted(Path(output_dir).glob("failure-rank*.json")):
        if path.stat().st_mtime < since:
            continue
        try:
            f = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.append({"kind": "failure", "attempt": attempt, "time": path.stat().st_mtime,
                    **{k: f.get(k) for k in ("code", "message", "param", "rank", "step", "phase")},
                    "details": f.get("details") or {}})
    return out


class RecordCallback(UserCallback):
    """Ray Train V2 controller callback: per-rank reports → records → sinks.

    Constructed from plain data because Ray pickles it into the controller actor."""

    def __init__(self, *, attempt: int = 1, metrics_path: str | None = None, ingest_url: str | None = None,
                 ingest_token: str | None = None, integrations: list[dict] | None = None, job_id: str = "",
                 output_dir: str | None = None, config: dict | None = None, remote: tuple | None = None):
        self.attempt = attempt
        self.remote = remote  # (output_dir, ObjectStore, output_uri) on object storage (workers/storage.py: attach)
        self.metrics_path = metrics_path
        self.ingest_url = ingest_url
        self.ingest_token = ingest_token
        # the job's W&B / MLflow runs (workers/integrations.py), fed the same records
        self.integration_specs = {"integrations": integrations or [], "job_id": job_id, "attempt": attempt,
                                  "output_dir": output_dir or ".", "config": config or {}}
        self._sinks: list[MetricsSink] | None = None
        self._integrations = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_sinks"] = None  # sinks hold files/clients: reopen them on the other side
        state["_integrations"] = None
        return state

    @property
    def integrations(self):
        if self._integrations is None and self.integration_specs["integrations"]:
            from workers.integrations import Integrations

            self._integrations = Integrations(**self.integration_specs)
        return self._integrations

    @property
    def sinks(self) -> list[MetricsSink]:
        if self._sinks is None:
            self._sinks = make_sinks({"metrics_path": self.metrics_path, "ingest_url": self.ingest_url,
                                      "ingest_token": self.ingest_token})
        return self._sinks

    def emit(self, records: list[dict]) -> None:
        for sink in self.sinks:
            try:
                sink.write(records)
            except Exception as exc:  # noqa: BLE001 - a sink failure must never stop training
                log.warning("metrics sink %s failed: %s", type(sink).__name__, exc)

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        path = getattr(checkpoint, "path", None) if checkpoint is not None else None
        if path is not None and self.remote is not None:  # in the bucket: named as in the volume's layout
            from workers.storage import attach, remote_to_local

            attach(*self.remote)
            path = remote_to_local(path)
        records = report_to_records(metrics, path, self.attempt)
        if self.integrations is not None:  # their events (a run started, finished, failed) go with the records
            records = records + self.integrations.handle(records)
        self.emit(records)
        if any(r["kind"] == "result" for r in records):
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception:  # noqa: BLE001
                    pass
            self._sinks = None

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        # Ray may restart the worker group (FailureConfig.max_failures): this is an event, not the
        # job's final failure, which the driver reports when fit() gives up.
        ranks = sorted(worker_exceptions)
        message = "; ".join(f"rank {r}: {type(e).__name__}: {e}"[:500] for r, e in worker_exceptions.items())
        self.emit([{"kind": "event", "attempt": self.attempt, "time": time.time(), "level": "warn",
                    "message": f"worker group failed ({message})"[:4000], "data": {"ranks": ranks}}])
