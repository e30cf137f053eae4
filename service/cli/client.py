"""`memfit jobs|files|plan`: the API from a terminal (typer + rich), tables for people, --json for scripts.

Settings: MEMFIT_API_URL (default http://127.0.0.1:8000) and MEMFIT_API_KEY, or --api-url/--api-key.
``jobs follow`` is driven by the job's Server-Sent Events stream (GET …/events/stream, resumed with
Last-Event-ID after a dropped connection): a progress bar with step/total, loss, tokens/s, peak
memory per rank and the ETA; :func:`follow_stream` is the one implementation to reuse.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import typer
from rich.console import Console
from rich.table import Table

from service.domain.plan import COMPARED
from service.domain.units import human_bytes

TERMINAL = ("succeeded", "failed", "cancelled")

jobs_app = typer.Typer(help="Fine-tuning jobs on a memfit API.", no_args_is_help=True)
files_app = typer.Typer(help="Training files on a memfit API.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)

ApiUrl = typer.Option(None, "--api-url", envvar="MEMFIT_API_URL", help="The API, e.g. http://127.0.0.1:8000.")
ApiKey = typer.Option(None, "--api-key", envvar="MEMFIT_API_KEY", help="An API key (memfit keys create).")
Json = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        detail = body.get("detail") if isinstance(body, dict) else str(body)
        super().__init__(f"HTTP {status}: {detail}")


def client(api_url: str | None, api_key: str | None, timeout: float = 60.0) -> httpx.Client:
    url = api_url or os.environ.get("MEMFIT_API_URL") or "http://127.0.0.1:8000"
    key = api_key or os.environ.get("MEMFIT_API_KEY")
    if not key:
        err.print("[red]error:[/red] no API key: set MEMFIT_API_KEY or pass --api-key")
        raise typer.Exit(2)
    return httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def call(http: httpx.Client, method: str, path: str, **kw) -> Any:
    try:
        r = http.request(method, path, **kw)
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/red] cannot reach {http.base_url}: {exc}")
        raise typer.Exit(2) from None
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = r.text
        raise ApiError(r.status_code, body)
    return r.json()


def _fail(exc: ApiError) -> None:
    err.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(1)


def mib(n: Any) -> str:
    return human_bytes(n)


def _when(ts: Any) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# --- jobs ----------------------------------------------------------------------------------------


@jobs_app.command("list")
def jobs_list(status: str = typer.Option(None, help="Only jobs with this status."),
              limit: int = typer.Option(20, min=1, max=100), api_url: str = ApiUrl, api_key: str = ApiKey,
              as_json: bool = Json) -> None:
    """List your jobs, newest first."""
    with client(api_url, api_key) as http:
        try:
            page = call(http, "GET", "/v1/fine_tuning/jobs", params={"limit": limit, **({"status": status} if status else {})})
        except ApiError as exc:
            _fail(exc)
    if as_json:
        _print_json(page)
        return
    table = Table("id", "status", "model", "strategy", "created", "finished")
    for j in page["data"]:
        t = j.get("training") or {}
        strategy = t.get("strategy", "-") + (f"+{t['peft']['method']}" if (t.get("peft") or {}).get("method") not in (None, "none") else "")
        table.add_row(j["id"], j["status"], j["model"], strategy, _when(j["created_at"]), _when(j.get("finished_at")))
    console.print(table)


def _job_table(j: dict) -> Table:
    table = Table(show_header=False, box=None)
    t = j.get("training") or {}
    rows = [("id", j["id"]), ("status", j["status"]), ("model", j["model"]),
            ("strategy", t.get("strategy")), ("peft", (t.get("peft") or {}).get("method")),
            ("precision", t.get("precision")), ("workers", (t.get("resources") or {}).get("num_workers")),
            ("attempt", j.get("attempt")), ("created", _when(j.get("created_at"))),
            ("finished", _when(j.get("finished_at"))), ("estimated finish", _when(j.get("estimated_finish"))),
            ("trained tokens", j.get("trained_tokens")), ("fine_tuned_model", j.get("fine_tuned_model"))]
    for k, v in rows:
        if v not in (None, "-"):
            table.add_row(k, str(v))
    if j.get("error"):
        table.add_row("error", f"{j['error'].get('code')}: {j['error'].get('message')}")
    return table


@jobs_app.command("get")
def jobs_get(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Show one job."""
    with client(api_url, api_key) as http:
        try:
            job = call(http, "GET", f"/v1/fine_tuning/jobs/{job_id}")
        except ApiError as exc:
            _fail(exc)
    if as_json:
        _print_json(job)
    else:
        console.print(_job_table(job))


def _action(action: str, job_id: str, api_url: str | None, api_key: str | None, as_json: bool) -> None:
    with client(api_url, api_key) as http:
        try:
            job = call(http, "POST", f"/v1/fine_tuning/jobs/{job_id}/{action}")
        except ApiError as exc:
            _fail(exc)
    if as_json:
        _print_json(job)
    else:
        pending = f" (requested: {job['desired_state']})" if job.get("desired_state") else ""
        console.print(f"{job['id']}: {job['status']}{pending}")


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Cancel a job (any non-terminal status)."""
    _action("cancel", job_id, api_url, api_key, as_json)


@jobs_app.command("pause")
def jobs_pause(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Pause a job at its next checkpoint."""
    _action("pause", job_id, api_url, api_key, as_json)


@jobs_app.command("resume")
def jobs_resume(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Resume a paused job from its latest checkpoint."""
    _action("resume", job_id, api_url, api_key, as_json)


def memory_report(http: httpx.Client, job_id: str) -> dict:
    """Predicted vs measured per rank and category: ``GET /v1/fine_tuning/jobs/{id}/memory``."""
    return call(http, "GET", f"/v1/fine_tuning/jobs/{job_id}/memory")


@jobs_app.command("memory")
def jobs_memory(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Predicted vs measured memory per rank and category, with the error."""
    from service.domain.plan import LABELS
    with client(api_url, api_key) as http:
        try:
            report = memory_report(http, job_id)
        except ApiError as exc:
            _fail(exc)
    if as_json:
        _print_json(report)
        return
    per_rank = report.get("per_rank") or {}
    if not per_rank:
        console.print(f"{job_id}: no memory samples yet")
    if not report.get("has_plan", True):
        console.print("[dim]no memory plan for this job: measured values only[/dim]")
    for rank, rows in per_rank.items():
        table = Table("category", "predicted", "measured", "error", title=f"rank {rank}", title_justify="left")
        for row in rows:
            e = row.get("error")
            label = row.get("label") or LABELS.get(row["category"], row["category"])
            table.add_row(label, mib(row.get("predicted_bytes")),
                          mib(row.get("measured_bytes")), "-" if e is None else f"{e * 100:+.1f}%")
        console.print(table)
    print_phases(report.get("phases") or {})
    _print_steps(report)
    if report.get("capacity_bytes"):
        console.print(f"{report.get('capacity_label')}: {mib(report['capacity_bytes'])}")
    for s in report.get("suggestions") or []:
        console.print(f"  suggestion: {s.get('change')}" + (f" → {mib(s['predicted_peak_bytes'])}" if s.get("predicted_peak_bytes") else ""))


def print_phases(ph: dict) -> None:
    """The job's phases (load, step, eval, checkpoint, export): planned per rank and measured on each rank,
    and which phase peaks, by how much above the next (service/memory/compare.py phase_view)."""
    if not ph or not (ph.get("planned") or ph.get("measured")):
        return
    planned, measured = ph.get("planned") or {}, ph.get("measured") or {}
    cols = ["phase", "planned device", "planned host"]
    for r in measured:
        cols += [f"rank {r} host", f"rank {r} device"]
    table = Table(*cols, title="by phase of the job", title_justify="left")
    for name in ph.get("phases") or []:
        pl = planned.get(name) or {}
        label = name + (" (does not fit)" if pl.get("fits") is False else "")
        row = [label, mib(pl.get("device_bytes")), mib(pl.get("host_bytes"))]
        for phases in measured.values():
            m = phases.get(name) or {}
            row += [mib(m.get("host_bytes")), mib(m.get("device_bytes"))]
        table.add_row(*row)
    console.print(table)

    def lead(x) -> str:
        return f" ({x * 100:.1f}% above the next phase)" if x is not None else ""

    for side in ("device", "host"):
        peak = (ph.get("planned_peak") or {}).get(side) or {}
        if peak.get("phase"):
            console.print(f"planned {side} peak: {peak['phase']}{lead(peak.get('above_next'))}")
    for r, mp in (ph.get("measured_peak") or {}).items():
        for side in ("device", "host"):
            peak = mp.get(side) or {}
            if peak.get("phase"):
                console.print(f"rank {r} measured {side} peak: {peak['phase']}{lead(peak.get('above_next'))}")
def _print_steps(report: dict) -> None:
    """Each measured step against the plan of its own micro-batches, per rank, and what the planner said of the
    run before it started (the memory view's ``steps`` and ``predicted_run``)."""
    run = report.get("predicted_run") or {}
    peak = run.get("peak")
    if peak:
        rows = ", ".join(str(n) for n in sorted(peak["row_tokens"], reverse=True))
        console.print(f"planned peak: step {peak['step']} on rank {peak['rank']} (rows of {rows} tokens), "
                      f"{mib(peak['predicted_live_bytes'])}" + (f"; {run['steps_at_peak']} (step, rank) pairs at it"
                                                               if run.get("steps_at_peak", 0) > 1 else ""))
    steps = (report.get("steps") or {}).get("by_rank") or {}
    if not steps:
        return
    table = Table("rank", "steps", "worst step", "predicted", "measured", "error", "measured peak step",
                  title="each step against its own micro-batches' plan", title_justify="left")
    for rank, r in steps.items():
        w = r["worst"]
        table.add_row(rank, str(r["steps_compared"]), str(w["step"]), mib(w["predicted_bytes"]), mib(w["measured_bytes"]),
                      f"{w['error'] * 100:+.2f}%", str(r.get("measured_peak_step")))
    console.print(table)
    bound = report["steps"].get("bound") or {}
    ok = report["steps"].get("within_bound")
    console.print(f"every step within {bound.get('under', 0) * 100:+.0f}%…{bound.get('over', 0) * 100:+.0f}%: "
                  + ("yes" if ok else "no"))


# --- follow (SSE) --------------------------------------------------------------------------------


def iter_sse(http: httpx.Client, job_id: str, last_event_id: int = 0) -> Iterator[tuple[str, int | None, dict]]:
    """(event name, id, data) from the job's stream until ``end``; reconnects with Last-Event-ID.
    Heartbeat comments come out as ("comment", None, {})."""
    failures = 0
    while True:
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
        try:
            with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events/stream", headers=headers,
                             timeout=httpx.Timeout(60.0, read=90.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    try:
                        body = r.json()
                    except ValueError:
                        body = r.text
                    raise ApiError(r.status_code, body)
                fields: dict[str, str] = {}
                for line in r.iter_lines():
                    if line == "":
                        if "data" in fields:
                            name = fields.get("event", "message")
                            eid = int(fields["id"]) if fields.get("id", "").isdigit() else None
                            if eid is not None:
                                last_event_id = eid
                            yield name, eid, json.loads(fields["data"])
                            if name == "end":
                                return
                        fields = {}
                    elif line.startswith(":"):
                        yield "comment", None, {}  # a heartbeat: lets a caller check its deadline
                    else:
                        key, _, value = line.partition(":")
                        value = value[1:] if value.startswith(" ") else value
                        fields[key] = fields[key] + "\n" + value if key == "data" and key in fields else value
                failures = 0
        except (httpx.TransportError, httpx.RemoteProtocolError):
            failures += 1
            if failures > 20:
                raise
            time.sleep(min(5.0, 0.5 * failures))


def follow_stream(http: httpx.Client, job_id: str, console: Console, *, as_json: bool = False,
                  timeout_s: float | None = None) -> dict:
    """Follow a job to its end from the SSE stream; returns the final job object. With ``timeout_s``
    the job is cancelled once that many seconds have passed (checked at each event and heartbeat).
    `memfit jobs follow` and `memfit run` both use it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + timeout_s if timeout_s else None
    if as_json:
        for name, _, data in iter_sse(http, job_id):
            if name == "comment":
                continue
            sys.stdout.write(json.dumps({"event": name, **({"data": data} if name == "end" else data)}) + "\n")
            sys.stdout.flush()
        return call(http, "GET", f"/v1/fine_tuning/jobs/{job_id}")

    job = call(http, "GET", f"/v1/fine_tuning/jobs/{job_id}")
    progress = Progress(
        TextColumn("[bold]{task.fields[status]:>9}"), BarColumn(), TextColumn("step {task.fields[steps]}"),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("mem {task.fields[mem]}"), TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(),
        console=console, transient=False,
    )
    peaks: dict[int, int] = {}
    last_mem_poll = 0.0

    def poll_memory() -> str:
        """The highest peak per rank of the current attempt, from the API's memory route."""
        nonlocal last_mem_poll
        last_mem_poll = time.monotonic()
        r = http.get(f"/v1/fine_tuning/jobs/{job_id}/memory")
        if r.status_code == 200:
            for rank, rows in (r.json().get("samples") or {}).items():
                for row in rows:
                    total = row.get("peak_bytes") or sum(row.get(f"{c}_bytes") or 0 for c in COMPARED if c != "total")
                    peaks[int(rank)] = max(peaks.get(int(rank), 0), total)
        return " ".join(f"r{r}={mib(v)}" for r, v in sorted(peaks.items())) or "-"

    with progress:
        task = progress.add_task("job", total=None, status=job["status"], steps="-", loss="-", tps="-", mem="-", eta="-")
        for name, _, e in iter_sse(http, job_id):
            if deadline is not None and time.monotonic() > deadline:
                progress.console.print(f"[red]timed out after {timeout_s:.0f} s: cancelling[/red]")
                http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
                break
            if name == "comment":
                continue
            if name == "end":
                progress.update(task, status=e.get("status"))
                break
            d = e.get("data") or {}
            if e.get("type") == "metrics":
                if d.get("rank", 0) == 0:
                    total = d.get("total_steps")
                    eta = "-"
                    if total and d.get("step_time_s"):
                        eta = f"{max(0, total - d['step']) * d['step_time_s']:.0f} s"
                    progress.update(task, total=total, completed=d.get("step", 0),
                                    steps=f"{d.get('step', 0)}/{total or '?'}",
                                    loss=f"{d['train_loss']:.4f}" if d.get("train_loss") is not None else "-",
                                    tps=f"{d['tokens_per_s']:.0f}" if d.get("tokens_per_s") else "-", eta=eta)
                if time.monotonic() - last_mem_poll > 1.0:
                    progress.update(task, mem=poll_memory())
            else:
                if d.get("status"):
                    progress.update(task, status=d["status"])
                style = {"warn": "yellow", "error": "red"}.get(e.get("level"), "dim")
                progress.console.print(f"[{style}]{e.get('message')}[/{style}]")
        progress.update(task, mem=poll_memory())
    job = call(http, "GET", f"/v1/fine_tuning/jobs/{job_id}")
    colour = "green" if job["status"] == "succeeded" else "red"
    console.print(f"[{colour}]{job['id']} {job['status']}[/{colour}]"
                  + (f": {job['fine_tuned_model']}" if job.get("fine_tuned_model") else "")
                  + (f" — {job['error']['code']}: {job['error']['message']}" if job.get("error") else ""))
    return job


@jobs_app.command("follow")
def jobs_follow(job_id: str, api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """Follow a job live until it ends (exit 0 when it succeeded, 1 otherwise)."""
    with client(api_url, api_key) as http:
        try:
            job = follow_stream(http, job_id, console, as_json=as_json)
        except ApiError as exc:
            _fail(exc)
    raise typer.Exit(0 if job["status"] == "succeeded" else 1)


# --- files ---------------------------------------------------------------------------------------


@files_app.command("upload")
def files_upload(path: Path = typer.Argument(..., exists=True, dir_okay=False, help="A JSONL training file."),
                 purpose: str = typer.Option("fine-tune"), api_url: str = ApiUrl, api_key: str = ApiKey,
                 as_json: bool = Json) -> None:
    """Upload a training or validation file; prints its id."""
    with client(api_url, api_key, timeout=600) as http, path.open("rb") as f:
        try:
            body = call(http, "POST", "/v1/files", files={"file": (path.name, f)}, data={"purpose": purpose})
        except ApiError as exc:
            _fail(exc)
    if as_json:
        _print_json(body)
    else:
        console.print(f"{body['id']}  {body['filename']}  {mib(body['bytes'])}  {body.get('rows')} rows")


# --- plan ----------------------------------------------------------------------------------------


def load_spec(path: Path) -> dict:
    import yaml

    try:
        body = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        err.print(f"[red]error:[/red] cannot read {path}: {exc}")
        raise typer.Exit(2) from None
    if not isinstance(body, dict):
        err.print(f"[red]error:[/red] {path}: the top level must be a mapping (a job's create body)")
        raise typer.Exit(2)
    body = dict(body)
    for name in ("training_file", "validation_file"):
        if name in body and not str(body[name]).startswith("file-"):
            body.pop(name)  # a local path (memfit run's YAML): the planner does not need the data
    return body


def _local_training_file(path: Path) -> str | None:
    """A YAML's ``training_file`` when it is a local JSONL path (memfit run's form), for the offline plan."""
    import yaml

    value = (yaml.safe_load(path.read_text()) or {}).get("training_file")
    if not isinstance(value, str) or value.startswith("file-"):
        return None
    local = (path.parent / value).resolve()
    return str(local) if local.is_file() else None


def plan_command(spec: Path = typer.Argument(..., exists=True, dir_okay=False, help="A job YAML/JSON (create body)."),
                 gpu: str = typer.Option(None, "--gpu", help="GPU from the catalogue, e.g. a100-40gb."),
                 api_url: str = typer.Option(None, "--api-url", envvar="MEMFIT_API_URL"),
                 api_key: str = typer.Option(None, "--api-key", envvar="MEMFIT_API_KEY"),
                 as_json: bool = Json) -> None:
    """Predict a job's memory per worker without running it (the API's planner, else the local one)."""
    from service.domain.plan import Plan
    from service.views.plan_table import render

    body = load_spec(spec)
    local_data = _local_training_file(spec)
    if gpu:
        res = body.setdefault("training", {}).setdefault("resources", {})
        res["gpu_type"] = gpu
        res.setdefault("gpus_per_worker", 1)
    plan: Plan | None = None
    if api_url and (api_key or os.environ.get("MEMFIT_API_KEY")):
        with client(api_url, api_key) as http:
            r = http.post("/v1/memory/plan", json=body)
            if r.status_code not in (404, 405):
                served = r.json()
                if r.status_code >= 400:
                    _fail(ApiError(r.status_code, served))
                plan = Plan.model_validate(served)
    if plan is None:
        from service.views.plan_page import PlannerUnavailable, plan_body

        try:
            plan = plan_body(body, gpu, training_path=local_data)
        except PlannerUnavailable as exc:
            err.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
        except ValueError as exc:
            problems = getattr(exc, "problems", None)
            for p in problems or []:
                err.print(f"[red]{p.param}[/red]: {p.message}")
            if not problems:
                err.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
    if as_json:
        _print_json(plan.model_dump(mode="json"))
        return
    render(plan, console)
