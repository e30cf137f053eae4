"""The `memfit` command.

Each feature owns a typer sub-app and adds it here with one line, e.g.
``app.add_typer(scheduler_app, name="scheduler")``. Imports stay inside commands so `memfit --help`
is fast and never pulls in FastAPI, Ray or torch.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

app = typer.Typer(help="memfit: fine-tuning jobs that say where the memory went.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (one tenant per name).", no_args_is_help=True)
db_app = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, help="TCP port."),
    workers: int = typer.Option(1, help="uvicorn worker processes."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Start the API (SQLite embedded mode migrates itself; on Postgres run `memfit db upgrade` first).

    SIGTERM, SIGINT and SIGHUP stop it with everything it started: uvicorn's workers, the scheduler
    and the local Ray head with all it forked (service/scheduler/lifetime.py); a start after a SIGKILL ends what
    the killed one left."""
    import uvicorn

    from service.cli.embedded import run_dir
    from service.scheduler.lifetime import command_lifetime
    from service.settings import get_settings

    settings = get_settings()  # refuse unsafe settings before binding the port
    # Behind a proxy (an Ingress): the client address and scheme it forwards are believed from the
    # addresses MEMFIT_FORWARDED_ALLOW_IPS names only (rate limits key on the address; the cookie is Secure over https).
    proxy = {"proxy_headers": True, "forwarded_allow_ips": settings.forwarded_allow_ips}
    # uvicorn re-raises the SIGTERM it shut down for with the default handler, which would end this
    # process before any `finally` here; command_lifetime turns it into an exception we unwind with.
    with command_lifetime(run_dir(settings), "memfit serve") as own:
        if own.reaped:  # a killed serve's workers held this port: let the kernel close it
            _wait_port_free(host, port, timeout_s=15)
        if not settings.scheduler_enabled:
            uvicorn.run("api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level=log_level,
                        **proxy)
            return
        from service.cli.embedded import (  # the scheduler (+ local Ray head)
            background_scheduler,
            with_api_url,
        )

        # The API first (it answers /healthz within seconds), then the local Ray head, in the background.
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        with background_scheduler(with_api_url(settings, host, port), after_api=f"http://{reach}:{port}"):
            # The booting app answers /healthz while the real one is built (service/cli/embedded.py).
            uvicorn.run("service.cli.embedded:booting_app", factory=True, host=host, port=port, workers=workers,
                        log_level=log_level, **proxy)


def _wait_port_free(host: str, port: int, timeout_s: float) -> None:
    """Until (host, port) can be bound as uvicorn binds it (SO_REUSEADDR), or ``timeout_s``: processes just
    ended with SIGKILL may take a moment to exit on a loaded machine, and their listening socket with them.
    After the timeout uvicorn tries anyway and reports the port in use."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
        time.sleep(0.2)


def _sessions():
    from service.settings import ensure_dirs, get_settings
    from service.store import db

    settings = get_settings()
    ensure_dirs(settings)
    if settings.is_sqlite:
        db.upgrade(settings.database_url)
    return db.make_sessionmaker(db.make_engine(settings.database_url, timeouts=db.DbTimeouts.from_settings(settings)))


@keys_app.command("create")
def keys_create(tenant: str = typer.Option(..., "--tenant", help="Tenant name; created if new.")) -> None:
    """Create an API key and print it once (only its hash is stored)."""
    from service.store import auth
    from service.store.db import session_scope

    with session_scope(_sessions()) as session:
        issued = auth.create_key(session, tenant)
    err.print(f"tenant {issued.tenant_name} ({issued.tenant_id}); key prefix {issued.prefix}. "
              "Store the key now: it is not shown again.")
    print(issued.key)


@keys_app.command("revoke")
def keys_revoke(prefix: str = typer.Argument(..., help="The key's visible prefix, e.g. mf_live_Ab3dE9xQ.")) -> None:
    """Revoke a key: requests with it get 401 within a second (a running API trusts a checked key for at most 1 s)."""
    from service.domain.errors import NotFound
    from service.store import auth
    from service.store.db import session_scope

    try:
        with session_scope(_sessions()) as session:
            auth.revoke_key(session, prefix)
    except NotFound as exc:
        err.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(1) from None
    console.print(f"revoked {prefix}")


@keys_app.command("list")
def keys_list() -> None:
    """List keys by prefix (the keys themselves are never stored)."""
    from rich.table import Table

    from service.store import auth
    from service.store.db import session_scope

    table = Table("prefix", "tenant", "created", "revoked")
    with session_scope(_sessions()) as session:
        for key, tenant in auth.list_keys(session):
            table.add_row(key.prefix, tenant.name, str(key.created_at), str(key.revoked_at or ""))
    console.print(table)


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head")) -> None:
    """Apply migrations to MEMFIT_DATABASE_URL."""
    from service.settings import ensure_dirs, get_settings
    from service.store import db

    settings = get_settings()
    ensure_dirs(settings)
    db.upgrade(settings.database_url, revision)
    console.print(f"database at {revision}")


from service.cli.run import run_cli, scheduler_cli  # noqa: E402 - the scheduler's commands

app.command("run")(run_cli)
app.command("scheduler")(scheduler_cli)
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")

from service.cli.client import files_app, jobs_app, plan_command  # noqa: E402 - the API client commands

app.add_typer(jobs_app, name="jobs")
app.add_typer(files_app, name="files")
app.command("plan")(plan_command)

from service.cli.chat import chat as chat_command, models as models_command  # noqa: E402 - served models (docs/serving.md)

app.command("chat")(chat_command)
app.command("models")(models_command)


def main() -> None:
    """The entry point. A setting memfit cannot use is one line per variable on stderr and exit
    status 2, whichever command read it (each reads them through service.settings.get_settings)."""
    try:
        app()
    except Exception as exc:
        from service.settings import (
            SettingsInvalid,  # imported already if that is what was raised
        )

        if not isinstance(exc, SettingsInvalid):
            raise
        for line in exc.lines:
            print(f"memfit: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
