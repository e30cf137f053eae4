"""The Ray Jobs API client the scheduler submits, polls and stops attempts through (retrying transient
failures, refusing none silently)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("memfit.scheduler")

RAY_ACTIVE = frozenset({"PENDING", "RUNNING"})
RAY_TERMINAL = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
CODE_EXCLUDES = ["__pycache__", "*.pyc"]


# --- the Ray side -------------------------------------------------------------------------------


@dataclass
class RayStatus:
    status: str  # PENDING | RUNNING | STOPPED | SUCCEEDED | FAILED
    message: str | None = None
    error_type: str | None = None
    driver_exit_code: int | None = None


LOG_READ_MAX_BYTES = 4 << 20  # per poll: a chatty driver is caught up with over several polls


@dataclass
class LogCursor:
    """How far one driver log has been read: a byte offset in its file, or a character offset in
    the Jobs API's copy, and the line still being written at that point."""

    offset: int = 0
    partial: str = ""
    from_file: bool = False

    def feed(self, text: str) -> list[str]:
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        return lines


class RayUnavailable(RuntimeError):
    """The Jobs API did not answer (head down or restarting): try again next tick, change nothing."""


class RayJobs:
    """A thin client of the Ray Jobs API (``ray[default]``); ray is imported only when used."""

    def __init__(
        self,
        address: str,
        *,
        auth_mode: str = "disabled",
        python: str | None = None,
        ship_code: bool | None = None,
        entrypoint_num_cpus: float = 0.1,
        driver_log_dir: Path | None = None,
    ) -> None:
        if "://" not in address:
            address = "http://" + address
        self.address = address.rstrip("/")
        self.auth_mode = auth_mode
        host = urlparse(self.address).hostname or ""
        loopback = host in ("127.0.0.1", "localhost", "::1") or host == socket.gethostname()
        self.python = python or os.environ.get("MEMFIT_RAY_PYTHON") or (sys.executable if loopback else "python")
        if ship_code is None:
            ship_code = os.environ.get("MEMFIT_RAY_SHIP_CODE", "1") not in ("0", "false", "no")
        self.ship_code = ship_code
        self.entrypoint_num_cpus = entrypoint_num_cpus
        # The head's log folder when it is on this host (a LocalRayHead): job driver logs are then
        # read from their files by offset instead of downloaded whole through the Jobs API.
        self.driver_log_dir = driver_log_dir
        self._client = None
        self._lock = threading.Lock()
        # The Jobs API client has no request timeout: each call — connecting included (the client
        # asks the head for its version when it is made) — runs in a small pool and is given up
        # after call_timeout_s (the loop must not hang on a stuck head; a late answer is harmless —
        # submissions are create-once by id and every other call is a read or an idempotent stop).
        # The scheduler lowers it to half its lease.
        self.call_timeout_s = float(os.environ.get("MEMFIT_RAY_CALL_TIMEOUT_S", "60"))
        self._pool = None
        self._pool_lock = threading.Lock()
        self._packages: list[str] | None = None
        self._packages_lock = threading.Lock()

    def _call(self, fn, *args, **kwargs):
        import concurrent.futures

        with self._pool_lock:  # not self._lock: a pool thread may hold that, stuck connecting
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="memfit-ray")
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.call_timeout_s)
        except concurrent.futures.TimeoutError:
            raise RayUnavailable(f"the Ray Jobs API at {self.address} did not answer within "
                                 f"{self.call_timeout_s:.0f} s") from None

    @property
    def client(self):
        with self._lock:
            if self._client is None:
                os.environ.setdefault("RAY_AUTH_MODE", self.auth_mode)
                try:
                    self._client = _client_for(self.address)
                except Exception as exc:  # noqa: BLE001 - connection refused, timeouts …
                    raise RayUnavailable(f"Ray Jobs API at {self.address}: {exc}") from exc
            return self._client

    def runtime_env(self, env_vars: dict[str, str]) -> dict[str, Any]:
        env: dict[str, Any] = {"env_vars": env_vars}
        if self.ship_code:
            env["py_modules"] = self.code_packages()
        return env

    def code_packages(self) -> list[str]:
        """The ``gcs://_ray_pkg_<hash>.zip`` URIs of ``service/`` and ``workers/``, uploaded only when
        the cluster lacks them. Left to the Jobs client, each submission zips and hashes both folders
        again; here that is done once per scheduler process (its code does not change under it), and
        a submission costs one existence check per package — which also re-uploads a package a
        restarted head (without GCS fault tolerance) lost."""
        # Not self._lock: a pool thread stuck connecting to a silent head may hold that one.
        with self._packages_lock:
            if self._packages is None:
                self._packages = [_package_uri(p) for p in _code_dirs()]
            packages = list(self._packages)
        for uri, path in zip(packages, _code_dirs()):
            self._ensure_package(uri, path)
        return packages

    def _ensure_package(self, uri: str, path: Path) -> None:
        client = self.client
        if client._package_exists(uri):  # the Jobs SDK's own check (GET /api/packages/gcs/<name>)
            return
        log.info("uploading %s as %s", path, uri)
        client._upload_package(uri, str(path), include_gitignore=_include_gitignore(), include_parent_dir=True,
                               excludes=CODE_EXCLUDES)

    def submit(self, sid: str, entrypoint: str, env_vars: dict[str, str], metadata: dict[str, str]) -> bool:
        """Submit once. Returns True when this call created it, False when it already existed."""
        try:
            # The runtime_env too is made in the pool: its package check is a call to the head as well.
            self._call(
                lambda **kw: self.client.submit_job(runtime_env=self.runtime_env(env_vars), **kw),
                entrypoint=entrypoint,
                submission_id=sid,
                entrypoint_num_cpus=self.entrypoint_num_cpus,
                metadata=metadata,
            )
            return True
        except RuntimeError as exc:
            if isinstance(exc, RayUnavailable):
                raise
            if "already exists" in str(exc):
                return False
            if _is_transient(exc):
                raise RayUnavailable(str(exc)) from exc
            raise
        except OSError as exc:
            raise RayUnavailable(str(exc)) from exc

    def status(self, sid: str) -> RayStatus | None:
        """Ray's view of one submission; None when Ray does not know it (never submitted, or lost)."""
        try:
            info = self._call(lambda: self.client.get_job_info(sid))
        except RuntimeError as exc:
            if isinstance(exc, RayUnavailable):
                raise
            if "does not exist" in str(exc) or "status code 404" in str(exc):
                return None
            raise RayUnavailable(str(exc)) from exc
        except OSError as exc:
            raise RayUnavailable(str(exc)) from exc
        return RayStatus(
            status=str(getattr(info.status, "value", info.status)),
            message=info.message,
            error_type=info.error_type,
            driver_exit_code=info.driver_exit_code,
        )

    def stop(self, sid: str) -> bool:
        try:
            return bool(self._call(lambda: self.client.stop_job(sid)))
        except RuntimeError as exc:
            if isinstance(exc, RayUnavailable):
                raise
            if "does not exist" in str(exc):
                return False
            raise RayUnavailable(str(exc)) from exc
        except OSError as exc:
            raise RayUnavailable(str(exc)) from exc

    def new_log_lines(self, sid: str, cursor: LogCursor) -> list[str]:
        """The complete lines the driver log of ``sid`` gained since ``cursor`` (which moves on).
        From the file where this host has it (only the new bytes are read); otherwise from the Jobs
        API, which has no offset parameter: the log is downloaded whole and only its new part
        scanned (the caller polls that less often). Best effort: [] when Ray does not answer."""
        path = self.driver_log_dir / f"job-driver-{sid}.log" if self.driver_log_dir is not None else None
        if cursor.from_file or (cursor.offset == 0 and path is not None and path.is_file()):
            try:
                with open(path, "rb") as f:
                    f.seek(cursor.offset)
                    data = f.read(LOG_READ_MAX_BYTES)
            except OSError:
                return []
            cursor.from_file = True
            cursor.offset += len(data)
            return cursor.feed(data.decode("utf-8", errors="replace"))
        try:
            text = self._call(lambda: self.client.get_job_logs(sid))
        except Exception:  # noqa: BLE001 - logs are best effort
            return []
        if len(text) < cursor.offset:  # not the log we read before
            cursor.offset, cursor.partial = 0, ""
        new, cursor.offset = text[cursor.offset:], len(text)
        return cursor.feed(new)

    def log_tail(self, sid: str, lines: int = 30) -> list[str]:
        try:
            text = self._call(lambda: self.client.get_job_logs(sid))
        except Exception:  # noqa: BLE001 - logs are best effort
            return []
        return text.splitlines()[-lines:]

    def submissions_of(self, job_id: str) -> dict[str, str]:
        """Every Ray submission of one memfit job (for checks: no duplicates) → status."""
        prefix = f"memfit-{job_id}-"
        return {
            j.submission_id: str(getattr(j.status, "value", j.status))
            for j in self.client.list_jobs()
            if (j.submission_id or "").startswith(prefix)
        }


# Ray's SDK lets RAY_API_SERVER_ADDRESS or RAY_ADDRESS in the environment override the address a
# JobSubmissionClient is given ("always overridden", ray.dashboard.utils): a scheduler running where
# either is set — a Ray pod, a shell that ran `ray start` — would silently talk to that cluster
# instead of MEMFIT_RAY_ADDRESS. memfit's address is already the Jobs API's URL (RayJobs adds the
# scheme), which is all that lookup returns without the environment; so the SDK's lookup is wrapped,
# once, to answer a client memfit makes with its own URL (per thread: another thread's client is
# resolved as Ray would). The environment is left alone: hiding the variables while a client was made
# (as memfit did) raced with anything else setting or clearing them and could put a cleared value
# back for good, and held a lock for as long as a hung head took to answer.
_made_by_memfit = threading.local()
_wrap_lock = threading.Lock()


def _client_for(address: str):
    from ray.dashboard.modules.job import sdk

    with _wrap_lock:
        if not getattr(sdk.get_address_for_submission_client, "memfit", False):
            ray_lookup = sdk.get_address_for_submission_client

            def lookup(given):
                return getattr(_made_by_memfit, "url", None) or ray_lookup(given)

            lookup.memfit = True
            sdk.get_address_for_submission_client = lookup
    _made_by_memfit.url = address
    try:
        return sdk.JobSubmissionClient(address)
    finally:
        _made_by_memfit.url = None


def _code_dirs() -> list[Path]:
    import service
    import workers

    return [Path(service.__file__).parent, Path(workers.__file__).parent]


def _include_gitignore() -> bool:
    # As the Jobs SDK decides it (ray.dashboard.modules.dashboard_sdk), so the hash is the one it would compute.
    return os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"


def _package_uri(path: Path) -> str:
    """The content-addressed URI Ray gives a py_modules folder (a hash of every file it would zip)."""
    # ray.job_submission first, the order the client's own import takes: another thread importing
    # it meanwhile then makes this one wait, instead of finding packaging half-initialized.
    import ray.job_submission  # noqa: F401
    from ray._private.runtime_env.packaging import get_uri_for_directory

    return get_uri_for_directory(str(path), _include_gitignore(), excludes=CODE_EXCLUDES)


def _is_transient(exc: Exception) -> bool:
    """Worth retrying: the head is down or busy (e.g. "No available agent to submit job, please try
    again later" while its job agent starts), as opposed to a refusal of this submission."""
    text = str(exc).lower()
    return any(s in text for s in ("connection refused", "failed to connect", "cannot connect", "timed out",
                                   "try again later", "no available agent", "status code 502",
                                   "status code 503", "status code 504"))


