"""Schemathesis over the app's own /openapi.json, against the real app on a real Postgres database.

Every check schemathesis has runs on every documented operation (positive and negative data), once
with a tenant's API key and once with none, plus the stateful phase over the links schemathesis infers
from the responses (upload a file → get/delete it, create a job → get/cancel/pause/its events...).
A failure is a bug in the app or in its OpenAPI document: a 5xx, a body or header that does not match
the documented schema, a status code the operation does not document, a bad input accepted...

The number of examples is bounded (MAX_EXAMPLES) so the file runs in CI in a couple of minutes; a
developer hunting for bugs can raise it with MEMFIT_SCHEMATHESIS_EXAMPLES.
"""

from __future__ import annotations

import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the [dev] extra")
from schemathesis.engine import Status, events  # noqa: E402

from tests.factories import bearer, create_job, new_key, upload  # noqa: E402
from tests.scheduler_support import app_without_ray  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("MEMFIT_SCHEMATHESIS_EXAMPLES", "8"))
STATEFUL_STEPS = int(os.environ.get("MEMFIT_SCHEMATHESIS_STEPS", "8"))


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    # The rate limiter off: schemathesis sends hundreds of requests a second, and a 429 (documented,
    # tested in tests/test_limits.py) would stand in for the response it means to check.
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage"), rate_limit_enabled=False) as stack:
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
        {"kind": "checkpoint", "attempt": 1, "time": now, "step": 1, "path": "/x/checkpoint_000001",
         "metrics": {"loss": 2.5}},
    ]})
    assert r.status_code == 200, r.text
    return key


def run_schemathesis(app, headers: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Every phase (examples, coverage, fuzzing, stateful) and every check, as `schemathesis run` does.
    Returns the failures, each with the response and the curl command that reproduces it, and how
    each phase ended (so a phase that silently did nothing fails the test too)."""
    config = schemathesis.Config.from_dict({
        "headers": headers,
        "seed": 14,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
        "checks": {"enabled": True},
        "phases": {"stateful": {"max-steps": STATEFUL_STEPS}},
        "max-failures": 50,
        "operations": [
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
            {   # `after` is a cursor: the id of an object on the previous page, which must exist (422).
                "include-name-regex": "^GET /v1/(files|fine_tuning/jobs(/[^/]+/(events|checkpoints))?)$",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404", "422"]}},
            },
        ],
    })
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
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
    failures, phases = run_schemathesis(env[0], bearer(tenant_key))
    assert not failures, f"{len(failures)} schemathesis failures:\n" + "\n".join(failures)
    # Each phase ran (the examples phase has nothing to run: the document carries no examples), the
    # stateful one over links it inferred (upload → get/delete the file, create → act on the job).
    assert {phases.get(p) for p in ("coverage", "fuzzing", "stateful")} == {"success"}, phases
    assert phases["stateful_transitions"] > 0, phases


def test_without_a_key(env):
    failures, phases = run_schemathesis(env[0], {})
    assert not failures, f"{len(failures)} schemathesis failures:\n" + "\n".join(failures)
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
