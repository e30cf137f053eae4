"""Every process a memfit command starts ends when the command ends, and a SIGKILLed command's are
ended by the next start.

How a process is known to be ours, never by name (other engineers' and other memfits' Ray clusters
run on the same host):

- a random *token* is put in ``MEMFIT_OWNER`` (a comma-separated chain, so nesting works) before
  anything is started; every child inherits it — the local Ray head and all it forks, Ray workers,
  job drivers that Ray puts in sessions of their own, Ray Train workers, uvicorn worker processes;
- the local Ray head is started as a session leader (``start_new_session``), so its session is ours
  too — this covers Ray processes whose environment reads back clobbered (``setproctitle``);
- a process whose command line names the head's temp dir (a fresh ``mkdtemp``), and every
  descendant of one of the above.

Only processes created after the token are considered. A record of each token (owner pid and start
time, host and boot, the head's session and temp dir) is kept as ``<storage>/run/<token>.json`` while
it lives: the owner deletes it after ending its processes; the next command that finds a record whose
owner is gone ends what the record proves was started and deletes it.

Signals: Python dies silently on SIGTERM and SIGHUP (no ``finally`` runs) and uvicorn, after its
graceful shutdown, re-raises the SIGTERM it caught with the default handler. ``command_lifetime``
turns SIGTERM, SIGINT and SIGHUP into a ``Stopped`` exception in the main thread, ends everything,
and then dies by the same signal, as a well-behaved service does.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import psutil

log = logging.getLogger("memfit.lifetime")

OWNER_ENV = "MEMFIT_OWNER"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# psutil's create_time has jiffy resolution and is derived from the boot time: allow for rounding.
_CLOCK_SLACK_S = 1.0


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGINT or SIGHUP arrived: unwind so that every ``finally`` runs. A KeyboardInterrupt,
    so code that already handles Ctrl-C (cancel the job, say so) handles SIGTERM the same way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return str(psutil.boot_time())


def process_started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def chained(base: str | None, token: str) -> str:
    """MEMFIT_OWNER for children: the tokens of every memfit above us, then ours."""
    return ",".join([t for t in (base or "").split(",") if t] + [token])


@dataclass
class Ownership:
    """One token, the processes that carry it, and (for a Ray head) the session and temp dir."""

    label: str
    token: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(8)}")
    created_at: float = field(default_factory=time.time)
    owner_pid: int = field(default_factory=os.getpid)
    owner_started: float | None = field(default_factory=lambda: process_started(os.getpid()))
    host: str = field(default_factory=socket.gethostname)
    boot_id: str = field(default_factory=_boot_id)
    session_pid: int | None = None
    session_started: float | None = None
    temp_dir: str | None = None
    path: Path | None = None  # where the record lives; None keeps it in memory only

    # --- the record ---------------------------------------------------------------------------

    def save(self) -> "Ownership":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {k: v for k, v in asdict(self).items() if k != "path"}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.path)  # a reader sees the old record or the new one, never half
        return self

    @classmethod
    def load(cls, path: Path) -> "Ownership | None":
        try:
            body = json.loads(path.read_text())
            return cls(**{k: v for k, v in body.items() if k in cls.__dataclass_fields__}, path=path)
        except (OSError, ValueError, TypeError):
            return None

    def in_record(self, run_dir: Path | None) -> "Ownership":
        self.path = run_dir / f"{self.token}.json" if run_dir else None
        return self.save()

    def env_chain(self) -> str:
        return chained(os.environ.get(OWNER_ENV), self.token)

    def owner_alive(self) -> bool:
        """The owner still runs: same pid, same start time (pids are reused), not a zombie."""
        try:
            owner = psutil.Process(self.owner_pid)
            if owner.status() == psutil.STATUS_ZOMBIE:
                return False
            started = owner.create_time()
        except psutil.Error:
            return False
        return self.owner_started is None or abs(started - self.owner_started) <= _CLOCK_SLACK_S

    # --- which processes are ours --------------------------------------------------------------

    def _session_is_ours(self) -> bool:
        """Linux never hands out a pid that is still some live process's session id, so while members
        live the number is ours — unless its leader is alive and is not the process we started."""
        if self.session_pid is None:
            return False
        started = process_started(self.session_pid)
        return started is None or self.session_started is None or abs(started - self.session_started) <= _CLOCK_SLACK_S

    def _carries(self, proc: psutil.Process, session_ours: bool) -> bool:
        if proc.create_time() < self.created_at - _CLOCK_SLACK_S:
            return False  # older than the token: cannot be ours
        if session_ours and os.getsid(proc.pid) == self.session_pid:
            return True
        if self.temp_dir and any(f"{self.temp_dir}/" in f"{arg}/" for arg in proc.cmdline()):
            return True
        try:
            return self.token in proc.environ().get(OWNER_ENV, "").split(",")
        except psutil.AccessDenied:
            return False

    def processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes this record proves were started under it, ourselves excepted."""
        session_ours = self._session_is_ours()
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and self._carries(proc, session_ours):
                    found[proc.pid] = proc
            except (psutil.Error, OSError):
                continue
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.Error:
                continue
        alive = []
        for proc in found.values():
            try:
                if proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        return alive

    # --- ending them ---------------------------------------------------------------------------

    def end(self, timeout_s: float = 20.0) -> list[str]:
        """SIGKILL every process this record proves is ours until none is left, remove the temp dir
        and the record. Returns what was killed (``pid name``). Keeps the record if some survive."""
        killed: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            procs = self.processes()
            if not procs:
                break
            for proc in procs:
                try:
                    killed.setdefault(proc.pid, f"{proc.pid} {proc.name()}")
                    proc.kill()
                except psutil.Error:
                    continue
            _wait_gone(procs, min(2.0, max(0.1, deadline - time.monotonic())))
            if time.monotonic() > deadline:
                left = [p.pid for p in self.processes()]
                if left:
                    log.error("%s: processes %s survived SIGKILL; record %s kept", self.label, left, self.path)
                    return list(killed.values())
                break
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        return list(killed.values())


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    """Until each is gone or a zombie (a zombie holds no memory, port or CPU; init reaps it)."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        still = []
        for proc in pending:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    still.append(proc)
            except psutil.Error:
                continue
        pending = still
        if pending:
            time.sleep(0.05)


def records(run_dir: Path) -> list[Ownership]:
    """The records in run_dir, Ray heads first: a head's session also covers processes whose
    environment reads back clobbered, so it is best ended before the command that started it."""
    if not run_dir.is_dir():
        return []
    found = [r for r in (Ownership.load(p) for p in sorted(run_dir.glob("*.json"))) if r is not None]
    return sorted(found, key=lambda r: r.session_pid is None)


def reap_stale(run_dir: Path) -> list[str]:
    """End what memfit commands that died without cleaning up (SIGKILL, OOM killer, power loss)
    left behind, as their records prove. Records of live owners and of other hosts are left alone."""
    killed: list[str] = []
    for rec in records(run_dir):
        if rec.host != socket.gethostname():
            continue  # a storage dir shared with another machine: its processes are not ours to end
        if rec.boot_id != _boot_id():
            rec.path.unlink(missing_ok=True)  # the machine rebooted since: nothing of it runs
            continue
        if rec.owner_alive():
            continue
        ended = rec.end()
        if ended:
            log.warning("ended %d processes left by %s (pid %d, gone): %s", len(ended), rec.label,
                        rec.owner_pid, ", ".join(ended))
        killed += ended
    return killed


def end_owned_by_me(run_dir: Path | None, *also: Ownership) -> None:
    """End every record in run_dir whose owner is this process (ours and any Ray head's), and ``also``."""
    mine = {o.token: o for o in also}
    if run_dir is not None:
        me = process_started(os.getpid())
        for rec in records(run_dir):
            if rec.owner_pid == os.getpid() and (rec.owner_started is None or me is None
                                                  or abs(rec.owner_started - me) <= _CLOCK_SLACK_S):
                mine.setdefault(rec.token, rec)
    for rec in sorted(mine.values(), key=lambda r: r.session_pid is None):
        rec.end()


# --- signals ---------------------------------------------------------------------------------------


class _StopSignals:
    """While active in the main thread: the first SIGTERM/SIGINT/SIGHUP raises Stopped; any signal
    after that, or while cleaning up, is ignored so that the cleanup itself is never cut short."""

    def __init__(self) -> None:
        self.stopping = False
        self.received: int | None = None  # the signal that stopped us, even if someone swallowed Stopped
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.stopping:
            # Not now: the cleanup must not be cut short. We still end by this signal once it is done.
            log.warning("%s while stopping: ending what memfit started first", signal.Signals(signum).name)
            self.received = self.received or signum
            return
        self.stopping = True
        self.received = signum
        raise Stopped(signum)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def die_by(signum: int) -> None:
    """Exit the way the signal would have ended us (a shell sees 128+n, systemd a clean stop)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(5)  # pragma: no cover - the signal ends us first
    os._exit(128 + signum)


@contextmanager
def command_lifetime(run_dir: Path | None, label: str) -> Iterator[Ownership]:
    """Around a memfit command's body: end what earlier, SIGKILLed commands left; record a token that
    every child inherits; on the way out — normal return, exception, SIGTERM/SIGINT/SIGHUP — end
    every process carrying it (and each Ray head this process recorded), then delete the record."""
    reaped = reap_stale(run_dir) if run_dir is not None else []
    own = Ownership(label=label).in_record(run_dir)
    own.reaped = reaped  # what an earlier, killed command left and this one ended (serve waits for its port)
    previous_env = os.environ.get(OWNER_ENV)
    os.environ[OWNER_ENV] = own.env_chain()
    signals = _StopSignals()
    signals.install()
    try:
        yield own
    except Stopped:
        pass  # ended below, by the same signal
    finally:
        signals.stopping = True
        try:
            end_owned_by_me(run_dir, own)
        finally:
            if previous_env is None:
                os.environ.pop(OWNER_ENV, None)
            else:
                os.environ[OWNER_ENV] = previous_env
            signals.restore()
    # uvicorn.run swallows KeyboardInterrupt (so Stopped) and returns: the signal is remembered here.
    if signals.received is not None:
        die_by(signals.received)
