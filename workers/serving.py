"""The Ray Serve side of serving: one application per base model, the tenants' adapters multiplexed on top.

The API deploys these through Ray Serve's REST API (service/scheduler/serve_apps.py: ``import_path``
``workers.serving:app``, the arguments below) and reaches them through Serve's HTTP proxy at the
application's route prefix, the adapter in the ``serve_multiplexed_model_id`` header:

- ``POST <prefix>`` with an engine request (service/domain/serving.py ``engine_request``): newline-delimited
  JSON events (workers/serving_engine.py) as they are generated; a request the engine refuses is one
  ``error`` event with its status;
- ``GET <prefix>``: the replica's engine, adapters resident, batches run, and its memory (RSS and the weights'
  bytes): what the model page shows against the plan (service/memory/serving.py).

Adapters are Serve's multiplexed models: :meth:`ModelServer.adapter` loads one on first request (into the
engine, under a name of its own), Serve keeps at most ``MEMFIT_SERVE_MAX_ADAPTERS`` per replica and evicts
the least recently used (calling its ``__del__``, which removes it from the engine), and routes a request
to a replica that holds its adapter already. An adapter whose folder is gone (its model was deleted) is
dropped from the engine at the next request's sweep. Merged (full) models are applications of their own,
with no adapters. Replicas scale from ``min_replicas`` (0: scale to zero when idle) by Serve's autoscaling.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from workers.serving_engine import RequestRejected, make_engine

MAX_ADAPTERS = int(os.environ.get("MEMFIT_SERVE_MAX_ADAPTERS", "8"))


def adapter_name(model_id: str) -> str:
    """A name peft accepts (no dots, no colons) for the adapter of one model id."""
    return "a" + hashlib.sha256(model_id.encode()).hexdigest()[:16]


def adapter_folder(path: str, config_from: str | None, cache: Path) -> str:
    """A folder peft loads for ``path``: itself when it holds an adapter, else a DDP checkpoint's adapter state
    (``state.pt``'s trainable parameters, peft's in-memory names) written in peft's format beside the config
    of the job's final adapter (``config_from``), once, under ``cache``."""
    if (Path(path) / "adapter_config.json").is_file():
        return path
    state_file = Path(path) / "state.pt"
    if not state_file.is_file() or not config_from or not (Path(config_from) / "adapter_config.json").is_file():
        raise RequestRejected(422, "model_not_servable", f"the checkpoint at {Path(path).name} holds no adapter this "
                              "server can load (a DDP checkpoint's state.pt and the job's adapter config are needed)")
    out = cache / hashlib.sha256(path.encode()).hexdigest()[:16]
    if not (out / "adapter_model.safetensors").is_file():
        from safetensors.torch import save_file

        from workers.checkpoint import safe_load

        state = safe_load(state_file)["model"]
        tensors = {k.replace(".default.", "."): v.contiguous() for k, v in state.items() if "lora_" in k}
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text((Path(config_from) / "adapter_config.json").read_text())
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return str(out)


class LoadedAdapter:
    """What Serve's multiplexed cache holds for one adapter; evicted, it leaves the engine."""

    def __init__(self, engine, name: str, path: str):
        self.engine, self.name, self.path = engine, name, path

    def __del__(self):
        try:
            self.engine.unload_adapter(self.name)
        except Exception:  # noqa: BLE001 - the engine may be gone with the replica
            pass


@serve.deployment(max_ongoing_requests=64, health_check_period_s=5)
class ModelServer:
    def __init__(self, model: str, model_path: str | None = None, engine: str = "transformers", max_batch: int = 8,
                 max_context: int | None = None, dtype: str = "float32", threads: int | None = None):
        from workers.models import resolve_model_dir

        model_dir = model_path if model_path and Path(model_path).is_dir() else resolve_model_dir(model, model_path)
        self.model = model
        self.engine = make_engine(engine, model_dir, max_batch=max_batch, max_context=max_context, dtype=dtype,
                                  threads=threads, max_adapters=MAX_ADAPTERS)
        self.paths: dict[str, tuple[str, str | None]] = {}  # multiplexed model id → (its folder, the config's folder)
        self.cache = Path(tempfile.mkdtemp(prefix="memfit-adapters-"))  # checkpoints converted to peft's format

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS)
    async def adapter(self, model_id: str) -> LoadedAdapter:
        path, config_from = self.paths[model_id]
        name = adapter_name(model_id)
        folder = await asyncio.to_thread(adapter_folder, path, config_from, self.cache)
        await asyncio.to_thread(self.engine.load_adapter, name, folder)
        return LoadedAdapter(self.engine, name, path)

    def _sweep(self) -> None:
        """Adapters whose folders are gone (their models deleted) leave the engine now, not at eviction."""
        for model_id, (path, _) in list(self.paths.items()):
            if not Path(path).is_dir():
                self.engine.unload_adapter(adapter_name(model_id))
                self.paths.pop(model_id, None)

    async def __call__(self, request: Request):
        if request.method == "GET":
            return JSONResponse(self.stats())
        body = await request.json()
        self._sweep()
        model_id = serve.get_multiplexed_model_id()
        adapter = None
        if model_id:
            path = body.get("adapter_path")
            if not path or not Path(path).is_dir():
                return JSONResponse(RequestRejected(404, "model_not_found", f"the adapter of {model_id!r} is gone").event(),
                                    status_code=404)
            self.paths[model_id] = (path, body.get("adapter_config_from"))
            try:
                adapter = (await self.adapter(model_id)).name
            except RequestRejected as exc:
                return JSONResponse(exc.event(), status_code=exc.status)
        if hasattr(self.engine, "generate"):  # vLLM: its own async generator
            return StreamingResponse(self._lines(self.engine.generate(body, adapter)), media_type="application/x-ndjson")
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: dict) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            seqs = await asyncio.to_thread(self.engine.submit, body, adapter, sink)
        except RequestRejected as exc:
            return JSONResponse(exc.event(), status_code=exc.status)
        return StreamingResponse(self._drain(events, seqs), media_type="application/x-ndjson")

    @staticmethod
    async def _drain(events: asyncio.Queue, seqs):
        """The events of one request until every choice ended; a client that goes away (Serve cancels the
        request) cancels its choices, which the engine then drops at its next step."""
        open_ = len(seqs)
        try:
            while open_:
                event = await events.get()
                if event["event"] in ("end", "error"):
                    open_ -= 1 if event["event"] == "end" else open_
                yield json.dumps(event) + "\n"
        finally:
            for s in seqs:
                s.cancelled = True

    @staticmethod
    async def _lines(gen):
        try:
            async for event in gen:
                yield json.dumps(event) + "\n"
        except RequestRejected as exc:
            yield json.dumps(exc.event()) + "\n"

    def stats(self) -> dict[str, Any]:
        import psutil

        return {**self.engine.stats(), "model": self.model, "rss_bytes": psutil.Process().memory_info().rss,
                "pid": os.getpid()}


def app(args: dict[str, Any]):
    """The application builder Serve's config names (``workers.serving:app``), with its ``args``."""
    return ModelServer.bind(model=args["model"], model_path=args.get("model_path"), engine=args.get("engine", "transformers"),
                            max_batch=int(args.get("max_batch", 8)), max_context=args.get("max_context"),
                            dtype=args.get("dtype", "float32"), threads=args.get("threads"))
