"""The serving applications memfit runs on Ray Serve, deployed and removed through Serve's REST API on the
Ray dashboard (``PUT/GET/DELETE /api/serve/applications/``) — no ray import in the API process — and
reached through Serve's HTTP proxy.

One application per base model (its tenants' adapters multiplexed on top) and one per merged model, each
``workers.serving:app`` with its arguments (workers/serving.py). Serve's declarative config is the whole
list of applications: a deploy reads the running config, adds or replaces its own application and puts the
list back, keeping every application it did not make. The proxy's port is chosen when this client first
starts Serve on a cluster and read back from Serve after that.

:meth:`ServeApps.close` removes every application this process deployed and, when none is left, shuts Serve
down (controller and proxies): memfit leaves no Serve process behind when it stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from service.domain.errors import DomainError
from service.ports import free_port

log = logging.getLogger("memfit.serving")
APPS_PATH = "/api/serve/applications/"
APP_PREFIX = "memfit-"
PASSED_ENV = ("HF_HUB_OFFLINE", "MEMFIT_PRESET_CACHE", "HF_HOME", "TOKENIZERS_PARALLELISM")


class ServingUnavailable(DomainError):
    """Serve could not be reached or the model's application did not start: 503, retryable."""

    status, code, title, openai_type, retryable = 503, "serving_unavailable", "Service unavailable", "server_error", True

    def __init__(self, message: str):
        super().__init__(message, headers={"Retry-After": "5"})


@dataclass(frozen=True)
class AppSpec:
    """One serving application: a base model (adapters on top) or a merged model."""

    model: str  # what the replica builds: a preset, a hub id, or a local folder's path
    model_path: str | None = None
    merged_job: str | None = None  # the job whose merged folder this is (an application of its own)
    # a Tinker training client (service/scheduler/tinker.py): its id and workers/tinker_trainer.py's arguments
    trainer: str | None = None
    trainer_args: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        if self.trainer:
            return f"{APP_PREFIX}tinker-{self.trainer.lower()}"
        if self.merged_job:
            return f"{APP_PREFIX}merged-{self.merged_job.lower()}"
        return f"{APP_PREFIX}base-{hashlib.sha256((self.model + '|' + (self.model_path or '')).encode()).hexdigest()[:12]}"

    @property
    def route_prefix(self) -> str:
        return "/" + self.name


@dataclass
class ServeOptions:
    engine: str = "transformers"  # or "vllm", or "auto" (workers/serving_engine.py: make_engine)
    min_replicas: int = 0  # 0: Serve scales an idle application to zero
    max_replicas: int = 1
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_batch: int = 8
    max_adapters: int = 8
    max_context: int | None = None
    threads: int | None = None
    downscale_delay_s: float = 300.0
    start_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)


class ServeApps:
    """Deploys, finds and removes memfit's Serve applications on one Ray cluster (its dashboard's URL)."""

    def __init__(self, dashboard_url: str, options: ServeOptions | None = None, *, py_modules=None):
        self.dashboard_url = dashboard_url.rstrip("/")
        self.options = options or ServeOptions()
        self._py_modules = py_modules  # a callable giving the runtime_env's py_modules (the jobs' code packages)
        self._lock = asyncio.Lock()
        self._running: dict[str, str] = {}  # application name → its URL, once seen RUNNING
        self.deployed: set[str] = set()  # what this process put there (and takes away at close)
        self.proxy: str | None = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0))

    # --- reading ---

    async def details(self) -> dict[str, Any]:
        try:
            r = await self._http.get(self.dashboard_url + APPS_PATH)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(f"Ray Serve at {self.dashboard_url} did not answer: {exc}") from None
        if r.status_code != 200:
            raise ServingUnavailable(f"Ray Serve at {self.dashboard_url} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def url(self, spec: AppSpec) -> str:
        return f"{self.proxy}{spec.route_prefix}"

    # --- deploying ---

    async def ensure(self, spec: AppSpec) -> str:
        """The URL of ``spec``'s application, deploying it first when it is not running."""
        if spec.name in self._running:
            return self._running[spec.name]
        async with self._lock:
            if spec.name in self._running:
                return self._running[spec.name]
            details = await self.details()
            app = (details.get("applications") or {}).get(spec.name)
            self._read_proxy(details)
            if app is None or app.get("status") in ("DEPLOY_FAILED", "DELETING"):
                modules = await asyncio.to_thread(self._py_modules) if self._py_modules is not None else None
                await self._put(details, add=self._app_config(spec, modules))
                self.deployed.add(spec.name)
            url = await self._wait_running(spec)
            self._running[spec.name] = url
            return url

    async def remove(self, spec_or_name: AppSpec | str) -> None:
        """Take one application away (a deleted merged model)."""
        name = spec_or_name if isinstance(spec_or_name, str) else spec_or_name.name
        async with self._lock:
            self._running.pop(name, None)
            details = await self.details()
            self._read_proxy(details)
            if name in (details.get("applications") or {}):
                await self._put(details, drop={name})
            self.deployed.discard(name)

    async def close(self) -> None:
        """Remove every application this process deployed; shut Serve down when none is left."""
        try:
            async with self._lock:
                if not self.deployed:
                    return
                details = await self.details()
                apps = details.get("applications") or {}
                left = set(apps) - self.deployed
                self._read_proxy(details)
                if left:
                    await self._put(details, drop=set(self.deployed))
                else:
                    await self._http.delete(self.dashboard_url + APPS_PATH, timeout=120)
                self.deployed.clear()
                self._running.clear()
        except (ServingUnavailable, httpx.HTTPError) as exc:
            log.warning("could not remove memfit's Serve applications at %s: %s", self.dashboard_url, exc)
        finally:
            await self._http.aclose()

    def _read_proxy(self, details: dict[str, Any]) -> None:
        http = details.get("http_options") or {}
        running = bool(details.get("applications")) or bool((details.get("controller_info") or {}).get("node_id"))
        if running and http.get("port"):
            host = http.get("host") or "127.0.0.1"
            if host in ("0.0.0.0", "::"):
                host = urlparse(self.dashboard_url).hostname or "127.0.0.1"
            self.proxy = f"http://{host}:{http['port']}"
            self._http_options = {"host": http.get("host"), "port": http["port"]}
        elif self.proxy is None:
            host = urlparse(self.dashboard_url).hostname or "127.0.0.1"
            port = free_port()
            self.proxy = f"http://{host}:{port}"
            self._http_options = {"host": host, "port": port}

    def _app_config(self, spec: AppSpec, py_modules: list[str] | None = None) -> dict[str, Any]:
        o = self.options
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update({"MEMFIT_SERVE_MAX_ADAPTERS": str(o.max_adapters), **o.env})
        runtime_env: dict[str, Any] = {"env_vars": env}
        if py_modules:
            runtime_env["py_modules"] = py_modules
        if spec.trainer:  # one replica, never scaled: it holds the client's LoRA and optimizer state
            return {"name": spec.name, "route_prefix": spec.route_prefix, "import_path": "workers.tinker_trainer:app",
                    "args": {**(spec.trainer_args or {}), "threads": o.threads}, "runtime_env": runtime_env,
                    "deployments": [{"name": "TinkerTrainer", "num_replicas": 1,
                                     "ray_actor_options": {"num_cpus": o.replica_cpus, "num_gpus": o.replica_gpus}}]}
        return {
            "name": spec.name,
            "route_prefix": spec.route_prefix,
            "import_path": "workers.serving:app",
            "args": {"model": spec.model, "model_path": spec.model_path, "engine": o.engine, "max_batch": o.max_batch,
                     "max_context": o.max_context, "threads": o.threads},
            "runtime_env": runtime_env,
            "deployments": [{
                "name": "ModelServer",
                "autoscaling_config": {"min_replicas": o.min_replicas, "initial_replicas": max(1, o.min_replicas),
                                       "max_replicas": max(1, o.max_replicas), "target_ongoing_requests": max(1, o.max_batch),
                                       "downscale_delay_s": o.downscale_delay_s, "upscale_delay_s": 1.0},
                "ray_actor_options": {"num_cpus": o.replica_cpus, "num_gpus": o.replica_gpus},
            }],
        }

    async def _put(self, details: dict[str, Any], *, add: dict | None = None, drop: set[str] = frozenset()) -> None:
        apps = []
        for name, app in (details.get("applications") or {}).items():
            if name in drop or (add is not None and name == add["name"]):
                continue
            config = app.get("deployed_app_config")
            if config:
                apps.append(config)
        if add is not None:
            apps.append(add)
        body = {"proxy_location": "HeadOnly", "http_options": self._http_options, "applications": apps}
        try:
            r = await self._http.put(self.dashboard_url + APPS_PATH, json=body, timeout=120)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(f"Ray Serve at {self.dashboard_url} did not take the config: {exc}") from None
        if r.status_code != 200:
            raise ServingUnavailable(f"Ray Serve refused the config ({r.status_code}): {r.text[:500]}")

    async def _wait_running(self, spec: AppSpec) -> str:
        deadline = time.monotonic() + self.options.start_timeout_s
        status, message = "NOT_STARTED", ""
        while time.monotonic() < deadline:
            details = await self.details()
            app = (details.get("applications") or {}).get(spec.name) or {}
            status, message = app.get("status", "NOT_STARTED"), app.get("message") or ""
            if status == "RUNNING":
                self._read_proxy(details)
                return self.url(spec)
            if status == "DEPLOY_FAILED":
                raise ServingUnavailable(f"the serving application of {spec.model} failed to start: {message[-800:]}")
            await asyncio.sleep(0.5)
        raise ServingUnavailable(f"the serving application of {spec.model} was not running after "
                                 f"{self.options.start_timeout_s:.0f} s ({status}: {message[-300:]})")
