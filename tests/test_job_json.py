"""GET job and the job list build their answer in one pass from the row (api/schemas.py job_json,
jobs_page_json; service.jobs.crud read_job, read_jobs): held here to JobPublic's own rendering
(api.schemas.job_public, which the create and action routes answer with) on jobs in every shape a
job's row can take — every status, an error, a memory summary, a plan without one, SQL NULL and JSON
null in the JSON columns, result files, metadata, 'auto' and explicit hyperparameters, integrations —
and counted: one statement per request once the key is known, on Postgres and on SQLite."""

from __future__ import annotations

import contextvars
from datetime import timedelta

import pytest
from sqlalchemy import event, null, update

from api.schemas import SPEC_VIEWS, job_public
from service.domain.states import JobStatus
from service.store.db import session_scope
from service.store.models import Job, utcnow
from tests.factories import upload

JOBS = "/v1/fine_tuning/jobs"

# Each: the row's fields after create (set in the database directly, as the scheduler and ingest would).
SHAPES = {
    "queued": {"status": JobStatus.queued.value},
    "running": {"status": JobStatus.running.value, "attempt": 1, "estimated_finish": "soon",
                "memory_summary": {"measured": {"peak_bytes": 123456789, "ranks": [0, 1]}, "ratio": 0.97}},
    "succeeded": {"status": JobStatus.succeeded.value, "attempt": 2, "finished_at": "now",
                  "fine_tuned_model": "ft:tiny:acme:abc", "trained_tokens": 4096,
                  "result_files": ["file-result1", "file-result2"]},
    "failed": {"status": JobStatus.failed.value, "attempt": 1, "finished_at": "now",
               "error": {"code": "oom", "message": "CUDA out of memory", "rank": 1, "step": 7, "phase": "backward",
                         "details": {"where": {"activations_bytes": 1}}, "unknown_extra": "dropped"}},
    "cancelled, pause pending": {"status": JobStatus.cancelled.value, "desired_state": "cancel", "finished_at": "now"},
    "paused": {"status": JobStatus.paused.value, "desired_state": None},
    "plan, no summary (SQL NULL)": {"memory_summary": null()},
    "plan, no summary (JSON null)": {"memory_summary": None},
    "neither plan nor summary": {"memory_summary": null(), "plan": null()},
    "empty error, JSON null result files": {"error": {}, "result_files": None},
}


def _set(s, job_id: str, fields: dict) -> None:
    now = utcnow()
    values = {k: (now + timedelta(hours=1) if v == "soon" else now if v == "now" else v) for k, v in fields.items()}
    s.execute(update(Job).where(Job.id == job_id).values(**values))


@pytest.fixture
def jobs_of_every_shape(client, api_app, make_tenant):
    tenant = make_tenant()
    file_id = upload(client, tenant.key)
    made = {}
    bodies = [
        {},
        {"suffix": "sfx", "metadata": {"team": "nlp", "ünïcode": "✓"}, "seed": 7},
        {"hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 0.5}},
        {"integrations": [{"type": "wandb", "wandb": {"project": "p", "tags": ["a"]}}],
         "training": {"peft": {"method": "lora"}}},
    ]
    for i, (name, fields) in enumerate(SHAPES.items()):
        r = client.post(JOBS, headers=tenant.headers, json={"model": "preset:tiny-llama", "training_file": file_id,
                                                            **bodies[i % len(bodies)]})
        assert r.status_code == 200, r.text
        made[name] = r.json()["id"]
        with session_scope(api_app.state.sessions) as s:
            _set(s, made[name], fields)
    return tenant, made


def expected(api_app, job_id: str) -> dict:
    with api_app.state.sessions() as s:
        return job_public(s.get(Job, job_id)).model_dump(mode="json")


def test_get_job_answers_exactly_what_job_public_renders_for_every_shape(client, api_app, jobs_of_every_shape):
    tenant, made = jobs_of_every_shape
    for name, job_id in made.items():
        for fresh in (True, False):  # the spec read from the row, then the view kept from the first read
            if fresh:
                SPEC_VIEWS._views.pop(job_id, None)
            r = client.get(f"{JOBS}/{job_id}", headers=tenant.headers)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            assert (name, r.json()) == (name, expected(api_app, job_id))
    failed = client.get(f"{JOBS}/{made['failed']}", headers=tenant.headers).json()
    assert failed["error"] == {"code": "oom", "message": "CUDA out of memory", "param": None, "rank": 1, "step": 7,
                               "phase": "backward", "details": {"where": {"activations_bytes": 1}}}
    assert client.get(f"{JOBS}/{made['plan, no summary (JSON null)']}", headers=tenant.headers).json()["memory"].keys() == {"plan"}
    assert client.get(f"{JOBS}/{made['neither plan nor summary']}", headers=tenant.headers).json()["memory"] is None


def test_the_list_answers_what_job_public_renders_page_by_page(client, api_app, jobs_of_every_shape):
    tenant, made = jobs_of_every_shape
    for job_id in list(made.values())[::2]:
        SPEC_VIEWS._views.pop(job_id, None)  # half the page's specs read with it, half kept from before
    pages, after = [], None
    while True:
        r = client.get(JOBS, headers=tenant.headers, params={"limit": 3, **({"after": after} if after else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        pages.append(page)
        assert page["object"] == "list" and len(page["data"]) <= 3
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        assert page["data"] == [expected(api_app, j["id"]) for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    listed = [j["id"] for p in pages for j in p["data"]]
    assert sorted(listed) == sorted(made.values()) and len(listed) == len(set(listed))
    assert listed == [j["id"] for j in client.get(JOBS, headers=tenant.headers, params={"limit": 100}).json()["data"]]
    # filters build their statement per request; the answer is the same shape
    running = client.get(JOBS, headers=tenant.headers, params={"status": "running"}).json()["data"]
    assert [j["id"] for j in running] == [made["running"]] and running[0] == expected(api_app, made["running"])
    tagged = client.get(JOBS, headers=tenant.headers, params={"metadata[team]": "nlp"}).json()["data"]
    assert tagged and all(j["metadata"]["team"] == "nlp" for j in tagged)
    end = client.get(JOBS, headers=tenant.headers, params={"after": listed[-1]}).json()
    assert end["data"] == [] and end["has_more"] is False and end["first_id"] is None


def test_a_row_that_changed_since_its_last_answer_is_rendered_anew(client, api_app, jobs_of_every_shape):
    """GET and the list answer a job's last bytes again only while every field they were made of is
    unchanged (api/schemas.py RenderedJobs): each column the scheduler or ingest writes shows at once."""
    tenant, made = jobs_of_every_shape
    job_id = made["running"]
    path = f"{JOBS}/{job_id}"
    before = client.get(path, headers=tenant.headers).json()
    assert client.get(path, headers=tenant.headers).json() == before  # answered from what was rendered
    changes = [{"trained_tokens": 999}, {"status": JobStatus.succeeded.value, "finished_at": "now"},
               {"memory_summary": {"measured": {"peak_bytes": 1, "ranks": [0]}, "ratio": 1.5}},
               {"metadata_": {"team": "changed"}}, {"error": {"code": "oom", "message": "late"}}]
    for change in changes:
        with session_scope(api_app.state.sessions) as s:
            _set(s, job_id, change)
        got = client.get(path, headers=tenant.headers).json()
        assert got == expected(api_app, job_id) and got != before, change
        listed = client.get(JOBS, headers=tenant.headers, params={"limit": 100}).json()["data"]
        assert next(j for j in listed if j["id"] == job_id) == got, change
        before = got


def test_a_page_polled_again_is_its_last_bytes_only_while_every_row_on_it_is_unchanged(client, api_app,
                                                                                     jobs_of_every_shape):
    """On Postgres an unfiltered page is answered its last bytes while its rows keep their versions
    (api/schemas.py RenderedPages): a change to any job on it — the one that only tells has_more
    included — or a job that moves onto it shows on the next poll; filtered pages are never kept."""
    tenant, made = jobs_of_every_shape
    params = {"limit": 3}
    first = client.get(JOBS, headers=tenant.headers, params=params)
    assert client.get(JOBS, headers=tenant.headers, params=params).content == first.content
    ids = [j["id"] for j in first.json()["data"]]
    for step, job_id in enumerate(ids):
        with session_scope(api_app.state.sessions) as s:
            _set(s, job_id, {"trained_tokens": 1000 + step})
        page = client.get(JOBS, headers=tenant.headers, params=params).json()
        assert [j["trained_tokens"] for j in page["data"]][step] == 1000 + step
        assert page["data"] == [expected(api_app, i) for i in ids]
    # the 4th row is read only to tell has_more: it is part of what the page was made of
    all_ids = [j["id"] for j in client.get(JOBS, headers=tenant.headers, params={"limit": 100}).json()["data"]]
    with session_scope(api_app.state.sessions) as s:
        s.execute(update(Job).where(Job.id.in_(all_ids[3:])).values(created_at=utcnow() - timedelta(days=400)))
        s.execute(update(Job).where(Job.id == all_ids[3]).values(created_at=utcnow() + timedelta(days=1)))
    moved = client.get(JOBS, headers=tenant.headers, params=params).json()
    assert moved["data"][0]["id"] == all_ids[3] and moved["data"][0] == expected(api_app, all_ids[3])
    assert client.get(JOBS, headers=tenant.headers, params=params).json() == moved
    # a filtered page is read whole every time
    running = {"status": JobStatus.running.value}
    assert client.get(JOBS, headers=tenant.headers, params=running).json()["data"][0]["trained_tokens"] != 7
    with session_scope(api_app.state.sessions) as s:
        _set(s, made["running"], {"trained_tokens": 7})
    assert client.get(JOBS, headers=tenant.headers, params=running).json()["data"][0]["trained_tokens"] == 7


def test_an_unknown_or_another_tenants_cursor_is_422_even_on_an_empty_page(client, make_tenant, jobs_of_every_shape):
    tenant, made = jobs_of_every_shape
    other = make_tenant()
    for headers, cursor in ((tenant.headers, "ftjob-nope"), (other.headers, made["queued"])):
        r = client.get(JOBS, headers=headers, params={"after": cursor})
        assert r.status_code == 422 and r.json()["code"] == "invalid_cursor", r.text


_statements: contextvars.ContextVar[list | None] = contextvars.ContextVar("statements", default=None)


def background_key_check(sql: str) -> bool:
    """The key re-check api/deps.py starts in the background past half a key's trust: no request's read."""
    return sql.lstrip().startswith("SELECT") and "FROM api_keys" in sql


@pytest.fixture
def count_statements(api_app):
    """``with count_statements() as sql:`` the statements the app's engine sends meanwhile (their text)."""
    import contextlib

    engine = api_app.state.engine
    observers = api_app.state.reads.observers  # the event-loop reads (Postgres, once the app has started)
    seen: list[str] = []

    # A key found valid is re-checked in the background about twice a second (api/deps.py KeyCheck),
    # whatever the requests: that statement belongs to no request, so it is not counted (a request that
    # checked its key itself would show in the statements it sends: the test asserts none names api_keys).
    def record(conn, cursor, statement, parameters, context, executemany):
        if not background_key_check(statement):
            seen.append(statement)

    def observe(kind, sql):
        if kind == "statement" and not background_key_check(sql):
            seen.append(sql)

    @contextlib.contextmanager
    def counting():
        seen.clear()
        event.listen(engine, "before_cursor_execute", record)
        observers.append(observe)
        try:
            yield seen
        finally:
            event.remove(engine, "before_cursor_execute", record)
            observers.remove(observe)

    return counting


def test_a_get_or_a_page_costs_one_statement_once_the_key_and_the_jobs_are_known(client, count_statements,
                                                                                 jobs_of_every_shape):
    tenant, made = jobs_of_every_shape
    job = f"{JOBS}/{made['succeeded']}"
    assert client.get(job, headers=tenant.headers).status_code == 200  # the key checked, the job's view kept
    assert client.get(JOBS, headers=tenant.headers).status_code == 200
    with count_statements() as sql:
        assert client.get(job, headers=tenant.headers).status_code == 200
    assert len(sql) == 1 and "FROM jobs" in sql[0] and "api_keys" not in sql[0], sql
    with count_statements() as sql:
        page = client.get(JOBS, headers=tenant.headers, params={"limit": 20}).json()
    assert len(page["data"]) == len(made) and len(sql) == 1, sql
    with count_statements() as sql:
        assert client.get(JOBS, headers=tenant.headers, params={"limit": 3, "after": page["data"][2]["id"]}).status_code == 200
    assert len(sql) == 1, sql
    SPEC_VIEWS._views.pop(made["queued"], None)
    with count_statements() as sql:  # a page not answered before (on Postgres an answered one is kept whole)
        assert client.get(JOBS, headers=tenant.headers, params={"limit": 19}).status_code == 200
    assert len(sql) == 2 and "IN" in sql[1], sql  # one job's spec not known: read with a second statement


def test_on_postgres_the_get_and_the_page_are_read_on_the_event_loop(client, api_app, jobs_of_every_shape):
    """service/store/reads.py: on Postgres, once the app has started, GET job and the list go to psycopg
    on the event loop (no worker thread, no engine), the list by row version (service.jobs.crud
    read_jobs); SQLite reads through the engine in a thread."""
    tenant, made = jobs_of_every_shape
    job = f"{JOBS}/{made['succeeded']}"
    assert client.get(job, headers=tenant.headers).status_code == 200
    engine_sql, loop_sql = [], []

    def on_engine(conn, cursor, statement, parameters, context, executemany):
        engine_sql.append(statement)

    def on_loop(kind, sql):
        if kind == "statement":
            loop_sql.append(sql)

    engine = api_app.state.engine
    event.listen(engine, "before_cursor_execute", on_engine)
    api_app.state.reads.observers.append(on_loop)
    try:
        assert client.get(job, headers=tenant.headers).status_code == 200
        first = client.get(JOBS, headers=tenant.headers).json()
        again = client.get(JOBS, headers=tenant.headers).json()
    finally:
        event.remove(engine, "before_cursor_execute", on_engine)
        api_app.state.reads.observers.remove(on_loop)
    assert first == again and len(first["data"]) == len(made)
    # A key past half its trust is re-checked in the background through the engine (api/deps.py), which a
    # loaded machine reaches within these three requests: that check is not a read of the jobs.
    engine_sql = [q for q in engine_sql if not background_key_check(q)]
    # The fixture moved the jobs to their states behind the API's back, after their views were made
    # (at create): the first page reads the specs of those whose (attempt, queued) moved since — a spec
    # changes only with that (service/jobs/crud.py spec_version: an out-of-memory downshift) — once.
    if engine.dialect.name == "postgresql":
        # GET: one statement. The page: its (id, version) pairs, then the rows not yet held at that
        # version (all of them, the first time); polled again, the pairs alone. The moved specs: one
        # statement through the engine (an expanding IN list, crud.read_specs).
        assert len(loop_sql) == 4, loop_sql
        assert "AS version" in loop_sql[1] and "ANY" in loop_sql[2] and "AS version" in loop_sql[3]
        assert len(engine_sql) == 1 and "spec_json" in engine_sql[0], engine_sql
    else:
        assert (len(loop_sql), len(engine_sql)) == (0, 4), engine_sql
        # (every read of a job names a spec_json column; only a spec read fills it from jobs.spec)
        assert sum("CAST(jobs.spec AS" in q for q in engine_sql) == 1, engine_sql
