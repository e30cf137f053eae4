"""Inference for the API: a request for a model the tenant may call goes to that model's Serve application
(service/scheduler/serve_apps.py), deployed on first use after the serving planner admits it
(service/memory/serving.py), and its events come back as they are generated.

The per-tenant bounds are here: generations at once (MEMFIT_SERVE_CONCURRENT_PER_TENANT, this process's
count) and a request's time (MEMFIT_SERVE_REQUEST_TIMEOUT_S); the tokens-per-minute limit is charged by the
API on its rate limiter (api/limits.py), like every other rate.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from service.domain.errors import DomainError
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.presets import PRESETS, preset_name
from service.jobs.models import ServedModel
from service.memory.nodes import dashboard_address
from service.memory.serving import ServingPlan, admit, plan_serving
from service.memory.shape import UnsupportedModel, shape_for_model, shape_from_path
from service.scheduler.serve_apps import AppSpec, ServeApps, ServeOptions, ServingUnavailable
from service.settings import Settings

MULTIPLEX_HEADER = "serve_multiplexed_model_id"
MAX_PLANNED_CONTEXT = 4096  # the KV cache is planned for each sequence at the model's context, at most this


class TooManyGenerations(DomainError):
    status, code, title, openai_type, retryable = 429, "concurrency_limit_exceeded", "Too many requests", "rate_limit_error", True

    def __init__(self, limit: int):
        super().__init__(f"this tenant already has {limit} generations running (MEMFIT_SERVE_CONCURRENT_PER_TENANT); "
                         "retry when one ends", headers={"Retry-After": "1", "retry-after-ms": "500"})


class GenerationTimeout(DomainError):
    status, code, title, openai_type, retryable = 504, "timeout", "Gateway timeout", "timeout", True


class EngineError(DomainError):
    """An error event from the replica (a prompt too long for the context: 400), with its status and code."""

    def __init__(self, event: dict[str, Any]):
        super().__init__(event.get("message") or "the model failed", param=event.get("param"), code=event.get("code"))
        self.status = int(event.get("status") or 500)
        self.title = "Bad request" if self.status == 400 else "Model error"
        if self.status >= 500:
            self.openai_type, self.retryable = "server_error", True


class Inference:
    def __init__(self, settings: Settings, dashboard_url: str | None = None):
        self.settings = settings
        self.apps: ServeApps | None = None
        self.running: dict[str, int] = defaultdict(int)  # tenant → generations in flight in this process
        self._admitted: set[str] = set()
        self._proxy = httpx.AsyncClient(timeout=httpx.Timeout(settings.serve_request_timeout_s, connect=10.0))
        url = dashboard_url or settings.serve_ray_address or settings.ray_address
        if url:
            self.attach(url)

    def attach(self, dashboard_url: str) -> None:
        """Serve on the Ray cluster of this dashboard (`memfit serve` calls it once its local head is up)."""
        s = self.settings
        options = ServeOptions(engine=s.serve_engine, min_replicas=s.serve_min_replicas, max_replicas=s.serve_max_replicas,
                               replica_cpus=s.serve_replica_cpus, replica_gpus=s.serve_replica_gpus, max_batch=s.serve_max_batch,
                               max_adapters=s.serve_max_adapters, start_timeout_s=s.serve_start_timeout_s)
        self.apps = ServeApps(dashboard_url, options, py_modules=_code_packages(dashboard_url, s))

    async def close(self) -> None:
        await self._proxy.aclose()
        if self.apps is not None:
            await self.apps.close()

    # --- planning ---

    def spec_for(self, model: ServedModel) -> AppSpec:
        if model.kind == "merged":
            return AppSpec(model=model.merged_path, model_path=model.merged_path, merged_job=model.job_id)
        return AppSpec(model=model.base, model_path=model.base_path)

    def plan_for(self, model: ServedModel) -> ServingPlan | None:
        """The predicted memory of the replica that serves ``model`` (None for a shape the planner does not know)."""
        s = self.settings
        try:
            if model.kind == "merged":
                shape = shape_from_path(model.merged_path)
            else:
                shape = shape_for_model(resolve_model(model.base, s.model_dirs))
        except (UnsupportedModel, ModelRefError, OSError, ValueError):
            return None
        context = min(_positions(model) or 2048, MAX_PLANNED_CONTEXT)
        adapters = 0 if model.kind == "merged" else s.serve_max_adapters
        return plan_serving(shape, context_length=context, concurrent_sequences=s.serve_max_batch, adapters_resident=adapters)

    # --- generating ---

    @asynccontextmanager
    async def slot(self, tenant_id: str):
        limit = self.settings.serve_concurrent_per_tenant
        if limit and self.running[tenant_id] >= limit:
            raise TooManyGenerations(limit)
        self.running[tenant_id] += 1
        try:
            yield
        finally:
            self.running[tenant_id] -= 1

    async def url_for(self, model: ServedModel) -> str:
        if self.apps is None and (published := dashboard_address(self.settings)):  # `memfit serve`'s local head
            self.attach(published)
        if self.apps is None:
            raise ServingUnavailable("no Ray cluster is configured for serving (MEMFIT_SERVE_RAY_ADDRESS or MEMFIT_RAY_ADDRESS)")
        spec = self.spec_for(model)
        if spec.name not in self._admitted:
            plan = self.plan_for(model)
            if plan is not None:
                admit(plan, self.settings.serve_replica_memory_bytes)
            self._admitted.add(spec.name)
        return await self.apps.ensure(spec)

    async def events(self, model: ServedModel, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The engine's events for one request. The first is ``start`` (errors before it raise); the stream
        ends when every choice ended. Closing the iterator closes the connection: the replica stops generating."""
        url = await self.url_for(model)
        headers = {MULTIPLEX_HEADER: model.id} if model.adapter_path else {}
        deadline = time.monotonic() + self.settings.serve_request_timeout_s
        request = self._proxy.build_request("POST", url, json=body, headers=headers)
        try:
            response = await self._proxy.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(f"the model's application did not answer: {exc}") from None
        try:
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    event = json.loads(raw)
                except ValueError:
                    event = {"status": 503, "code": "serving_unavailable", "message": raw.decode(errors="replace")[:500]}
                if not isinstance(event, dict) or "event" not in event:
                    event = {"status": 503 if response.status_code >= 500 else response.status_code,
                             "code": "serving_unavailable", "message": raw.decode(errors="replace")[:500]}
                raise EngineError(event)
            lines = response.aiter_lines()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GenerationTimeout(f"the generation took longer than {self.settings.serve_request_timeout_s:g} s "
                                            "(MEMFIT_SERVE_REQUEST_TIMEOUT_S)")
                try:
                    line = await asyncio.wait_for(lines.__anext__(), timeout=left)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    continue
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("event") == "error":
                    raise EngineError(event)
                yield event
        finally:
            await response.aclose()

    async def replica_stats(self, model: ServedModel) -> dict[str, Any] | None:
        """What a running replica of the model's application measures (None when it is not running)."""
        if self.apps is None:
            return None
        spec = self.spec_for(model)
        url = self.apps._running.get(spec.name)
        if url is None:
            return None
        try:
            r = await self._proxy.get(url, timeout=10)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


def _positions(model: ServedModel) -> int | None:
    """The model's context length from its config (a preset's dict, or a folder's config.json)."""
    folder = model.merged_path if model.kind == "merged" else model.base_path
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text()) if folder else PRESETS[preset_name(model.base) or ""]
    except (OSError, ValueError, KeyError):
        return None
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    return int(value) if value else None


def _code_packages(dashboard_url: str, settings: Settings):
    """The replicas' code: the same packages the scheduler ships to jobs (None where code is not shipped)."""
    from service.scheduler.ray_jobs import RayJobs

    jobs = RayJobs(dashboard_url, auth_mode=settings.ray_auth_mode)
    return jobs.code_packages if jobs.ship_code else None
