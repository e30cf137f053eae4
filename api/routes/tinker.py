"""Tinker's training API (the official ``tinker`` SDK's endpoints, ``/api/v1/...``; docs/tinker.md) on memfit's
keys and tenants: the SDK sends ``X-API-Key: tml-<memfit key>`` (it refuses keys without the prefix; memfit
takes the key after it, or a bare memfit key). Every object (session, training client, sampling
session, future, checkpoint) is the tenant's: another tenant's id is a 404, as an unknown one.

The routes parse, authorize and hand over to service/scheduler/tinker.py; the work runs on the client's
replica and comes back through ``retrieve_future``, as JSON, or as protobuf for ``ForwardBackwardOutput`` and
``SampleResponse`` when the client asks for it (service/domain/tinker_wire.py). A request memfit refuses is a
4xx naming its field; a path of the Tinker API memfit does not implement is a 404 ``unsupported_endpoint``
(api/errors.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader

from api.errors import problems
from service.domain import tinker as t
from service.domain.errors import Unauthorized
from service.domain.presets import PRESET_PREFIX, PRESETS
from service.domain.tinker_wire import WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response
from service.store.auth import Principal

router = APIRouter(prefix="/api/v1", tags=["tinker"])
PROTO = "application/x-protobuf"
R = problems(400, 401, 404, 422, 429, 503)

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="`tml-` followed by a memfit API key (the tinker SDK's key).")


async def get_tinker_principal(request: Request, _doc=Security(_api_key)) -> Principal:
    key = request.headers.get("x-api-key")
    if key is None:
        raise Unauthorized("missing X-API-Key header: the tinker SDK sends `tml-` followed by a memfit API key")
    key = key[len(t.API_KEY_PREFIX):] if key.startswith(t.API_KEY_PREFIX) else key
    return await request.app.state.key_check.principal(f"Bearer {key}")


TinkerPrincipal = Annotated[Principal, Depends(get_tinker_principal)]


def tinker(request: Request):
    return request.app.state.tinker


def future(f) -> dict[str, Any]:
    return {"request_id": f.id, "model_id": None}


# --- service ---------------------------------------------------------------------------------------------


@router.get("/healthz", summary="Tinker's health check")
def tinker_healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities", responses=problems(401, 429), summary="The base models a training client may use")
def get_server_capabilities(principal: TinkerPrincipal) -> dict[str, Any]:
    return {"supported_models": [{"model_name": PRESET_PREFIX + name, "max_context_length": cfg.get("max_position_embeddings"),
                                  "trainable": True, "sampleable": True} for name, cfg in PRESETS.items()]}


@router.post("/client/config", responses=problems(401, 429), summary="The SDK's feature flags, as memfit serves them")
def client_config(request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    # no JWT exchange, plain httpx, JSON where the SDK allows it, one forward_backward request per call's datums
    limit = request.app.state.settings.max_json_body_bytes
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_len": t.MAX_DATUMS, "fwdbwd_max_chunk_bytes_count": limit // 2,
            "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/client/dynamic_config", responses=problems(401, 429), summary="The SDK's refreshed flags (defaults)")
def client_dynamic_config(principal: TinkerPrincipal) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry", responses=problems(401, 429), summary="The SDK's telemetry: accepted and dropped")
def telemetry(principal: TinkerPrincipal) -> dict[str, str]:
    return {"status": "accepted"}


@router.post("/create_session", responses=R, summary="A session (a ServiceClient)")
async def create_session(body: t.CreateSession, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return {"type": "create_session", "session_id": tinker(request).create_session(principal.tenant_id)}


@router.post("/session_heartbeat", responses=R, summary="Keep a session alive")
async def session_heartbeat(body: t.SessionRef, request: Request, principal: TinkerPrincipal) -> dict[str, str]:
    tinker(request).heartbeat(principal.tenant_id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", responses=R, summary="End a session: its training clients' replicas go")
async def finish_session(session_id: str, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    await tinker(request).finish_session(principal.tenant_id, session_id)
    return {}


# --- training clients -------------------------------------------------------------------------------------


@router.post("/create_model", responses=R, summary="A LoRA training client on a base model (a future)")
async def create_model(body: t.CreateModel, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    client, f = tinker(request).create_client(principal.tenant_id, body)
    return {"request_id": f.id, "model_id": client.id}


@router.post("/get_info", responses=R, summary="A training client's model")
async def get_info(body: t.ModelRef, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return tinker(request).client(principal.tenant_id, body.model_id).info()


@router.post("/forward_backward", responses=R, summary="Forward and backward over datums with a built-in loss (a future)",
             openapi_extra={"requestBody": {"required": True, "content": {PROTO: {"schema": {"type": "string", "format": "binary"}}}}})
async def forward_backward(request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    if request.headers.get("content-encoding", "identity") != "identity":
        raise t.Unsupported("compressed forward_backward bodies are not supported (memfit's client config turns it off)",
                            param="body")
    if not request.headers.get("content-type", "").startswith(PROTO):
        raise t.Unsupported(f"forward_backward takes the SDK's protobuf body ({PROTO})", param="body")
    try:
        req = decode_forward_backward(await request.body())
    except WireError as exc:
        raise t.TinkerError(f"the forward_backward body is not a ForwardBackwardRequest: {exc}", param=exc.param) from None
    except UnicodeDecodeError:
        raise t.TinkerError("the forward_backward body is not a ForwardBackwardRequest: a string is not UTF-8", param="body") from None
    return future(tinker(request).forward_backward(principal.tenant_id, req))


@router.post("/optim_step", responses=R, summary="An AdamW step on the accumulated gradients (a future)")
async def optim_step(body: t.OptimStep, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return future(tinker(request).optim_step(principal.tenant_id, body))


@router.post("/save_weights", responses=R, summary="save_state: the adapter and optimizer state (a future)")
async def save_weights(body: t.SaveWeights, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return future(tinker(request).save(principal.tenant_id, body, "weights"))


@router.post("/save_weights_for_sampler", responses=R, summary="The adapter for sampling and serving (a future)")
async def save_weights_for_sampler(body: t.SaveWeights, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return future(tinker(request).save(principal.tenant_id, body, "sampler_weights"))


@router.post("/load_weights", responses=R, summary="load_state, or a training client from a saved state (a future)")
async def load_weights(body: t.LoadWeights, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return future(tinker(request).load(principal.tenant_id, body))


@router.get("/training_clients/{model_id}/memory", responses=R,
            summary="memfit's: a training client's planned memory for its last request, and what its replica measures")
async def training_client_memory(model_id: str, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    return await tinker(request).memory(principal.tenant_id, model_id)


# --- sampling ---------------------------------------------------------------------------------------------


@router.post("/create_sampling_session", responses=R, summary="A sampling session on saved sampler weights or a base")
async def create_sampling_session(body: t.CreateSamplingSession, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    s = tinker(request).create_sampling_session(principal.tenant_id, body)
    return {"type": "create_sampling_session", "sampling_session_id": s.id}


@router.get("/samplers/{sampler_id}", responses=R, summary="A sampling session")
async def get_sampler(sampler_id: str, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    s = tinker(request).sampler(principal.tenant_id, sampler_id)
    return {"sampler_id": s.id, "base_model": s.base_model, "model_path": s.model_path}


@router.post("/asample", responses=R, summary="Sample completions of a token prompt (a future)")
async def asample(body: t.Sample, request: Request, principal: TinkerPrincipal) -> dict[str, Any]:
    f = tinker(request).sample(principal.tenant_id, body)
    return {"request_id": f.id, "model_id": None, "sample_sequence_ids": [f"{f.id}-{i}" for i in range(body.num_samples)]}


# --- futures ----------------------------------------------------------------------------------------------


@router.post("/retrieve_future", responses=R, summary="A future's result, a try_again while it runs, or its error")
async def retrieve_future(body: t.RetrieveFuture, request: Request, principal: TinkerPrincipal):
    kind, result = await tinker(request).retrieve(principal.tenant_id, body.request_id)
    if kind == "pending":
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    if kind == "error":
        message, status = result
        return {"error": message, "category": "user" if status < 500 else "server"}
    proto = PROTO in request.headers.get("accept", "")
    if kind == "forward_backward":
        if proto:
            return Response(encode_forward_backward_output(result["outputs"], result["metrics"]), media_type=PROTO)
        return {"loss_fn_output_type": "ArrayRecord", "metrics": result["metrics"],
                "loss_fn_outputs": [{k: {"data": v, "dtype": "float32", "shape": [len(v)]} for k, v in o.items()}
                                    for o in result["outputs"]]}
    if kind == "sample":
        if proto:
            return Response(encode_sample_response(result["sequences"]), media_type=PROTO)
        return {"type": "sample", "sequences": result["sequences"]}
    return JSONResponse(result)
