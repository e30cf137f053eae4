"""The API's cache of authenticated keys (service.store.auth.KeyCache behind api.deps.KeyCheck), on a
real app and Postgres: a key revoked by another process (`memfit keys revoke`, a subprocess) is
refused by every request that starts ``KEY_TRUST_S`` after the revocation committed; one revoked in
this process at once; a key's tenant never answers for another key (another tenant's, or one sharing
its prefix); concurrent first requests of a key check it once; a busy key is re-checked in the
background and a revocation found that way drops it; refusals are never cached."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import event, update
from starlette.testclient import TestClient

from api.deps import KeyCheck
from service.domain.errors import Unauthorized
from service.store import auth, db
from service.store.models import ApiKey, utcnow
from tests.factories import bearer, create_job, new_tenant, settings_for, upload

ROOT = Path(__file__).resolve().parent.parent
JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture(scope="module")
def served(pg_migrated, tmp_path_factory):
    from api.app import create_app

    app = create_app(settings_for(pg_migrated, tmp_path_factory.mktemp("storage")))
    with TestClient(app) as client:
        yield app, client
    app.state.engine.dispose()


def key_statements(engine):
    """A list that fills with the SELECTs from api_keys sent to ``engine`` (until the returned stop())."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT") and "FROM api_keys" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return seen, lambda: event.remove(engine, "before_cursor_execute", record)


def test_a_key_revoked_by_another_process_is_refused_once_its_trust_has_run_out(served, pg_migrated, tmp_path):
    app, client = served
    tenant = new_tenant(app.state.sessions)
    job = create_job(client, tenant.key, upload(client, tenant.key))["id"]
    assert client.get(f"{JOBS}/{job}", headers=tenant.headers).status_code == 200
    seen, stop = key_statements(app.state.engine)
    try:
        assert client.get(f"{JOBS}/{job}", headers=tenant.headers).status_code == 200
    finally:
        stop()
    assert seen == []  # answered from the cache: without it this test would prove nothing

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": pg_migrated,
           "MEMFIT_STORAGE_DIR": str(tmp_path / "cli-storage")}
    revoked = subprocess.run([sys.executable, "-m", "service.cli.main", "keys", "revoke", tenant.prefix],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    committed_by = time.monotonic()  # the CLI has exited: its transaction committed before this
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr

    # Requests that start within KEY_TRUST_S may still be answered from the cache; every one that
    # starts later must be refused. Poll until a refusal, then keep on past the trust window.
    answers = []
    deadline = committed_by + auth.KEY_TRUST_S + 60
    while time.monotonic() < deadline:
        started = time.monotonic()
        r = client.get(f"{JOBS}/{job}", headers=tenant.headers)
        answers.append((started - committed_by, r.status_code))
        if r.status_code == 401 and started > committed_by + auth.KEY_TRUST_S:
            assert r.json()["code"] == "revoked_api_key"
            break
        time.sleep(0.05)
    late = [(t, code) for t, code in answers if t >= auth.KEY_TRUST_S]
    assert late and all(code == 401 for _, code in late), answers
    assert all(code in (200, 401) for _, code in answers), answers
    first_refusal = next(i for i, (_, code) in enumerate(answers) if code == 401)
    assert all(code == 401 for _, code in answers[first_refusal:]), answers  # once refused, never served again


def test_a_key_revoked_in_this_process_is_refused_at_once(served):
    app, client = served
    tenant = new_tenant(app.state.sessions)
    assert client.get(JOBS, headers=tenant.headers).status_code == 200
    with db.session_scope(app.state.sessions) as s:
        auth.revoke_key(s, tenant.prefix)
    r = client.get(JOBS, headers=tenant.headers)
    assert r.status_code == 401 and r.json()["code"] == "revoked_api_key", r.text


def test_a_keys_tenant_never_answers_for_another_key(served):
    app, client = served
    a, b = new_tenant(app.state.sessions), new_tenant(app.state.sessions)
    a_job = create_job(client, a.key, upload(client, a.key))["id"]
    b_job = create_job(client, b.key, upload(client, b.key))["id"]
    same_prefix = a.key[:-4] + ("AAAA" if not a.key.endswith("AAAA") else "BBBB")

    def ask(i: int):
        who = (a, b)[i % 2]
        mine, theirs = (a_job, b_job) if who is a else (b_job, a_job)
        listed = client.get(JOBS, headers=who.headers).json()["data"]
        return (client.get(f"{JOBS}/{mine}", headers=who.headers).status_code,
                client.get(f"{JOBS}/{theirs}", headers=who.headers).status_code,
                [j["organization_id"] for j in listed] == [who.id] * len(listed) and mine in [j["id"] for j in listed],
                client.get(f"{JOBS}/{a_job}", headers=bearer(same_prefix)).status_code)

    with ThreadPoolExecutor(8) as pool:  # both keys cached and served at the same time
        results = list(pool.map(ask, range(48)))
    assert set(results) == {(200, 404, True, 401)}
    r = client.get(f"{JOBS}/{a_job}", headers=bearer(same_prefix))
    assert r.json()["code"] == "invalid_api_key"  # not the cached tenant, not even "revoked"


def test_concurrent_first_requests_check_a_key_once_and_refusals_are_never_cached(served):
    app, _ = served
    tenant = new_tenant(app.state.sessions)
    check = KeyCheck(app.state.read_engine)
    seen, stop = key_statements(app.state.engine)
    try:
        async def many(header: str, n: int):
            return await asyncio.gather(*(check.principal(header) for _ in range(n)), return_exceptions=True)

        principals = asyncio.run(many(f"Bearer {tenant.key}", 10))
        assert {p.tenant_id for p in principals} == {tenant.id} and len(seen) == 1
        seen.clear()
        unknown = "mf_live_" + "u" * 43
        for _ in range(3):
            refused = asyncio.run(many(f"Bearer {unknown}", 1))
            assert isinstance(refused[0], Unauthorized)
        assert len(seen) == 3  # every refusal asked the database again
        seen.clear()
        for header in (None, "", "Basic abc", "Bearer "):
            assert isinstance(asyncio.run(many(header, 1))[0], Unauthorized)
        assert seen == []  # a missing or malformed header never reaches the database
    finally:
        stop()


def test_a_busy_key_is_rechecked_in_the_background_and_a_revocation_found_so_drops_it(served):
    app, _ = served
    tenant = new_tenant(app.state.sessions)
    check = KeyCheck(app.state.read_engine, auth.KeyCache(trust_s=0.6))
    header = f"Bearer {tenant.key}"
    seen, stop = key_statements(app.state.engine)

    async def scenario():
        await check.principal(header)  # checked: one statement
        await asyncio.sleep(0.35)  # past half the trust
        with db.session_scope(app.state.sessions) as s:  # revoked behind the cache's back, as another process would
            s.execute(update(ApiKey).where(ApiKey.prefix == tenant.prefix).values(revoked_at=utcnow()))
        principal = await check.principal(header)  # still trusted: answered, and a re-check started
        assert principal.tenant_id == tenant.id and check._checks
        while check._checks:
            await asyncio.sleep(0.01)
        with pytest.raises(Unauthorized) as refused:
            await check.principal(header)  # the re-check found the revocation: no longer cached
        return refused.value

    try:
        refused = asyncio.run(scenario())
    finally:
        stop()
    assert refused.code == "revoked_api_key"
    assert len(seen) == 3  # first check, background re-check, the refused request's own check


def test_the_cache_holds_at_most_max_entries_and_forgets_by_prefix():
    cache = auth.KeyCache(trust_s=60, max_entries=3)
    now = time.monotonic()
    for i in range(5):
        cache.put(f"d{i}", auth.Principal(tenant_id=f"t{i}", key_prefix=f"p{i}"), now)
    assert len(cache) == 3 and cache.get("d0") is None and cache.get("d4")[0].tenant_id == "t4"
    cache.put("d4", auth.Principal(tenant_id="t4", key_prefix="p4"), now - 10)  # an older check does not win
    assert cache.get("d4")[1] < 1
    cache.forget("p3")
    assert cache.get("d3") is None and cache.get("d2") is not None
    expired = auth.KeyCache(trust_s=1.0)
    expired.put("x", auth.Principal(tenant_id="t"), now - 1.0)
    assert expired.get("x") is None
