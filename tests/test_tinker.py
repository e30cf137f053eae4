"""Tinker's training API (docs/tinker.md) with the official ``tinker`` SDK, unchanged client code given only the
base URL and a ``tml-`` key: a LoRA training client on the tiny preset (a Serve replica on the session's Ray
head) runs a supervised loop of forward_backward (cross_entropy) and optim_step until its loss falls, saves
weights for the sampler and samples from them; the checkpoint is a model of ``/v1/models``; another tenant
gets a 404 for every object of the first; bad requests are 4xx naming their field.

One stack of its own (its database, its API attached to the session's Ray head), one ServiceClient and one
training client for the module; closing the ServiceClient ends the session and its replica."""

from __future__ import annotations

import httpx
import pytest

from tests.factories import bearer, new_key
from tests.stack import Stack

tinker = pytest.importorskip("tinker", reason="the [dev] extra (the tinker SDK) is not installed")
types = tinker.types

pytestmark = [pytest.mark.ray]

BASE = "preset:tiny-llama"
SEQUENCE = [7, 101, 33, 250, 18, 64, 402, 9, 77, 300, 12, 45, 199, 3, 88, 140]  # one row to learn by heart
PROMPT = SEQUENCE[:4]


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
                       loss_fn_inputs={"target_tokens": SEQUENCE[1:], "weights": [0.0] * 3 + [1.0] * (len(SEQUENCE) - 4)})


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory):
    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("tinker-storage"), ray_head, ray_address=ray_head.dashboard_url,
                  serve_replica_cpus=0.1, serve_max_tokens=64)
        try:
            yield s
        finally:
            s.close()


@pytest.fixture(scope="module")
def service(stack):
    client = tinker.ServiceClient(base_url=stack.server.url, api_key="tml-" + stack.key)
    try:
        yield client
    finally:
        client.close("success").result(timeout=120)


@pytest.fixture(scope="module")
def run(service) -> dict:
    """The supervised loop, as a Tinker user writes it: submit forward_backward and optim_step, then wait."""
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result(timeout=300)
    losses = []
    for _ in range(12):
        fwd_bwd = training.forward_backward([datum(), datum()], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fwd_bwd.result(timeout=120).metrics["loss:sum"])
        step.result(timeout=120)
    saved = training.save_weights_for_sampler(name="step-12").result(timeout=120)
    return {"training": training, "losses": losses, "path": saved.path}


def test_the_loss_falls_and_the_sampler_weights_sample(stack, service, run):
    training, losses = run["training"], run["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    info = training.get_info()
    assert info.model_id == training.model_id and info.lora_rank == 8 and info.model_data.model_name == BASE
    # forward alone: the loss of the trained weights, lower than where the loop started, and no step taken
    forward = training.forward([datum(), datum()], "cross_entropy").result(timeout=120)
    assert forward.metrics["loss:sum"] < losses[0]
    assert len(forward.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQUENCE) - 1

    # the RL losses on the sampler's log-probabilities: at the same weights the ratio is 1, so ppo's loss is -Σ w·A
    lp = forward.loss_fn_outputs[0]["logprobs"].tolist()
    weights = datum().loss_fn_inputs["weights"].tolist()
    rl = types.Datum(model_input=datum().model_input, loss_fn_inputs={
        "target_tokens": SEQUENCE[1:], "weights": weights, "logprobs": lp, "advantages": [1.0] * len(lp)})
    ppo = training.forward([rl], "ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result(timeout=120)
    assert ppo.metrics["loss:sum"] == pytest.approx(-sum(weights), rel=1e-3)
    assert training.forward([rl], "importance_sampling").result(timeout=120).metrics["loss:sum"] == pytest.approx(-sum(weights), rel=1e-3)

    # save_state, a step that moves the weights, then load_state_with_optimizer: the loss is the saved one again
    state = training.save_state("before").result(timeout=120).path
    assert state == f"tinker://{training.model_id}/weights/before"
    before = training.forward([datum()], "cross_entropy").result(timeout=120).metrics["loss:sum"]
    training.forward_backward([datum()], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
    assert training.forward([datum()], "cross_entropy").result(timeout=120).metrics["loss:sum"] != pytest.approx(before, rel=1e-4)
    with pytest.warns(FutureWarning):  # the SDK deprecates load_state* in favour of a new client from the state
        training.load_state_with_optimizer(state).result(timeout=120)
    assert training.forward([datum()], "cross_entropy").result(timeout=120).metrics["loss:sum"] == pytest.approx(before, rel=1e-4)

    assert run["path"] == f"tinker://{training.model_id}/sampler_weights/step-12"
    sampler = service.create_sampling_client(model_path=run["path"]).result(timeout=60)
    answer = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=120)
    assert len(answer.sequences) == 2
    for seq in answer.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length" and len(seq.logprobs) == 6
    # greedy, from a model that learnt the row: it goes on with the row
    assert answer.sequences[0].tokens[:2] == SEQUENCE[4:6], (answer.sequences[0].tokens, losses)

    # the checkpoints are the tenant's models; the client's memory: the plan of its last request (one datum) and its replica's measure
    ids = [m["id"] for m in stack.http.get("/v1/models", headers=stack.auth).json()["data"]]
    assert run["path"] in ids
    memory = stack.http.get(f"/api/v1/training_clients/{training.model_id}/memory", headers={"X-API-Key": "tml-" + stack.key}).json()
    assert memory["plan"]["fits"] and memory["plan"]["micro_batch"] == 1 and memory["plan"]["peak_bytes"] > 0
    assert memory["measured"]["trainable_parameters"] > 0 and memory["measured"]["rss_bytes"] > memory["plan"]["peak_bytes"]


def test_another_tenant_gets_404_for_every_object(stack, service, run):
    training = run["training"]
    other = new_key(stack.app.state.sessions)
    h = {"X-API-Key": "tml-" + other}
    own = stack.http.post("/api/v1/create_session", headers=h, json={"tags": [], "sdk_version": "x"}).json()["session_id"]
    fb = stack.http.post("/api/v1/optim_step", headers={"X-API-Key": "tml-" + stack.key},
                         json={"model_id": training.model_id, "adam_params": {"learning_rate": 0.0}}).json()
    tries = [
        ("/api/v1/get_info", {"model_id": training.model_id}),
        ("/api/v1/optim_step", {"model_id": training.model_id, "adam_params": {"learning_rate": 1.0}}),
        ("/api/v1/save_weights", {"model_id": training.model_id, "path": "stolen"}),
        ("/api/v1/retrieve_future", {"request_id": fb["request_id"]}),
        ("/api/v1/create_sampling_session", {"session_id": own, "model_path": run["path"]}),
        ("/api/v1/load_weights", {"session_id": own, "model_seq_id": 0, "path": run["path"], "optimizer": False}),
        ("/api/v1/session_heartbeat", {"session_id": service.holder.get_session_id()}),
    ]
    for path, body in tries:
        r = stack.http.post(path, headers=h, json=body)
        assert r.status_code == 404, (path, r.status_code, r.text)
    assert stack.http.get(f"/api/v1/training_clients/{training.model_id}/memory", headers=h).status_code == 404
    assert stack.http.get(f"/v1/models/{run['path']}", headers=bearer(other)).status_code == 404
    assert run["path"] not in stack.http.get("/v1/models", headers=bearer(other)).text
    # through the SDK, as the other tenant's code would meet it
    theirs = tinker.ServiceClient(base_url=stack.server.url, api_key="tml-" + other)
    try:
        with pytest.raises(tinker.NotFoundError):
            theirs.create_sampling_client(model_path=run["path"]).result(timeout=60)
    finally:
        theirs.close("success").result(timeout=60)
    # a key without memfit behind it
    assert stack.http.post("/api/v1/create_session", headers={"X-API-Key": "tml-mf-nobody"}, json={}).status_code == 401


def _problem(r: httpx.Response, status: int, param: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["param"] == param, body
    return body


def test_bad_requests_are_refused_naming_their_field(stack, service, run):
    # the SDK's own call: an unknown base model
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        service.create_lora_training_client(base_model="preset:no-such-model").result(timeout=60)
    h = {"X-API-Key": "tml-" + stack.key}
    sid = service.holder.get_session_id()
    _problem(stack.http.post("/api/v1/create_model", headers=h,
                             json={"session_id": sid, "base_model": BASE, "lora_config": {"rank": 0}}), 400, "lora_config.rank")
    _problem(stack.http.post("/api/v1/create_model", headers=h, json={"session_id": sid, "base_model": BASE,
                                                                      "optimizer_config": {"type": "dimuon"}}), 400, "optimizer_config.type")
    # forward_backward's protobuf body, as the SDK encodes it
    from tinker.proto.request_conv import forward_backward_request_to_proto

    def fwd_bwd(data, loss_fn="cross_entropy"):
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
                                           model_id=run["training"].model_id, seq_id=1)
        return stack.http.post("/api/v1/forward_backward", headers={**h, "content-type": "application/x-protobuf"},
                               content=forward_backward_request_to_proto(req).SerializeToString())

    short = types.Datum(model_input=types.ModelInput.from_ints(SEQUENCE[:-1]), loss_fn_inputs={"target_tokens": SEQUENCE[1:5]})
    _problem(fwd_bwd([short]), 400, "data[0].loss_fn_inputs.target_tokens")
    _problem(fwd_bwd([datum()], "dro"), 400, "loss_fn")
    _problem(fwd_bwd([datum()], "ppo"), 400, "data[0].loss_fn_inputs.logprobs")
    huge = types.Datum(model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1]})
    _problem(fwd_bwd([huge]), 400, "data[0].model_input")
    r = stack.http.post("/api/v1/forward_backward", headers={**h, "content-type": "application/x-protobuf"}, content=b"\xff\xff")
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
    _problem(stack.http.post("/api/v1/optim_step", headers=h, json={"model_id": run["training"].model_id,
                                                                    "adam_params": {"learning_rate": 1e-3, "beta2": 1.5}}),
             400, "adam_params.beta2")
    _problem(stack.http.post("/api/v1/save_weights", headers=h, json={"model_id": run["training"].model_id, "path": "../x"}),
             400, "path")
    # a part of the Tinker API memfit does not implement
    r = stack.http.post("/api/v1/save_weights_external", headers=h, json={})
    assert r.status_code == 404 and r.json()["code"] == "unsupported_endpoint"


def test_the_wire_format_is_the_sdk_s():
    """forward_backward's body as the SDK encodes it reads back whole; the outputs memfit writes, the SDK reads."""
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from service.domain import tinker_wire as wire

    rl = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]),
                     loss_fn_inputs={"target_tokens": [4, 5, 6], "logprobs": [-1.0, -2.0, -0.5], "advantages": [0.5, 0.5, -1.0]})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[datum(), rl], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}), model_id="tm-abcdef", seq_id=7)
    proto = forward_backward_request_to_proto(req)
    proto.forward_only = True
    got = wire.decode_forward_backward(proto.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.loss_fn_config, got.forward_only) == ("tm-abcdef", 7, "ppo", {"clip_low_threshold": 0.7}, True)
    assert got.data[0].tokens == SEQUENCE[:-1] and got.data[1].tokens == [3, 4, 5]
    assert got.data[1].loss_fn_inputs["target_tokens"].data == [4, 5, 6]
    assert got.data[1].loss_fn_inputs["advantages"].data == [0.5, 0.5, -1.0]

    out = deserialize_forward_backward_output(wire.encode_forward_backward_output(
        [{"logprobs": [-1.0, -2.0], "elementwise_loss": [0.5, 0.25]}, {"logprobs": [-3.0], "elementwise_loss": [1.0]}],
        {"loss:sum": 1.75}))
    assert out.metrics == {"loss:sum": 1.75} and [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    sample = deserialize_sample_response(wire.encode_sample_response([{"tokens": [9, 8], "logprobs": [-0.5, -0.25], "stop_reason": "stop"}]))
    assert sample.sequences[0].tokens == [9, 8] and sample.sequences[0].stop_reason == "stop"
    with pytest.raises(wire.WireError):
        wire.decode_forward_backward(b"\x1a\xff\x01")  # a datum longer than the body


def test_a_session_that_stops_heartbeating_ends(new_database, tmp_path_factory):
    """An SDK process that went away without closing: its session ends at the next session or client created."""
    from tests.scheduler_support import app_without_ray

    with app_without_ray(new_database, tmp_path_factory.mktemp("reap")) as (app, client, _):
        h = {"X-API-Key": "tml-" + new_key(app.state.sessions)}
        old = client.post("/api/v1/create_session", headers=h, json={}).json()["session_id"]
        model = client.post("/api/v1/create_model", headers=h, json={"session_id": old, "base_model": BASE}).json()
        app.state.tinker.sessions[old].heartbeat -= 3600
        client.post("/api/v1/create_session", headers=h, json={})
        assert client.post("/api/v1/session_heartbeat", headers=h, json={"session_id": old}).status_code == 404
        assert client.post("/api/v1/get_info", headers=h, json={"model_id": model["model_id"]}).status_code == 404
