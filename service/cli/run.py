"""`memfit run examples/x.yaml`: one fine-tune, end to end, on the embedded service.

The YAML file is the job's POST body, except that ``training_file`` and ``validation_file`` are
paths (relative to the YAML file) that are uploaded first. The command starts the embedded service
(database and storage under ./.memfit unless MEMFIT_* say otherwise, a local Ray head, the API on a
free port, the scheduler), creates a tenant key, uploads, POSTs the job over HTTP, follows it with a
live progress bar, prints where the model was saved and a summary, and shuts down what it started.
Exit code 0 when the job succeeded, 1 when it failed or was cancelled, 2 for a bad file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

TERMINAL = ("succeeded", "failed", "cancelled")


class BadJobFile(ValueError):
    pass


def load_job_file(path: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """(the POST body without the file fields, {field: local path}) — errors name the field."""
    import yaml

    try:
        body = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BadJobFile(f"cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise BadJobFile(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(body, dict):
        raise BadJobFile(f"{path}: the top level must be a mapping (the job's POST body)")
    files: dict[str, Path] = {}
    for name in ("training_file", "validation_file"):
        value = body.pop(name, None)
        if value is None:
            continue
        local = (path.parent / str(value)).resolve()
        if not local.is_file():
            raise BadJobFile(f"{path}: {name}: no file at {local}")
        files[name] = local
    if "training_file" not in files:
        raise BadJobFile(f"{path}: training_file: required (a JSONL path relative to the YAML file)")
    return body, files


def run_file(path: Path, *, console: Console | None = None, timeout_s: float = 3600.0) -> int:
    from service.cli.embedded import quiet_logging, run_dir
    from service.scheduler.lifetime import command_lifetime
    from service.settings import ensure_dirs, get_settings

    console = console or Console()
    settings = get_settings()  # a bad MEMFIT_* setting: SettingsInvalid, one line each (service/cli/main.py: main)
    try:
        body, files = load_job_file(path)
    except BadJobFile as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    ensure_dirs(settings)
    home = settings.storage_dir.parent
    quiet_logging(home / "logs" / "memfit-run.log")
    # SIGTERM (`timeout`, a container stop) would end Python at once, skipping every `finally` below
    # and leaving the Ray head and the job running: command_lifetime makes it an exception instead.
    with command_lifetime(run_dir(settings), "memfit run"):
        return _run_on_embedded_service(settings, home, body, files, console, timeout_s)


def _run_on_embedded_service(settings, home: Path, body: dict[str, Any], files: dict[str, Path],
                             console: Console, timeout_s: float) -> int:
    from service.cli.embedded import EmbeddedService
    from service.store.auth import create_key
    from service.store.db import session_scope

    t0 = time.monotonic()
    with console.status("Starting the embedded service (database, local Ray head, API, scheduler)…"):
        service = EmbeddedService(settings, log_dir=home / "logs").start()
    try:
        console.print(f"service up in {time.monotonic() - t0:.1f} s: API {service.url}, "
                      f"Ray {service.scheduler.ray.address}, data in {home}")
        with session_scope(service.app.state.sessions) as s:
            key = create_key(s, "memfit-run").key
        with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            for name, local in files.items():
                with local.open("rb") as f:
                    r = http.post("/v1/files", files={"file": (local.name, f)}, data={"purpose": "fine-tune"})
                if r.status_code != 200:
                    console.print(f"[red]upload of {local} refused:[/red] {r.json().get('detail', r.text)}")
                    return 2
                body[name] = r.json()["id"]
                console.print(f"uploaded {local.name} as {body[name]} ({r.json().get('rows')} rows)")
            r = http.post("/v1/fine_tuning/jobs", json=body)
            if r.status_code != 200:
                problem = r.json()
                console.print(f"[red]job refused ({r.status_code}):[/red] {problem.get('detail')}")
                for e in problem.get("errors") or []:
                    console.print(f"  {e.get('param')}: {e.get('message')}")
                return 2
            job = r.json()
            console.print(f"created {job['id']} ({job['model']})")
            try:
                job = follow(http, service, job["id"], console, timeout_s)
            except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM/SIGHUP as service.scheduler.lifetime.Stopped
                console.print("[yellow]interrupted: cancelling the job[/yellow]")
                http.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
                return getattr(stop, "exit_code", 130)
            summary(http, job, console, time.monotonic() - t0)
            return 0 if job["status"] == "succeeded" else 1
    finally:
        with console.status("Shutting down the service, scheduler and Ray head…"):
            service.stop()


def follow(http: httpx.Client, service, job_id: str, console: Console, timeout_s: float) -> dict:
    """Follow the job live until terminal (the SSE stream, the same progress bar as `memfit jobs
    follow`: step/total, loss, tokens/s, peak memory per rank, ETA); cancel it after ``timeout_s``."""
    from service.cli.client import follow_stream

    return follow_stream(http, job_id, console, timeout_s=timeout_s)


def summary(http: httpx.Client, job: dict, console: Console, elapsed_s: float) -> None:
    table = Table(show_header=False, box=None)
    table.add_row("job", job["id"])
    table.add_row("status", f"[{'green' if job['status'] == 'succeeded' else 'red'}]{job['status']}[/]")
    table.add_row("model", job["model"])
    metrics = [e for e in http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]
               if e["type"] == "metrics" and (e.get("data") or {}).get("rank", 0) == 0]
    if metrics:
        last = max(metrics, key=lambda e: e["data"]["step"])["data"]
        table.add_row("steps", str(last["step"]))
        if last.get("train_loss") is not None:
            table.add_row("final training loss", f"{last['train_loss']:.4f}")
        evals = [e["data"]["valid_loss"] for e in metrics if e["data"].get("valid_loss") is not None]
        if evals:
            table.add_row("validation loss", f"{evals[0]:.4f}")
    if job.get("trained_tokens"):
        table.add_row("trained tokens", f"{job['trained_tokens']:,}")
    ckpts = http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    table.add_row("checkpoints", ", ".join(f"step {c['step_number']}" for c in reversed(ckpts)) or "none")
    table.add_row("wall time", f"{elapsed_s:.1f} s")
    if job["status"] == "succeeded":
        table.add_row("fine_tuned_model", job.get("fine_tuned_model") or "-")
        for file_id in job.get("result_files") or []:
            r = http.get(f"/v1/files/{file_id}/content")
            if r.status_code == 200:
                try:
                    result = r.json()
                except json.JSONDecodeError:
                    continue
                for name, where in (result.get("artifacts") or {}).items():
                    table.add_row(f"saved {name}", str(where))
    elif job.get("error"):
        table.add_row("error", f"{job['error'].get('code')}: {job['error'].get('message')}")
    console.print(table)
    if job["status"] == "succeeded":
        paths = _model_paths(http, job)
        if paths:
            # Plain print: a path must never be wrapped by the terminal width (scripts grep it).
            console.file.flush()
            print(f"Model saved to {paths[0]}", flush=True)


def _model_paths(http: httpx.Client, job: dict) -> list[str]:
    out = []
    for file_id in job.get("result_files") or []:
        r = http.get(f"/v1/files/{file_id}/content")
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
            artifacts = r.json().get("artifacts") or {}
            for name in ("adapter", "model", "merged", "merged_model"):
                if name in artifacts:
                    out.append(artifacts[name])
            out.extend(v for k, v in artifacts.items() if v not in out)
    return out


# --- the typer commands (registered in service/cli/main.py) ---------------------------------------------

import typer  # noqa: E402


def run_cli(
    job_file: Path = typer.Argument(..., exists=True, dir_okay=False, help="A job YAML, e.g. examples/tiny-lora.yaml."),
    timeout: float = typer.Option(3600.0, help="Cancel the job after this many seconds."),
) -> None:
    """Fine-tune once on the embedded service: upload, create, follow with a progress bar, summarise."""
    raise typer.Exit(run_file(job_file, timeout_s=timeout))


def scheduler_cli() -> None:
    """Run the scheduler loop alone against MEMFIT_DATABASE_URL and MEMFIT_RAY_ADDRESS (Jobs API URL)."""
    import logging

    from service.cli.embedded import scheduler_main
    from service.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scheduler_main(get_settings())
