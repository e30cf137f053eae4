"""Schemathesis over the app's own /openapi.json, against the real app on a real Postgres database.

Every check schemathesis has runs on every documented operation (positive and negative data), once
with a tenant's API key and once with none, plus the stateful phase over the links schemathesis infers
from the responses (upload a file → get/delete it, create a job → get/cancel/pause/its events...).
A failure is a bug in the app or in its OpenAPI document: a 5xx, a body or header that does not match
the documented schema, a status code the operation does not document, a bad input accepted...

Deeper (issue 37, item 8): the rate limiter is on (at rates the fuzzing does not reach, so every
request goes through it and a 429 would still be documented); the dashboard's form routes (/ui:
login, logout, the planner form, the pages and their JSON — outside /openapi.json, so described by
:data:`UI_DOC`) and the workers' ingest with a valid ingest token are fuzzed too; and the seed is
random, printed, and taken from MEMFIT_SCHEMATHESIS_SEED to replay a run. Every finding is fixed and
pinned below as a regression test.

The number of examples is bounded (MAX_EXAMPLES) so the file runs in CI in a few minutes; a
developer hunting for bugs can raise it with MEMFIT_SCHEMATHESIS_EXAMPLES.
"""

from __future__ import annotations

import os
import random
import time

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the [dev] extra")

pytestmark = pytest.mark.slow  # trains or fuzzes: not in `make test-fast`
from schemathesis.engine import Status, events  # noqa: E402

from tests.factories import bearer, create_job, new_key, upload  # noqa: E402
from tests.scheduler_support import app_without_ray  # noqa: E402

# Tinker's forward_backward body is protobuf (api/routes/tinker.py): sent as the fuzzer's bytes, as binary is.
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")

MAX_EXAMPLES = int(os.environ.get("MEMFIT_SCHEMATHESIS_EXAMPLES", "15"))
STATEFUL_STEPS = int(os.environ.get("MEMFIT_SCHEMATHESIS_STEPS", "10"))
SEED = int(os.environ.get("MEMFIT_SCHEMATHESIS_SEED") or random.randrange(2**31))
# The limiter on, at rates schemathesis does not reach: its code runs on every request (429s are
# documented and tested in tests/test_limits.py; one here would stand in for the response under test).
LIMITS = {"rate_limit_enabled": True, "rate_limit_key_per_s": 100_000, "rate_limit_key_burst": 1_000_000,
          "rate_limit_ip_per_s": 100_000, "rate_limit_ip_burst": 1_000_000, "rate_limit_ingest_per_s": 100_000,
          "rate_limit_ingest_burst": 1_000_000}


def replay_hint() -> str:
    return f"schemathesis seed {SEED}: replay with MEMFIT_SCHEMATHESIS_SEED={SEED}"


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    print(replay_hint())
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage"), **LIMITS) as stack:
        yield stack


@pytest.fixture(scope="module")
def tenant_key(env):
    """A tenant with a file and a running job that has metrics, a memory sample and a checkpoint, so
    the read routes have real objects behind the ids the stateful phase finds."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    token = {job_id: t for job_id, _, t in sched.claim(limit=100)}[job["id"]]
    now = time.time()
    r = client.post(f"/v1/internal/jobs/{job['id']}/ingest", headers=bearer(token), json={"records": [
        {"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": 1, "total_steps": 4, "loss": 2.5},
        {"kind": "memory", "attempt": 1, "time": now, "rank": 0, "step": 1, "parameters_bytes": 1000,
         "peak_bytes": 4000},
        {"kind": "checkpoint", "attempt": 1, "time": now, "step": 1, "path": "ray/x/checkpoint_000001",
         "metrics": {"loss": 2.5}},
    ]})
    assert r.status_code == 200, r.text
    return key


def run_schemathesis(app, headers: dict[str, str], doc: dict | None = None, operations: list | None = None,
                     checks: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """Every phase (examples, coverage, fuzzing, stateful) and every check, as `schemathesis run` does.
    Returns the failures, each with the response and the curl command that reproduces it, and how
    each phase ended (so a phase that silently did nothing fails the test too)."""
    config = schemathesis.Config.from_dict({
        "headers": headers,
        "seed": SEED,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
        "checks": checks or {"enabled": True},
        "phases": {"stateful": {"max-steps": STATEFUL_STEPS}},
        "max-failures": 50,
        "operations": operations or [
            # positive_data_acceptance expects every schema-valid request to be accepted. These
            # operations take values whose validity JSON Schema cannot express, so a schema-valid
            # request can rightly be a 400/422 (each named below); every other check still runs on them.
            {   # a file must be JSONL chat/prompt-completion/text rows: a PNG is schema-valid, and a 400.
                "include-name": "POST /v1/files",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401", "422"]}},
            },
            {   # the spec's cross-field rules (service.domain.spec), the model reference resolving,
                # training_file naming an uploaded file of this tenant, gpu naming a catalogue GPU.
                "include-name": ["POST /v1/fine_tuning/jobs", "POST /v1/memory/plan"],
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404", "409", "422"]}},
            },
            {   # a model id must name one of the tenant's models (404); max_tokens has a cap and a prompt a context
                # (400); no Ray Serve in this app: a generation for a real model (the fuzzer finds preset:… in
                # GET /v1/models) is the documented 503 serving_unavailable, so not_a_server_error is off for these
                # two routes alone (status_code_conformance still fails any 500: it is not documented).
                "include-name-regex": "^POST /v1/(chat/)?completions$",
                "checks": {"not_a_server_error": {"enabled": False}, "positive_data_acceptance": {
                    "expected-statuses": ["2xx", "400", "401", "404", "422", "429", "503"]}},
            },
            {   # another tenant's or an unknown model is a 404; a base model cannot be deleted (403)
                "include-name-regex": "^(GET|DELETE) /v1/models/\\{model_id\\}$",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "403", "404", "422"]}},
            },
            {   # Tinker's API (api/routes/tinker.py): ids of sessions, clients and futures that must exist (404), bodies
                # whose rules JSON Schema cannot say (a tinker:// path, a sample's session or model, forward_backward's
                # protobuf): 400
                "include-name-regex": "^(GET|POST) /api/v1/",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401", "404", "422"]}},
            },
            {   # `after` is a cursor: the id of an object on the previous page, which must exist (422).
                "include-name-regex": "^GET /v1/(files|fine_tuning/jobs(/[^/]+/(events|checkpoints))?)$",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404", "422"]}},
            },
        ],
    })
    if doc is None:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    else:  # routes outside /openapi.json (the dashboard's), described by the test
        schema = schemathesis.openapi.from_dict(doc, config=config)
        schema.app = app
    found, phases = [], {}
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.PhaseStarted) and event.payload is not None:  # the stateful phase
            phases["stateful_transitions"] = event.payload.transitions_selected
        elif isinstance(event, events.PhaseFinished):
            phases[event.phase.name.value] = event.status.value
        elif isinstance(event, events.ScenarioFinished) and event.status == Status.FAILURE:
            for case_id, checks in event.recorder.checks.items():
                interaction = event.recorder.interactions.get(case_id)
                response = interaction.response if interaction is not None else None
                answer = f"{response.status_code} {response.content[:300]!r}" if response is not None else "-"
                for check in checks:
                    if check.failure_info is not None:
                        f = check.failure_info
                        found.append(f"{event.phase.value} {event.recorder.label}: {check.name}: "
                                     f"{f.failure.title}: {f.failure.message}\n    -> {answer}\n    {f.code_sample}")
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            found.append(f"error: {event.__class__.__name__}: {getattr(event, 'value', None) or event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            found.extend(f"after run: {f.title}: {f.message}" for f in event.failures)
    return sorted(set(found)), phases


def test_with_a_key(env, tenant_key):
    # the Tinker routes take the key as the tinker SDK sends it (X-API-Key: tml-…), the others as a bearer token
    failures, phases = run_schemathesis(env[0], {**bearer(tenant_key), "X-API-Key": "tml-" + tenant_key})
    assert not failures, f"{len(failures)} schemathesis failures ({replay_hint()}):\n" + "\n".join(failures)
    # Each phase ran (the examples phase has nothing to run: the document carries no examples), the
    # stateful one over links it inferred (upload → get/delete the file, create → act on the job).
    assert {phases.get(p) for p in ("coverage", "fuzzing", "stateful")} == {"success"}, phases
    assert phases["stateful_transitions"] > 0, phases


def test_without_a_key(env):
    failures, phases = run_schemathesis(env[0], {})
    assert not failures, f"{len(failures)} schemathesis failures ({replay_hint()}):\n" + "\n".join(failures)
    assert {phases.get(p) for p in ("coverage", "fuzzing")} == {"success"}, phases


def test_the_ingest_with_a_valid_token(env):
    """The workers' route, fuzzed as a worker holding its attempt's token would reach it: records of
    every kind and shape, paths of every form (refused outside the attempt's folder), a result or a
    failure ending the job (then 409), stale attempts (409)."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    token = {job_id: t for job_id, _, t in sched.claim(limit=100)}[job["id"]]
    ingest_only = [{"include-name-regex": "^POST /v1/internal/", "parameters": {"path.job_id": job["id"]},
                    "checks": {"positive_data_acceptance": {
        # a schema-valid batch can still be refused: a path outside the run's folder (422), a stale
        # attempt or a job a result already ended (409)
        "expected-statuses": ["2xx", "404", "409", "422"]}}},
                   {"exclude-name-regex": "^POST /v1/internal/", "enabled": False}]
    failures, phases = run_schemathesis(app, bearer(token), operations=ingest_only)
    assert not failures, f"{len(failures)} schemathesis failures ({replay_hint()}):\n" + "\n".join(failures)
    assert {phases.get(p) for p in ("coverage", "fuzzing")} == {"success"}, phases


# The dashboard's routes, outside /openapi.json (include_in_schema=False): described here so that
# schemathesis fuzzes their forms and parameters too. HTML answers, redirects to the login, problems.
_HTML = {"text/html": {"schema": {"type": "string"}}}
_PROBLEM = {"application/problem+json": {"schema": {"type": "object"}}}
_JSON = {"application/json": {"schema": {"type": "object"}}}
_REDIRECT = {"description": "to the login page, or where the form leads", "headers": {
    "location": {"schema": {"type": "string"}}}}


def _form(properties: dict, required: list[str]) -> dict:
    return {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "properties": properties, "required": required}}}}


_PLANNER_FIELDS = {name: {"type": "string"} for name in (
    "model", "gpu", "strategy", "peft", "lora_r", "precision", "gradient_checkpointing", "micro_batch_size",
    "max_seq_length", "num_workers", "zero_stage", "offload")}
UI_DOC = {
    "openapi": "3.1.0",
    "info": {"title": "memfit dashboard", "version": "0.1.0"},
    "paths": {
        "/ui/login": {
            "get": {"parameters": [{"name": "next", "in": "query", "schema": {"type": "string"}},
                                   {"name": "error", "in": "query", "schema": {"type": "string"}}],
                    "responses": {"200": {"description": "the form", "content": _HTML},
                                  "401": {"description": "the form, with the error", "content": _HTML},
                                  "422": {"description": "bad parameters", "content": _PROBLEM}}},
            "post": {"requestBody": _form({"api_key": {"type": "string"}, "next": {"type": "string"}}, ["api_key"]),
                     "responses": {"303": _REDIRECT, "401": {"description": "refused", "content": _HTML},
                                   "422": {"description": "bad form", "content": _PROBLEM}}},
        },
        "/ui/logout": {"post": {"responses": {"303": _REDIRECT}}},
        "/ui/jobs": {"get": {"parameters": [{"name": "status", "in": "query", "schema": {"type": "string"}}],
                             "responses": {"200": {"description": "the list", "content": _HTML}, "303": _REDIRECT,
                                           "422": {"description": "bad parameters", "content": _PROBLEM}}}},
        "/ui/jobs/{job_id}": {"get": {
            "parameters": [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the page", "content": _HTML}, "303": _REDIRECT,
                          "404": {"description": "no such job", "content": _PROBLEM},
                          "422": {"description": "bad parameters", "content": _PROBLEM}}}},
        "/ui/jobs/{job_id}/memory.json": {"get": {
            "parameters": [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "after_id", "in": "query", "schema": {"type": "integer"}}],
            "responses": {"200": {"description": "samples", "content": _JSON},
                          **{c: {"description": "refused", "content": _PROBLEM} for c in ("401", "404", "422")}}}},
        "/ui/planner": {
            "get": {"responses": {"200": {"description": "the form", "content": _HTML}, "303": _REDIRECT}},
            "post": {"requestBody": _form(_PLANNER_FIELDS, []),
                     "responses": {"200": {"description": "the plan", "content": _HTML},
                                   "422": {"description": "the form's errors", "content": _HTML}, "303": _REDIRECT}},
        },
    },
}


@pytest.mark.parametrize("who", ["logged in", "anonymous"])
def test_the_dashboard_forms(env, tenant_key, who):
    headers = bearer(tenant_key) if who == "logged in" else {}
    checks = {"enabled": False, "not_a_server_error": {"enabled": True}, "status_code_conformance": {"enabled": True},
              "content_type_conformance": {"enabled": True}}
    failures, phases = run_schemathesis(env[0], headers, doc=UI_DOC, operations=[{"include-path-regex": "^/ui", "enabled": True}],
                                        checks=checks)
    assert not failures, f"{len(failures)} schemathesis failures ({replay_hint()}):\n" + "\n".join(failures)
    assert {phases.get(p) for p in ("coverage", "fuzzing")} == {"success"}, phases


# --- what schemathesis found, pinned down (each was a failure above before its fix) -------------


def test_a_nul_character_is_a_4xx_not_a_500(env, tenant_key):
    """Postgres text cannot hold U+0000: psycopg's DataError was an unhandled 500. An id with one is
    an unknown object (never looked up); a NUL anywhere else the database would refuse is a 422."""
    client = env[1]
    r = client.post("/v1/fine_tuning/jobs", headers=bearer(tenant_key),
                    json={"model": "preset:tiny-llama", "training_file": "file-\u0000x"})
    assert r.status_code == 404 and r.json()["code"] == "file_not_found", r.text
    assert r.headers["content-type"] == "application/problem+json"
    file_id = upload(client, tenant_key)
    r = client.post("/v1/fine_tuning/jobs", headers=bearer(tenant_key),
                    json={"model": "preset:tiny-llama", "training_file": file_id, "metadata": {"k": "a\u0000b"}})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"


def test_405_allows_every_method_of_the_path(env, tenant_key):
    """GET and DELETE /v1/files/{id} are two routes: Starlette's Allow named only the first."""
    client = env[1]
    r = client.put("/v1/files/file-x", headers=bearer(tenant_key))
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert client.patch("/v1/fine_tuning/jobs").headers["allow"] == "GET, POST"


def test_error_statuses_are_documented_as_problems(env):
    doc = env[1].get("/openapi.json").json()
    op = doc["paths"]["/v1/fine_tuning/jobs/{job_id}/cancel"]["post"]["responses"]
    assert set(op) == {"200", "401", "404", "409", "422", "429", "503"}
    assert op["404"]["content"] == {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    assert {"type", "title", "status", "detail", "code", "error"} <= set(doc["components"]["schemas"]["Problem"]["required"])
    # An ingest record is told apart by `kind`: the document says a posted record needs it.
    assert "kind" in doc["components"]["schemas"]["MetricsRecord"]["required"]


def test_a_boolean_is_not_a_number_in_an_ingest_record(env):
    """Found by fuzzing the ingest with a valid token: pydantic's lax mode stored `"step": false` as
    step 0 (and `"time": true` as 1.0). A JSON boolean where a record has a number is a 422 naming it."""
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))
    sched.validate_pending()
    token = {job_id: t for job_id, _, t in sched.claim(limit=100)}[job["id"]]
    for field, value in (("step", False), ("time", True), ("attempt", True), ("rank", False)):
        record = {"kind": "failure", "attempt": 1, "time": 0.0, "code": "", "message": "", "step": 3, "rank": 0}
        record[field] = value
        r = client.post(f"/v1/internal/jobs/{job['id']}/ingest", headers=bearer(token), json={"records": [record]})
        assert r.status_code == 422 and r.json()["param"].endswith(field), (field, r.text)
    r = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bearer(key))
    assert r.json()["status"] == "running"  # none of them ended the job
