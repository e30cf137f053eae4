"""Broken object-level authorisation (OWASP API1), route by route: tenant B tries tenant A's ids.

Two tenants on one real app and Postgres database, each with a file, a running job with events,
metrics, a memory sample and a checkpoint (posted through the ingest route with the job's own token),
and model artefacts in the job's output folder. For every route of the app (``app.routes``, through
the included routers, so a route added without a row in ROUTES fails ``test_every_route_is_covered``):

- a route that takes an object id answers B's request for A's object exactly as it answers an id
  that does not exist: 404, the same body (the id aside) — never a 403, which would say it exists;
  the dashboard's routes are tried with B's login cookie as well as B's key, the ingest route with
  B's job token and with B's API key;
- A's ids passed *inside* a request (training_file, validation_file, pagination cursors,
  Idempotency-Key) are unknown to B in the same way;
- nothing of A's (ids, filename, suffix, metadata, tenant, key, token) appears in any answer B gets:
  listings, pages, counts, error messages; /metrics is the operator's (unauthenticated, kept off the
  public ingress: deploy/prometheus.yml) and may carry A's job id only as the ``job_id`` label of
  its per-job memory gauge;
- afterwards A's objects are unchanged: the job still running with nothing pending, the file there,
  no record stored by B's attempts.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from api.web_auth import COOKIE
from service.jobs.artifacts import output_root
from tests.factories import CHAT_JSONL, bearer, new_tenant
from tests.scheduler_support import app_without_ray

JOB = "/v1/fine_tuning/jobs"


@dataclass
class Tenant:
    name: str
    id: str
    key: str
    file_id: str = ""
    filename: str = ""
    job_id: str = ""
    token: str = ""
    checkpoint_id: str = ""
    suffix: str = ""
    metadata_value: str = ""
    idempotency_key: str = ""
    secrets: list[str] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.key)


def _seed(app, client, sched, settings, label: str) -> Tenant:
    t = new_tenant(app.state.sessions, f"tenant-{label}-secretname")
    me = Tenant(name=t.name, id=t.id, key=t.key, filename=f"{label}-secret-dataset.jsonl",
                suffix=f"{label}sfx", metadata_value=f"{label}-secret-project",
                idempotency_key=f"{label}-idem-key")
    r = client.post("/v1/files", headers=me.headers, files={"file": (me.filename, CHAT_JSONL)},
                    data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    me.file_id = r.json()["id"]
    r = client.post(JOB, headers={**me.headers, "Idempotency-Key": me.idempotency_key}, json={
        "model": "preset:tiny-llama", "training_file": me.file_id, "suffix": me.suffix,
        "metadata": {"project": me.metadata_value}})
    assert r.status_code == 200, r.text
    me.job_id = r.json()["id"]
    sched.validate_pending()
    me.token = {job_id: tok for job_id, _, tok in sched.claim(limit=100)}[me.job_id]
    now = time.time()
    r = client.post(f"/v1/internal/jobs/{me.job_id}/ingest", headers=bearer(me.token), json={"records": [
        {"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": 1, "total_steps": 9, "loss": 2.0},
        {"kind": "memory", "attempt": 1, "time": now, "rank": 0, "step": 1, "parameters_bytes": 1000,
         "peak_bytes": 5000},
        {"kind": "checkpoint", "attempt": 1, "time": now, "step": 1, "path": f"ray/{label}/checkpoint_000001",
         "metrics": {"loss": 2.0}},
        {"kind": "event", "attempt": 1, "time": now, "message": f"{label}-secret-event-message"},
    ]})
    assert r.status_code == 200, r.text
    r = client.get(f"{JOB}/{me.job_id}/checkpoints", headers=me.headers)
    me.checkpoint_id = r.json()["data"][0]["id"]
    with app.state.sessions() as s:
        from service.store.models import Job

        root = output_root(s.get(Job, me.job_id), settings)
    (root / "adapter").mkdir(parents=True, exist_ok=True)
    (root / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    me.secrets = [me.id, me.name, me.key, me.token, me.file_id, me.filename, me.job_id, me.checkpoint_id,
                  me.suffix, me.metadata_value, me.idempotency_key, f"{label}-secret-event-message"]
    return me


@dataclass
class World:
    app: object
    client: TestClient
    a: Tenant
    b: Tenant
    cookie_b: TestClient  # logged in to the dashboard as B, no Authorization header


@pytest.fixture(scope="module")
def world(new_database, tmp_path_factory):
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as (app, client, sched):
        settings = app.state.settings
        a = _seed(app, client, sched, settings, "alpha")
        b = _seed(app, client, sched, settings, "bravo")
        with TestClient(app) as cookie_b:
            r = cookie_b.post("/ui/login", data={"api_key": b.key, "next": "/ui/jobs"}, follow_redirects=False)
            # the cookie holds a session token, never the key (tests/test_behind_proxy.py)
            assert r.status_code == 303 and cookie_b.cookies.get(COOKIE).startswith("mfs_"), r.text
            yield World(app, client, a, b, cookie_b)


def _unknown(real: str) -> str:
    """An id of the same shape as ``real`` that names nothing."""
    prefix, _, rest = real.partition("-")
    return f"{prefix}-{'Q' * len(rest)}"


def assert_same_as_unknown(send, real: str, what: str) -> None:
    """``send(id)`` for A's id answers exactly what it answers for an id that does not exist."""
    fake = _unknown(real)
    theirs, nobody = send(real), send(fake)
    assert theirs.status_code == 404, f"{what}: {theirs.status_code} {theirs.text[:300]}"
    assert theirs.text.replace(real, fake) == nobody.text, f"{what}: differs from an unknown id's answer"
    assert theirs.headers.get("content-type") == nobody.headers.get("content-type"), what


def assert_nothing_of(a: Tenant, text: str, where: str) -> None:
    leaked = [s for s in a.secrets if s in text]
    assert not leaked, f"{where} shows tenant A's {leaked}"


# --- the routes --------------------------------------------------------------------------------
# One row per route: (method, path template, endpoint name) → how B attacks it.
#   "job" / "file": the path carries A's job / file id (B's key; `web` routes also B's cookie);
#   "ingest": a job's ingest route, tried with B's job token and with B's key;
#   "list": no id, B's answer must show nothing of A's (checked in test_listings_show_nothing_of_a);
#   "public": no tenant data at all (docs, login, health), checked the same way.

ROUTES: dict[tuple[str, str, str], dict] = {
    ("GET", "/openapi.json", "openapi"): {"kind": "public"},
    ("GET", "/docs", "swagger_ui_html"): {"kind": "public"},
    ("GET", "/docs/oauth2-redirect", "swagger_ui_redirect"): {"kind": "public"},
    ("GET", "/redoc", "redoc_html"): {"kind": "public"},
    ("GET", "/healthz", "healthz"): {"kind": "public"},
    ("GET", "/readyz", "readyz"): {"kind": "public"},
    ("GET", "/ui", "ui_root"): {"kind": "public"},
    ("GET", "/ui/login", "login_form"): {"kind": "public"},
    ("POST", "/ui/login", "login"): {"kind": "public"},
    ("POST", "/ui/logout", "logout"): {"kind": "public"},
    ("GET", "/ui/planner", "planner_page"): {"kind": "list"},
    ("POST", "/ui/planner", "planner_submit"): {"kind": "list"},
    ("GET", "/ui/static", "ui-static"): {"kind": "public"},
    ("GET", "/metrics", "metrics"): {"kind": "list"},
    ("POST", "/v1/files", "upload_file"): {"kind": "list"},
    ("GET", "/v1/files", "list_files"): {"kind": "list"},
    ("GET", "/v1/files/{file_id}", "get_file"): {"kind": "file"},
    ("GET", "/v1/files/{file_id}/content", "file_content"): {"kind": "file"},
    ("DELETE", "/v1/files/{file_id}", "delete_file"): {"kind": "file"},
    ("POST", JOB, "create_job"): {"kind": "list"},
    ("GET", JOB, "list_jobs"): {"kind": "list"},
    ("POST", "/v1/memory/plan", "plan_memory"): {"kind": "list"},
    ("GET", JOB + "/{job_id}", "get_job"): {"kind": "job"},
    ("POST", JOB + "/{job_id}/cancel", "cancel_job"): {"kind": "job"},
    ("POST", JOB + "/{job_id}/pause", "pause_job"): {"kind": "job"},
    ("POST", JOB + "/{job_id}/resume", "resume_job"): {"kind": "job"},
    ("GET", JOB + "/{job_id}/events", "list_events"): {"kind": "job"},
    ("GET", JOB + "/{job_id}/events", "stream_events"): {"kind": "job", "web": True, "query": "?stream=true"},
    ("GET", JOB + "/{job_id}/events/stream", "stream_events"): {"kind": "job", "web": True},
    ("GET", JOB + "/{job_id}/checkpoints", "list_checkpoints"): {"kind": "job"},
    ("GET", JOB + "/{job_id}/memory", "job_memory"): {"kind": "job"},
    ("GET", JOB + "/{job_id}/artifacts", "list_artifacts"): {"kind": "job", "web": True},
    ("GET", JOB + "/{job_id}/artifacts/{path:path}", "download_artifact"): {"kind": "job", "web": True},
    ("GET", "/ui/jobs", "jobs_page"): {"kind": "list"},
    ("GET", "/ui/jobs/{job_id}", "job_page"): {"kind": "job", "web": True},
    ("GET", "/ui/jobs/{job_id}/memory.json", "job_memory_json"): {"kind": "job", "web": True},
    ("GET", "/ui/jobs/{job_id}/view.json", "job_view_json"): {"kind": "job", "web": True},
    ("POST", "/v1/internal/jobs/{job_id}/ingest", "ingest_records"): {"kind": "ingest"},
    # served models (api/routes/serving.py): a model id names a job of the tenant's (tests/test_serving.py
    # calls another tenant's succeeded model over the openai client); here A's job's model name is B's unknown
    ("GET", "/v1/models", "list_models"): {"kind": "list"},
    ("GET", "/v1/models/{model_id:path}", "get_model"): {"kind": "model"},
    ("DELETE", "/v1/models/{model_id:path}", "delete_model"): {"kind": "model"},
    ("POST", "/v1/chat/completions", "chat_completions"): {"kind": "list"},
    ("POST", "/v1/completions", "completions"): {"kind": "list"},
    ("GET", "/ui/models", "models_page"): {"kind": "list"},
    ("GET", "/ui/models/{model_id:path}", "model_page"): {"kind": "model", "web": True},
    ("GET", "/ui/models/{model_id:path}/view.json", "model_view_json"): {"kind": "model", "web": True},
    # Tinker's API (api/routes/tinker.py): sessions, training clients, sampling sessions and futures are ids in
    # the path or the body; test_b_gets_a_404_for_a_s_tinker_objects tries each of A's with B's key
    ("GET", "/api/v1/healthz", "tinker_healthz"): {"kind": "public"},
    ("GET", "/api/v1/get_server_capabilities", "get_server_capabilities"): {"kind": "list"},
    ("POST", "/api/v1/client/config", "client_config"): {"kind": "list"},
    ("POST", "/api/v1/client/dynamic_config", "client_dynamic_config"): {"kind": "list"},
    ("POST", "/api/v1/telemetry", "telemetry"): {"kind": "list"},
    ("POST", "/api/v1/create_session", "create_session"): {"kind": "list"},
    ("POST", "/api/v1/session_heartbeat", "session_heartbeat"): {"kind": "tinker"},
    ("POST", "/api/v1/sessions/{session_id}/finish", "finish_session"): {"kind": "tinker"},
    ("POST", "/api/v1/create_model", "create_model"): {"kind": "tinker"},
    ("POST", "/api/v1/get_info", "get_info"): {"kind": "tinker"},
    ("POST", "/api/v1/forward_backward", "forward_backward"): {"kind": "tinker"},
    ("POST", "/api/v1/optim_step", "optim_step"): {"kind": "tinker"},
    ("POST", "/api/v1/save_weights", "save_weights"): {"kind": "tinker"},
    ("POST", "/api/v1/save_weights_for_sampler", "save_weights_for_sampler"): {"kind": "tinker"},
    ("POST", "/api/v1/load_weights", "load_weights"): {"kind": "tinker"},
    ("GET", "/api/v1/training_clients/{model_id}/memory", "training_client_memory"): {"kind": "tinker"},
    ("POST", "/api/v1/create_sampling_session", "create_sampling_session"): {"kind": "tinker"},
    ("GET", "/api/v1/samplers/{sampler_id}", "get_sampler"): {"kind": "tinker"},
    ("POST", "/api/v1/asample", "asample"): {"kind": "tinker"},
    ("POST", "/api/v1/retrieve_future", "retrieve_future"): {"kind": "tinker"},
}


def app_routes(app) -> set[tuple[str, str, str]]:
    out = set()
    for route in iter_route_contexts(app.routes):
        for method in route.methods or {"GET"}:  # a Mount (the static files) has no methods: GET
            if method != "HEAD":
                out.add((method, route.path, route.name))
    return out


def test_every_route_is_covered(world):
    routes = app_routes(world.app)
    missing = sorted(routes - set(ROUTES))
    assert not missing, f"routes with no row in tests/test_bola.py ROUTES (say how tenant B attacks them): {missing}"
    assert not sorted(set(ROUTES) - routes), "ROUTES names routes the app no longer has"


def _url(template: str, a: Tenant, object_id: str, row: dict) -> str:
    url = (template.replace("{job_id}", object_id).replace("{file_id}", object_id)
           .replace("{path:path}", "adapter/adapter_config.json"))
    return url + row.get("query", "")


@pytest.mark.parametrize("route", [k for k, v in ROUTES.items() if v["kind"] in ("job", "file")],
                         ids=lambda k: f"{k[0]} {k[1]} {k[2]}")
def test_b_gets_a_404_for_a_s_object(world, route):
    method, template, _ = route
    row = ROUTES[route]
    a, b = world.a, world.b
    real = a.job_id if row["kind"] == "job" else a.file_id

    def with_key(object_id):
        return world.client.request(method, _url(template, a, object_id, row), headers=b.headers)

    assert_same_as_unknown(with_key, real, f"{method} {template} with B's key")
    if row.get("web"):
        def with_cookie(object_id):
            return world.cookie_b.request(method, _url(template, a, object_id, row))

        assert_same_as_unknown(with_cookie, real, f"{method} {template} with B's login cookie")
    # The same route does serve B's own object (so the 404 above is the tenant check, not a broken route).
    own = b.job_id if row["kind"] == "job" else b.file_id
    if method == "GET" and "stream" not in _url(template, b, own, row):
        r = world.client.get(_url(template, b, own, row), headers=b.headers)
        assert r.status_code == 200, f"{template} for B's own object: {r.status_code} {r.text[:200]}"


@pytest.mark.parametrize("route", [k for k, v in ROUTES.items() if v["kind"] == "model"],
                         ids=lambda k: f"{k[0]} {k[1]} {k[2]}")
def test_b_gets_a_404_for_a_s_model(world, route):
    method, template, _ = route
    row = ROUTES[route]
    a, b = world.a, world.b

    def url(job_id):
        return template.replace("{model_id:path}", f"ft:preset:tiny-llama::{job_id}")

    assert_same_as_unknown(lambda job_id: world.client.request(method, url(job_id), headers=b.headers), a.job_id,
                           f"{method} {template} with B's key")
    if row.get("web"):
        assert_same_as_unknown(lambda job_id: world.cookie_b.request(method, url(job_id)), a.job_id,
                               f"{method} {template} with B's login cookie")
    body = {"model": f"ft:preset:tiny-llama::{a.job_id}", "messages": [{"role": "user", "content": "hi"}]}
    assert_same_as_unknown(lambda job_id: world.client.post("/v1/chat/completions", headers=b.headers,
                                                            json={**body, "model": f"ft:preset:tiny-llama::{job_id}"}),
                           a.job_id, "a chat completion on A's model")


def test_b_gets_a_404_for_a_s_tinker_objects(world):
    """A's Tinker session, training client (registered at once; its replica never starts here, with no Ray),
    sampling session and future, each tried by B on every route that takes it."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    a, b, client = world.a, world.b, world.client
    ha, hb = {"X-API-Key": "tml-" + a.key}, {"X-API-Key": "tml-" + b.key}
    sid = client.post("/api/v1/create_session", headers=ha, json={"tags": []}).json()["session_id"]
    model = client.post("/api/v1/create_model", headers=ha, json={"session_id": sid, "base_model": "preset:tiny-llama"}).json()
    mid, fid = model["model_id"], model["request_id"]
    ssid = client.post("/api/v1/create_sampling_session", headers=ha,
                       json={"session_id": sid, "base_model": "preset:tiny-llama"}).json()["sampling_session_id"]
    adam = {"learning_rate": 1e-3}

    def fwd_bwd(model_id):
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})], loss_fn="cross_entropy"),
            model_id=model_id, seq_id=1)
        return client.post("/api/v1/forward_backward", headers={**hb, "content-type": "application/x-protobuf"},
                           content=forward_backward_request_to_proto(req).SerializeToString())

    tries = {
        mid: [lambda x: client.post("/api/v1/get_info", headers=hb, json={"model_id": x}),
              lambda x: client.post("/api/v1/optim_step", headers=hb, json={"model_id": x, "adam_params": adam}),
              lambda x: client.post("/api/v1/save_weights", headers=hb, json={"model_id": x, "path": "b"}),
              lambda x: client.post("/api/v1/save_weights_for_sampler", headers=hb, json={"model_id": x, "path": "b"}),
              lambda x: client.get(f"/api/v1/training_clients/{x}/memory", headers=hb), fwd_bwd],
        sid: [lambda x: client.post("/api/v1/session_heartbeat", headers=hb, json={"session_id": x}),
              lambda x: client.post(f"/api/v1/sessions/{x}/finish", headers=hb, json={}),
              lambda x: client.post("/api/v1/create_model", headers=hb, json={"session_id": x, "base_model": "preset:tiny-llama"}),
              lambda x: client.post("/api/v1/create_sampling_session", headers=hb, json={"session_id": x, "base_model": "preset:tiny-llama"})],
        ssid: [lambda x: client.get(f"/api/v1/samplers/{x}", headers=hb),
               lambda x: client.post("/api/v1/asample", headers=hb, json={"sampling_session_id": x, "prompt": {"chunks": [
                   {"type": "encoded_text", "tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}})],
        fid: [lambda x: client.post("/api/v1/retrieve_future", headers=hb, json={"request_id": x})],
    }
    for real, sends in tries.items():
        for i, send in enumerate(sends):
            assert_same_as_unknown(send, real, f"Tinker route #{i} with A's {real.split('-')[0]} id and B's key")
    # A's objects still answer A
    assert client.post("/api/v1/get_info", headers=ha, json={"model_id": mid}).status_code == 200
    assert client.post("/api/v1/session_heartbeat", headers=ha, json={"session_id": sid}).status_code == 200
    assert client.get(f"/api/v1/samplers/{ssid}", headers=ha).status_code == 200


def test_ingest_with_another_job_s_token_or_a_tenant_key(world):
    a, b = world.a, world.b
    body = {"records": [{"kind": "event", "attempt": 1, "time": time.time(), "message": "from B"}]}
    for credential in (b.token, b.key):
        assert_same_as_unknown(
            lambda job_id: world.client.post(f"/v1/internal/jobs/{job_id}/ingest", headers=bearer(credential),
                                             json=body),
            a.job_id, "ingest into A's job with B's credential")
    r = world.client.post(f"/v1/internal/jobs/{a.job_id}/ingest", json=body)
    assert r.status_code == 401  # no token: refused before the job is looked up


def test_a_s_ids_inside_b_s_requests_are_unknown(world):
    a, b, client = world.a, world.b, world.client
    for param in ("training_file", "validation_file"):
        body = {"model": "preset:tiny-llama", "training_file": b.file_id}
        assert_same_as_unknown(
            lambda file_id: client.post(JOB, headers=b.headers, json={**body, param: file_id}),
            a.file_id, f"create a job with A's file as {param}")

    def cursor(url, real):
        fake = _unknown(real)
        theirs = client.get(url + real, headers=b.headers)
        nobody = client.get(url + fake, headers=b.headers)
        assert theirs.status_code == 422 and theirs.json()["code"] == "invalid_cursor", theirs.text
        assert theirs.text.replace(real, fake) == nobody.text

    cursor(f"{JOB}?after=", a.job_id)
    cursor("/v1/files?after=", a.file_id)
    cursor(f"{JOB}/{b.job_id}/checkpoints?after=", a.checkpoint_id)

    # A's Idempotency-Key is B's to use: no replay of A's job, no "reused with another body".
    r = client.post(JOB, headers={**b.headers, "Idempotency-Key": a.idempotency_key},
                    json={"model": "preset:tiny-llama", "training_file": b.file_id})
    assert r.status_code == 200 and r.headers.get("Idempotent-Replayed") is None, r.text
    assert r.json()["organization_id"] == b.id
    assert_nothing_of(a, r.text, "a job B created with A's Idempotency-Key")


def test_listings_show_nothing_of_a(world):
    a, b, client, cookie_b = world.a, world.b, world.client, world.cookie_b
    files = client.get("/v1/files?limit=100", headers=b.headers)
    jobs = client.get(f"{JOB}?limit=100", headers=b.headers)
    assert files.status_code == jobs.status_code == 200
    assert b.file_id in {f["id"] for f in files.json()["data"]}
    assert a.job_id not in {j["id"] for j in jobs.json()["data"]} and b.job_id in {j["id"] for j in jobs.json()["data"]}
    filtered = client.get(f"{JOB}?metadata[project]={a.metadata_value}", headers=b.headers)
    assert filtered.status_code == 200 and filtered.json()["data"] == []
    answers = {
        "GET /v1/files": files, "GET /v1/fine_tuning/jobs": jobs, "metadata filter": filtered,
        "status filter": client.get(f"{JOB}?status=running", headers=b.headers),
        "B's job": client.get(f"{JOB}/{b.job_id}", headers=b.headers),
        "B's events": client.get(f"{JOB}/{b.job_id}/events?limit=100", headers=b.headers),
        "B's checkpoints": client.get(f"{JOB}/{b.job_id}/checkpoints", headers=b.headers),
        "B's memory": client.get(f"{JOB}/{b.job_id}/memory", headers=b.headers),
        "B's artifacts": client.get(f"{JOB}/{b.job_id}/artifacts", headers=b.headers),
        "B's upload": client.post("/v1/files", headers=b.headers, files={"file": ("x.jsonl", CHAT_JSONL)},
                                  data={"purpose": "fine-tune"}),
        "B's plan": client.post("/v1/memory/plan", headers=b.headers, json={"model": "preset:tiny-llama"}),
        "/ui/jobs (cookie)": cookie_b.get("/ui/jobs"),
        "/ui/jobs?status=running (cookie)": cookie_b.get("/ui/jobs?status=running"),
        "/ui/jobs/{B's job} (cookie)": cookie_b.get(f"/ui/jobs/{b.job_id}"),
        "view.json of B's job (cookie)": cookie_b.get(f"/ui/jobs/{b.job_id}/view.json"),
        "memory.json of B's job (cookie)": cookie_b.get(f"/ui/jobs/{b.job_id}/memory.json"),
        "/ui/planner (cookie)": cookie_b.get("/ui/planner"),
        "GET /v1/models": client.get("/v1/models", headers=b.headers),
        "/ui/models (cookie)": cookie_b.get("/ui/models"),
        "/ui/planner POST (cookie)": cookie_b.post("/ui/planner", data={"model": "preset:tiny-llama"}),
    }
    for where, r in answers.items():
        assert r.status_code < 500, f"{where}: {r.status_code}"
        assert_nothing_of(a, r.text, where)
    jobs_page = answers["/ui/jobs (cookie)"]
    assert jobs_page.status_code == 200 and b.job_id in jobs_page.text
    # B's count of running jobs is B's own: one.
    assert [j["id"] for j in answers["status filter"].json()["data"]] == [b.job_id]


def test_public_routes_show_nothing_of_a(world):
    a, client = world.a, world.client
    for method, template, _ in [k for k, v in ROUTES.items() if v["kind"] == "public"]:
        url = "/ui/static/dashboard.css" if template == "/ui/static" else template
        data = {"api_key": "mf_wrong-key"} if (method, template) == ("POST", "/ui/login") else None
        r = client.request(method, url, data=data, follow_redirects=False)
        assert r.status_code < 500, f"{method} {template}: {r.status_code}"
        assert_nothing_of(a, r.text, f"{method} {template}")
        assert_nothing_of(a, " ".join(f"{k}: {v}" for k, v in r.headers.items()), f"{method} {template} headers")


def test_metrics_carry_a_s_job_id_only_as_the_memory_gauge_label(world):
    a = world.a
    text = world.client.get("/metrics", headers=world.b.headers).text
    for line in text.splitlines():
        if a.job_id in line:
            assert re.match(rf'^memfit_job_peak_memory_bytes\{{job_id="{a.job_id}",rank="\d+"\}} ', line), line
    others = [s for s in a.secrets if s != a.job_id]
    assert_nothing_of(Tenant(name="", id="", key="", secrets=others), text, "/metrics")


def test_the_dashboard_needs_a_valid_login(world):
    a, b = world.a, world.b
    with TestClient(world.app) as anonymous:
        r = anonymous.get(f"/ui/jobs/{a.job_id}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")  # no 404-vs-200 tell
        assert anonymous.get(f"/ui/jobs/{a.job_id}/view.json").status_code == 401
        assert anonymous.get(f"{JOB}/{a.job_id}/events?stream=true").status_code == 401
        anonymous.cookies.set(COOKIE, "mfs_forged-session")
        assert anonymous.get(f"/ui/jobs/{a.job_id}/memory.json").status_code == 401
        r = anonymous.post("/ui/login", data={"api_key": "mf_wrong", "next": "https://evil.example/"},
                           follow_redirects=False)
        assert r.status_code == 401 and COOKIE not in r.cookies
        r = anonymous.post("/ui/login", data={"api_key": b.key, "next": "//evil.example/ui"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/jobs"  # no open redirect
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        # The header wins over the cookie: B's cookie with A's key in the header reads as A.
        assert anonymous.get(f"/ui/jobs/{a.job_id}/view.json", headers=a.headers).status_code == 200
        assert anonymous.get(f"/ui/jobs/{a.job_id}/view.json").status_code == 404
        anonymous.post("/ui/logout")
        assert anonymous.get(f"/ui/jobs/{b.job_id}/view.json").status_code == 401


def test_a_s_objects_are_unchanged(world):
    """Runs last in this module: nothing B tried changed A's job or file."""
    a, client = world.a, world.client
    job = client.get(f"{JOB}/{a.job_id}", headers=a.headers).json()
    assert job["status"] == "running" and job["desired_state"] is None, job
    assert client.get(f"/v1/files/{a.file_id}", headers=a.headers).status_code == 200
    assert client.get(f"/v1/files/{a.file_id}/content", headers=a.headers).text == CHAT_JSONL
    events = client.get(f"{JOB}/{a.job_id}/events?limit=100", headers=a.headers).json()["data"]
    assert not [e for e in events if "from B" in e["message"]]
    art = client.get(f"{JOB}/{a.job_id}/artifacts/adapter/adapter_config.json", headers=a.headers)
    assert art.status_code == 200 and art.text == '{"r": 8}'
