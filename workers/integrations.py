"""A job's ``integrations``, run: every step's metrics, the job's config and its final summary go to
Weights & Biases (OpenAI's integration) and MLflow (memfit's extension) as well as to the job's events.

They run where a run's metrics are gathered — workers/sink.py's RecordCallback, in Ray Train's controller —
from the same records the API ingests, under the same names (service/domain/records.py METRIC_NAMES:
train_loss, valid_loss, train/valid_mean_token_accuracy, full_valid_*, learning_rate …, DPO's rewards), at the
same steps; only rank 0's metrics are logged (they are the job's, as its CSV result file has them).

- W&B: online where the process has ``WANDB_API_KEY``; otherwise offline (``WANDB_MODE=offline``) into the
  attempt's folder, ``wandb/`` — an artefact of the job (``wandb sync`` uploads it later). The run's id is the
  job's, so a later attempt resumes the same run.
- MLflow: the given ``tracking_uri`` (an http(s) tracking server), or a store in the attempt's folder,
  ``mlruns/mlflow.db`` (SQLite; an artefact, readable with ``MlflowClient(tracking_uri=local_store_uri(folder))``); the experiment
  named by the integration (default ``memfit``); a run tagged ``memfit.job_id``, found again by a later attempt.

An integration that cannot start or log (the package missing, the server unreachable) never stops the
training: it says so once in a warn event and is left off.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from service.domain.records import named_metrics

log = logging.getLogger(__name__)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


class WandbRun:
    kind = "wandb"

    def __init__(self, cfg: dict, *, job_id: str, attempt: int, folder: Path, config: dict):
        self.cfg, self.job_id, self.attempt, self.folder, self.config = cfg, job_id, attempt, folder, config
        self.run = None

    def start(self) -> str:
        import wandb

        online = bool(os.environ.get("WANDB_API_KEY"))
        directory = self.folder / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.cfg["project"], entity=self.cfg.get("entity"), name=self.cfg.get("name") or self.job_id,
            tags=self.cfg.get("tags"), id=self.job_id, resume="allow", dir=str(self.folder),
            mode="online" if online else "offline", config={**self.config, "memfit.attempt": self.attempt},
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        where = "online" if online else f"offline (no WANDB_API_KEY on the cluster) into wandb/ ({self.run.dir})"
        return f"W&B run {self.job_id} of project {self.cfg['project']!r} logging {where}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any], failed: bool) -> None:
        if self.run is None:
            return
        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if failed else 0)
        self.run = None


class MlflowRun:
    kind = "mlflow"

    def __init__(self, cfg: dict, *, job_id: str, attempt: int, folder: Path, config: dict):
        self.cfg, self.job_id, self.attempt, self.folder, self.config = cfg, job_id, attempt, folder, config
        self.client = self.run_id = None

    def start(self) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        store = (self.folder / "mlruns").resolve()
        if not self.cfg.get("tracking_uri"):
            store.mkdir(parents=True, exist_ok=True)
        uri = self.cfg.get("tracking_uri") or local_store_uri(self.folder)
        self.client = MlflowClient(tracking_uri=uri)
        name = self.cfg.get("experiment") or "memfit"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=None if self.cfg.get("tracking_uri") else (store / "artifacts").as_uri())
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`memfit.job_id` = '{self.job_id}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(experiment_id, run_name=self.cfg.get("run_name") or self.job_id,
                                         tags={"memfit.job_id": self.job_id})
            self.run_id = run.info.run_id
            params = [Param(k[:250], str(v)[:6000]) for k, v in _flat(self.config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.set_tag(self.run_id, "memfit.attempt", str(self.attempt))
        where = "in mlruns/" if not self.cfg.get("tracking_uri") else f"at {self.cfg['tracking_uri']}"
        return f"MLflow run {self.run_id} of experiment {name!r} logging {where}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, summary: dict[str, Any], failed: bool) -> None:
        if self.client is None:
            return
        for key, value in summary.items():
            self.client.set_tag(self.run_id, f"memfit.{key}", str(value))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        self.client = None


def local_store_uri(folder: str | Path) -> str:
    """The MLflow store of an integration without a tracking server: a SQLite database in the attempt's
    folder, mlruns/mlflow.db (MLflow 3 keeps its file store in maintenance mode and refuses it by default)."""
    return f"sqlite:///{(Path(folder) / 'mlruns' / 'mlflow.db').resolve()}"


KINDS = {"wandb": WandbRun, "mlflow": MlflowRun}


class Integrations:
    """A job's integrations, fed the records of each report (workers/sink.py RecordCallback). ``handle``
    returns the events to add to the job's (started, failed, finished), attempt and time stamped."""

    def __init__(self, integrations: list[dict], *, job_id: str, attempt: int, output_dir: str, config: dict):
        self.attempt = attempt
        self.runs = [KINDS[i["type"]](i[i["type"]], job_id=job_id, attempt=attempt, folder=Path(output_dir),
                                      config=config) for i in integrations or [] if i.get("type") in KINDS]
        self.started = False
        self.last: dict[str, Any] = {}

    def _event(self, message: str, level: str = "info", **data) -> dict:
        return {"kind": "event", "attempt": self.attempt, "time": time.time(), "level": level,
                "message": message[:4000], "data": data or None}

    def _guard(self, run, what: str, fn, events: list[dict]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an integration never stops the training
            log.warning("integration %s failed to %s: %s", run.kind, what, exc)
            events.append(self._event(f"integration {run.kind} could not {what}: {type(exc).__name__}: {exc}"[:2000],
                                      "warn", integration=run.kind))
            self.runs = [r for r in self.runs if r is not run]

    def handle(self, records: list[dict]) -> list[dict]:
        if not self.runs:
            return []
        events: list[dict] = []
        if not self.started:
            self.started = True
            for run in list(self.runs):
                self._guard(run, "start", lambda run=run: events.append(
                    self._event(run.start(), integration=run.kind)), events)
        for r in records:
            if r.get("kind") == "metrics" and r.get("rank", 0) == 0:
                metrics = named_metrics(r)
                self.last.update(metrics, step=r["step"])
                for run in list(self.runs):
                    self._guard(run, "log", lambda run=run: run.log(r["step"], metrics), events)
            elif r.get("kind") in ("result", "failure"):
                failed = r["kind"] == "failure"
                summary = {**self.last, **({"fine_tuned_model": r.get("fine_tuned_model"),
                                            "trained_tokens": r.get("trained_tokens")} if not failed else
                                           {"error": r.get("code")})}
                summary = {k: v for k, v in summary.items() if v is not None}
                for run in list(self.runs):
                    self._guard(run, "finish", lambda run=run: run.finish(summary, failed), events)
                    events.append(self._event(f"integration {run.kind}: run finished", integration=run.kind))
                self.runs = []
        return events

    def close(self) -> None:
        for run in self.runs:
            try:
                run.finish(self.last, failed=True)
            except Exception:  # noqa: BLE001
                pass
        self.runs = []
