"""Tinker's training API on memfit's cluster (api/routes/tinker.py; docs/tinker.md): sessions, LoRA training
clients, sampling sessions and the futures the SDK polls, for one API process.

- A **training client** is a Serve application of one replica (workers/tinker_trainer.py), deployed through
  the API's :class:`ServeApps` like the serving applications, so the API imports no Ray. Its memory is planned
  by the training planner as a LoRA job on its base with the request's micro-batch (``plan``), and refused
  when it does not fit the replica's memory (MEMFIT_SERVE_REPLICA_MEMORY_BYTES), before anything is deployed.
- Every request to a client is a **future**: queued behind the client's previous request (the SDK submits
  in its order and expects them applied in that order), run against the replica, and kept for
  ``FUTURE_TTL_S`` for ``retrieve_future`` to collect. ``retrieve_future`` waits up to ``POLL_S`` for it.
- **Checkpoints** go to ``<storage>/tinker/<tenant>/<model id>/{weights,sampler_weights}/<name>/``, the adapter
  in peft's format (service/jobs/models.py lists them as the tenant's models) with a ``meta.json`` of the
  client beside them.
- **Sampling** runs on the replica of the training client that saved the weights while it lives, else on a
  sampler replica of the base (one per base, deployed on first use).

What lives here is the process's memory: a restarted API forgets its sessions, clients and futures (their
replicas are removed with the API's Serve applications), but not the checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from service.domain import tinker as t
from service.domain.errors import DomainError
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.presets import PRESET_PREFIX, PRESETS
from service.domain.tinker_wire import ForwardBackwardRequest
from service.domain.units import gib
from service.jobs.tinker_checkpoints import checkpoint_folder, read_meta, storage_root
from service.memory.nodes import dashboard_address
from service.memory.shape import ModelShape, UnsupportedModel, shape_for_model
from service.scheduler.serve_apps import AppSpec, ServingUnavailable
from service.settings import Settings

FUTURE_TTL_S = 900.0
SESSION_TTL_S = 300.0  # a session with no heartbeat for this long ended with its SDK process: its replicas go
POLL_S = 20.0
SAMPLER_RANK = 1  # a sampler replica's own LoRA: never trained, only there so that saved adapters load beside it
DEFAULT_PLAN_TOKENS = 512


@dataclass
class Session:
    id: str
    tenant_id: str
    heartbeat: float = field(default_factory=time.time)


@dataclass
class Client:
    id: str
    tenant_id: str
    session_id: str
    base_model: str
    base_path: str | None
    shape: ModelShape
    rank: int
    targets: list[str]
    seed: int | None
    plan: dict[str, Any]
    spec: AppSpec
    url: str | None = None
    tail: asyncio.Future | None = None  # the last request queued: the next one runs after it
    steps: int = 0
    saves: int = 0

    def info(self) -> dict[str, Any]:
        return {"type": "get_info", "model_id": self.id, "is_lora": True, "lora_rank": self.rank, "model_name": self.base_model,
                "model_data": {"arch": self.shape.family, "model_name": self.base_model, "tokenizer_id": None}}


@dataclass
class Sampler:
    id: str
    tenant_id: str
    base_model: str
    model_path: str | None
    folder: str | None


@dataclass
class Future:
    id: str
    tenant_id: str
    kind: str  # what the result is: forward_backward, sample, or a JSON object
    task: asyncio.Future
    done_at: float | None = None


class Tinker:
    def __init__(self, settings: Settings, inference):
        self.settings = settings
        self.inference = inference  # its ServeApps deploys the replicas (and removes them when the API stops)
        self.sessions: dict[str, Session] = {}
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Future] = {}
        self.hosts: dict[str, Client] = {}  # base model → its sampler replica
        self._plans: dict[tuple, dict[str, Any]] = {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(max(600.0, settings.serve_request_timeout_s), connect=10.0))

    async def close(self) -> None:
        for f in self.futures.values():
            f.task.cancel()
        await self._http.aclose()

    # --- sessions ---

    def create_session(self, tenant_id: str) -> str:
        self.reap()
        sid = "ts-" + secrets.token_hex(10)
        self.sessions[sid] = Session(sid, tenant_id)
        return sid

    def session(self, tenant_id: str, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.tenant_id != tenant_id:
            raise t.TinkerNotFound(f"session {session_id!r} does not exist", param="session_id")
        return s

    def heartbeat(self, tenant_id: str, session_id: str) -> None:
        self.session(tenant_id, session_id).heartbeat = time.time()

    def reap(self, now: float | None = None) -> list[str]:
        """End the sessions whose SDK stopped heartbeating (the SDK beats every 10 s): their replicas are removed."""
        now = time.time() if now is None else now
        stale = [s.id for s in self.sessions.values() if now - s.heartbeat > SESSION_TTL_S]
        for sid in stale:
            task = asyncio.ensure_future(self._remove(self._end(sid)))
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return stale

    async def finish_session(self, tenant_id: str, session_id: str) -> None:
        """The SDK's ServiceClient closed: its training clients' replicas go (their checkpoints stay)."""
        self.session(tenant_id, session_id)
        await self._remove(self._end(session_id))

    def _end(self, session_id: str) -> list[Client]:
        self.sessions.pop(session_id, None)
        ended = [c for c in self.clients.values() if c.session_id == session_id]
        for c in ended:
            self.clients.pop(c.id, None)
        return ended

    async def _remove(self, clients: list[Client]) -> None:
        for c in clients:
            if c.tail is not None and not c.tail.done():
                await asyncio.wait({c.tail}, timeout=60)  # a deploy in flight: remove what it made, not before it
            if c.url is not None and self.inference.apps is not None:
                try:
                    await self.inference.apps.remove(c.spec)
                except ServingUnavailable:
                    pass

    # --- training clients ---

    def _resolve_base(self, base_model: str, param: str = "base_model") -> tuple[str | None, ModelShape]:
        try:
            ref = resolve_model(base_model, self.settings.model_dirs)
            shape = shape_for_model(ref)
        except ModelRefError as exc:
            raise t.TinkerError(f"unknown base_model {base_model!r}: {exc.message}", param=param) from None
        except (UnsupportedModel, OSError, ValueError) as exc:
            raise t.TinkerError(f"unknown base_model {base_model!r}: {exc}; memfit's presets are "
                                f"{', '.join(PRESET_PREFIX + p for p in PRESETS)}", param=param) from None
        return (ref.local_dir if ref.kind == "local" else None), shape

    def plan(self, base_model: str, shape: ModelShape, rank: int, targets: list[str], micro_batch: int, tokens: int) -> dict[str, Any]:
        """The training step's memory as the planner sees it: a one-worker LoRA job on the base, ``micro_batch``
        rows of ``tokens``, with the replica's memory as its budget."""
        from service.domain.spec import JobSpec
        from service.memory.planner import plan

        key = (base_model, rank, tuple(targets), micro_batch, tokens)
        if key in self._plans:
            return self._plans[key]
        spec = JobSpec.model_validate({"model": base_model, "training_file": "tinker", "training": {
            "peft": {"method": "lora", "r": rank, "alpha": float(rank), "target_modules": targets},
            "hyperparameters": {"micro_batch_size": max(1, micro_batch), "max_seq_length": max(8, tokens)},
            "resources": {"num_workers": 1, "host_memory_budget_bytes": self.settings.serve_replica_memory_bytes}}})
        p = plan(spec, shape)
        self._plans[key] = {"peak_bytes": p.peak_bytes, "need_bytes": p.need_bytes, "capacity_bytes": p.capacity_bytes,
                "fits": p.fits, "micro_batch": micro_batch, "tokens": tokens, "rank": rank}
        return self._plans[key]

    def _admit(self, plan: dict[str, Any]) -> None:
        budget = self.settings.serve_replica_memory_bytes
        if plan["need_bytes"] > budget:
            raise DomainError(f"the training client's step is planned at {plan['need_bytes'] / gib(1):.2f} GiB, over the "
                              f"replica's {budget / gib(1):.2f} GiB (MEMFIT_SERVE_REPLICA_MEMORY_BYTES): use a smaller rank, "
                              "fewer or shorter datums per request", param="data", code="insufficient_memory")

    def create_client(self, tenant_id: str, req: t.CreateModel, *, then: Callable[[Client], Awaitable[Any]] | None = None
                      ) -> tuple[Client, Future]:
        self.reap()
        self.session(tenant_id, req.session_id)
        lora = req.lora_config or t.LoraConfig()
        t.check_lora(lora)
        t.check_optimizer(req.optimizer_config)
        base_path, shape = self._resolve_base(req.base_model)
        targets = t.lora_targets(shape.family, train_attn=lora.train_attn, train_mlp=lora.train_mlp, train_unembed=lora.train_unembed)
        plan = self.plan(req.base_model, shape, lora.rank, targets, 1, DEFAULT_PLAN_TOKENS)
        self._admit(plan)
        cid = "tm-" + secrets.token_hex(10)
        args = {"model": req.base_model, "model_path": base_path, "rank": lora.rank, "targets": targets, "seed": lora.seed}
        client = Client(cid, tenant_id, req.session_id, req.base_model, base_path, shape, lora.rank, targets, lora.seed, plan,
                        AppSpec(model=req.base_model, model_path=base_path, trainer=cid, trainer_args=args))
        root = storage_root(self.settings, tenant_id) / cid
        root.mkdir(parents=True, exist_ok=True)
        (root / "meta.json").write_text(json.dumps({"model_id": cid, "base_model": req.base_model, "rank": lora.rank,
                                                    "targets": targets, "created": int(time.time())}))
        self.clients[cid] = client

        async def deploy() -> dict[str, Any]:
            await self._deploy(client)
            if then is not None:
                return await then(client)
            return {"type": "create_model", "model_id": cid}

        return client, self._queue(client, "json", deploy)

    async def _deploy(self, client: Client) -> None:
        apps = self.inference.apps
        if apps is None and (published := dashboard_address(self.settings)):
            self.inference.attach(published)
            apps = self.inference.apps
        if apps is None:
            raise ServingUnavailable("no Ray cluster is configured for Tinker's training clients "
                                     "(MEMFIT_SERVE_RAY_ADDRESS or MEMFIT_RAY_ADDRESS)")
        client.url = await apps.ensure(client.spec)

    def client(self, tenant_id: str, model_id: str) -> Client:
        c = self.clients.get(model_id)
        if c is None or c.tenant_id != tenant_id:
            raise t.TinkerNotFound(f"training client {model_id!r} does not exist", param="model_id")
        return c

    # --- requests to a client ---

    def _queue(self, client: Client, kind: str, work: Callable[[], Awaitable[Any]]) -> Future:
        prev = client.tail

        async def run():
            if prev is not None:
                await asyncio.wait({prev})
            return await work()

        task = asyncio.ensure_future(run())
        client.tail = task
        return self._future(client.tenant_id, kind, task)

    def _future(self, tenant_id: str, kind: str, task: asyncio.Future) -> Future:
        now = time.time()
        for fid in [fid for fid, f in self.futures.items() if f.done_at is not None and now - f.done_at > FUTURE_TTL_S]:
            self.futures.pop(fid, None)
        f = Future("tf-" + secrets.token_hex(12), tenant_id, kind, task)
        task.add_done_callback(lambda _: setattr(f, "done_at", time.time()))
        self.futures[f.id] = f
        return f

    async def _call(self, client: Client, op: str, **body) -> dict[str, Any]:
        if client.url is None:
            raise ServingUnavailable("the training client's replica is not running")
        try:
            r = await self._http.post(client.url, json={"op": op, **body})
        except httpx.HTTPError as exc:
            raise ServingUnavailable(f"the training client's replica did not answer: {exc}") from None
        try:
            answer = r.json()
        except ValueError:
            answer = {"error": r.text[:500], "status": 503}
        if r.status_code != 200:
            status = int(answer.get("status") or r.status_code)
            err = DomainError(answer.get("error") or f"the replica answered {r.status_code}", param=answer.get("param"))
            err.status = status if 400 <= status < 600 else 500
            raise err
        return answer

    def forward_backward(self, tenant_id: str, req: ForwardBackwardRequest) -> Future:
        client = self.client(tenant_id, req.model_id)
        t.check_forward_backward(req, client.shape.vocab)
        longest = max(len(d.tokens) for d in req.data)
        client.plan = self.plan(client.base_model, client.shape, client.rank, client.targets, len(req.data), longest)
        self._admit(client.plan)
        data = [{"tokens": d.tokens, "inputs": {k: v.data for k, v in d.loss_fn_inputs.items()}} for d in req.data]

        async def work():
            out = await self._call(client, "forward_backward", data=data, loss_fn=req.loss_fn,
                                   loss_fn_config=req.loss_fn_config, forward_only=req.forward_only)
            out["metrics"]["memfit_planned_peak_bytes:max"] = float(client.plan["peak_bytes"])
            return out

        return self._queue(client, "forward_backward", work)

    def optim_step(self, tenant_id: str, req: t.OptimStep) -> Future:
        client = self.client(tenant_id, req.model_id)
        params = t.adam_params(req).model_dump()

        async def work():
            out = await self._call(client, "optim_step", adam_params=params)
            client.steps += 1
            return {"type": "optim_step", "metrics": out.get("metrics") or {}}

        return self._queue(client, "json", work)

    def save(self, tenant_id: str, req: t.SaveWeights, kind: str) -> Future:
        client = self.client(tenant_id, req.model_id)
        client.saves += 1
        name = t.check_name(req.path) if req.path is not None else f"{'sampler' if kind == 'sampler_weights' else 'state'}-{client.saves:04d}"
        path = t.CheckpointPath(client.id, kind, name)  # type: ignore[arg-type]
        folder = checkpoint_folder(self.settings, tenant_id, path)
        typ = "save_weights_for_sampler" if kind == "sampler_weights" else "save_weights"
        as_session = kind == "sampler_weights" and req.path is None

        async def work():
            await self._call(client, "save", folder=str(folder), optimizer=kind == "weights")
            out = {"type": typ, "path": str(path)}
            if as_session:  # save_weights_and_get_sampling_client: the SDK wants a sampling session for them
                out["sampling_session_id"] = self._sampler(tenant_id, client.base_model, str(path), str(folder)).id
            return out

        return self._queue(client, "json", work)

    def load(self, tenant_id: str, req: t.LoadWeights) -> Future:
        path = t.parse_path(req.path)
        folder = checkpoint_folder(self.settings, tenant_id, path)
        if not (folder / "adapter_config.json").is_file():
            raise t.TinkerNotFound(f"checkpoint {req.path!r} does not exist", param="path")
        if req.optimizer and not (folder / "optimizer.pt").is_file():
            raise t.TinkerError(f"{req.path!r} holds no optimizer state (save it with save_state)", param="optimizer")

        async def load_into(client: Client) -> dict[str, Any]:
            await self._call(client, "load", folder=str(folder), optimizer=req.optimizer)
            return {"type": "load_weights", "path": req.path, "model_id": client.id}

        if req.model_id is not None:
            client = self.client(tenant_id, req.model_id)
            return self._queue(client, "json", lambda: load_into(client))
        if req.session_id is None:
            raise t.TinkerError("load_weights needs model_id (load_state) or session_id (a client from the state)",
                                param="model_id")
        meta = read_meta(self.settings, tenant_id, path.model_id) or {}
        targets = meta.get("targets") or []
        lora = t.LoraConfig(rank=int(meta.get("rank", 32)), train_attn=any(m in targets for m in ("q_proj", "c_attn")),
                            train_mlp=any(m in targets for m in ("up_proj", "c_fc")), train_unembed="lm_head" in targets)
        create = t.CreateModel(session_id=req.session_id, model_seq_id=req.model_seq_id or 0, base_model=meta["base_model"],
                               lora_config=lora)
        _, future = self.create_client(tenant_id, create, then=load_into)
        return future

    # --- sampling ---

    def _sampler(self, tenant_id: str, base_model: str, model_path: str | None, folder: str | None) -> Sampler:
        s = Sampler("ss-" + secrets.token_hex(10), tenant_id, base_model, model_path, folder)
        self.samplers[s.id] = s
        return s

    def create_sampling_session(self, tenant_id: str, req: t.CreateSamplingSession) -> Sampler:
        self.session(tenant_id, req.session_id)
        if req.model_path:
            path = t.parse_path(req.model_path, "model_path")
            folder = checkpoint_folder(self.settings, tenant_id, path)
            meta = read_meta(self.settings, tenant_id, path.model_id)
            if meta is None or not (folder / "adapter_config.json").is_file():
                raise t.TinkerNotFound(f"checkpoint {req.model_path!r} does not exist", param="model_path")
            return self._sampler(tenant_id, meta["base_model"], req.model_path, str(folder))
        if not req.base_model:
            raise t.TinkerError("a sampling session needs model_path or base_model", param="base_model")
        self._resolve_base(req.base_model)
        return self._sampler(tenant_id, req.base_model, None, None)

    def sampler(self, tenant_id: str, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is None or s.tenant_id != tenant_id:
            raise t.TinkerNotFound(f"sampling session {sampler_id!r} does not exist", param="sampling_session_id")
        return s

    def _host(self, s: Sampler) -> Client:
        """The replica that samples for ``s``: the live client that saved its weights, else the base's sampler."""
        if s.model_path:
            owner = self.clients.get(t.parse_path(s.model_path).model_id)
            if owner is not None and owner.tenant_id == s.tenant_id:
                return owner
        host = self.hosts.get(s.base_model)
        if host is None:
            base_path, shape = self._resolve_base(s.base_model)
            targets = t.lora_targets(shape.family, train_attn=True, train_mlp=False, train_unembed=False)
            hid = "sampler-" + secrets.token_hex(6)
            args = {"model": s.base_model, "model_path": base_path, "rank": SAMPLER_RANK, "targets": targets, "seed": 0}
            host = Client(hid, "", "", s.base_model, base_path, shape, SAMPLER_RANK, targets, 0, {},
                          AppSpec(model=s.base_model, model_path=base_path, trainer=hid, trainer_args=args))
            self.hosts[s.base_model] = host
        return host

    def sample(self, tenant_id: str, req: t.Sample) -> Future:
        if req.sampling_session_id:
            s = self.sampler(tenant_id, req.sampling_session_id)
        elif req.model_path or req.base_model:
            sess = next((x.id for x in self.sessions.values() if x.tenant_id == tenant_id), None)
            if sess is None:
                raise t.TinkerError("create a session before sampling", param="sampling_session_id")
            s = self.create_sampling_session(tenant_id, t.CreateSamplingSession(session_id=sess, base_model=req.base_model,
                                                                                 model_path=req.model_path))
        else:
            raise t.TinkerError("a sample needs sampling_session_id, model_path or base_model", param="sampling_session_id")
        host = self._host(s)
        tokens = t.check_sample(req, host.shape.vocab, self.settings.serve_max_tokens)
        body = {"folder": s.folder, "tokens": tokens, "num_samples": req.num_samples,
                "sampling_params": req.sampling_params.model_dump()}

        async def work():
            if host.url is None:
                await self._deploy(host)
            return await self._call(host, "sample", **body)

        return self._queue(host, "sample", work)

    # --- futures and memory ---

    async def retrieve(self, tenant_id: str, request_id: str) -> tuple[str, Any]:
        """``("pending", None)``, ``("error", (message, status))`` or ``(kind, result)``."""
        f = self.futures.get(request_id)
        if f is None or f.tenant_id != tenant_id:
            raise t.TinkerNotFound(f"future {request_id!r} does not exist", param="request_id")
        await asyncio.wait({f.task}, timeout=POLL_S)
        if not f.task.done():
            return "pending", None
        if f.task.cancelled():
            return "error", ("the request was cancelled", 500)
        exc = f.task.exception()
        if exc is not None:
            status = exc.status if isinstance(exc, DomainError) else 500
            return "error", (getattr(exc, "message", None) or str(exc), status)
        return f.kind, f.task.result()

    async def memory(self, tenant_id: str, model_id: str) -> dict[str, Any]:
        """The client's plan for its last request's micro-batch beside what its replica measures now."""
        client = self.client(tenant_id, model_id)
        measured = None
        if client.url is not None and (client.tail is None or client.tail.done()):
            try:
                measured = await self._call(client, "info")
            except DomainError:
                measured = None
        return {"model_id": client.id, "base_model": client.base_model, "lora_rank": client.rank, "targets": client.targets,
                "steps": client.steps, "plan": client.plan, "measured": measured}
