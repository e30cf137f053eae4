"""The API benchmark's own parts, on real Postgres and a real wrk: the hand-written anchor
authenticates and scopes like memfit (a comparison with an anchor that skipped either would flatter
it), wrk's Lua summary counts every status and is read back exactly, the servers the bench starts
are stopped with everything they forked, and the profile summary gives each sample to its
innermost phase. (The figures themselves are bench/api_wrk.py's to print, never asserted here.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest
from starlette.testclient import TestClient

from bench import api_harness as h
from bench import profile_summary
from service.store import auth
from service.store.db import session_scope
from tests.factories import create_job, new_key, settings_for, upload


@pytest.fixture(scope="module")
def memfit(pg_migrated, tmp_path_factory):
    from api.app import create_app

    app = create_app(settings_for(pg_migrated, tmp_path_factory.mktemp("storage")))
    with TestClient(app) as client:
        yield app, client
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def anchor(pg_migrated):
    from bench import anchor_app

    os.environ["ANCHOR_DATABASE_URL"] = pg_migrated
    try:
        with TestClient(anchor_app.create_app()) as client:
            yield client
    finally:
        os.environ.pop("ANCHOR_DATABASE_URL", None)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_anchor_answers_what_memfit_answers_for_the_tenants_own_job(memfit, anchor):
    app, client = memfit
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key), suffix="anchor", metadata={"k": "v"},
                     training={"peft": {"method": "lora"}})
    ours = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bearer(key))
    theirs = anchor.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bearer(key))
    assert ours.status_code == theirs.status_code == 200
    assert theirs.json() == ours.json()


def test_anchor_refuses_what_memfit_refuses(memfit, anchor):
    app, client = memfit
    key = new_key(app.state.sessions)
    other = new_key(app.state.sessions)
    job_id = create_job(client, key, upload(client, key))["id"]
    path = f"/v1/fine_tuning/jobs/{job_id}"
    wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")  # the same prefix, another key
    cases = {
        "no header": {},
        "not bearer": {"Authorization": f"Basic {key}"},
        "unknown key": bearer("mf_live_" + "x" * 43),
        "same prefix, wrong key": bearer(wrong_secret),
        "another tenant's key": bearer(other),
    }
    for name, headers in cases.items():
        ours, theirs = client.get(path, headers=headers), anchor.get(path, headers=headers)
        assert (name, theirs.status_code) == (name, ours.status_code), theirs.text
    assert client.get(path, headers=bearer(other)).status_code == 404

    with session_scope(app.state.sessions) as s:
        auth.revoke_key(s, auth.key_prefix(key))
    assert anchor.get(path, headers=bearer(key)).status_code == client.get(path, headers=bearer(key)).status_code == 401


def test_counted_app_reports_each_requests_statements_and_the_totals(pg_migrated, tmp_path):
    from bench import counted_app

    app = counted_app.create_app(settings_for(pg_migrated, tmp_path / "storage"))
    with TestClient(app) as client:
        key = new_key(app.state.sessions)
        job_id = create_job(client, key, upload(client, key))["id"]
        client.get("/_bench/counts")  # the totals restart here
        r = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=bearer(key))
        health = client.get("/healthz")
        totals = client.get("/_bench/counts").json()
    app.state.engine.dispose()
    assert r.status_code == 200
    statements = int(r.headers["x-bench-statements"])
    assert statements >= 1 and "SELECT jobs." in r.headers["x-bench-sql"]
    assert int(r.headers["x-bench-checkouts"]) >= 1
    assert health.headers["x-bench-statements"] == "0"
    assert totals["requests"] == 2 and totals["statements"] == statements


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install -y wrk)")
def test_wrk_summary_counts_every_status_of_a_real_server(pg_migrated, tmp_path):
    server = h.Server.start("anchor", "bench.anchor_app:create_app", {"ANCHOR_DATABASE_URL": pg_migrated}, tmp_path)
    pids = [p.pid for p in server.processes()]
    try:
        ok = h.run_wrk(server.url + "/healthz", threads=1, connections=2, duration_s=1, server=server)
        refused = h.run_wrk(server.url + "/v1/fine_tuning/jobs/ftjob-x", threads=1, connections=2, duration_s=1,
                            headers=bearer("mf_live_" + "y" * 43))
    finally:
        server.stop()
    assert ok.requests > 0 and ok.statuses == {200: ok.requests} and ok.errors == 0
    assert ok.server_cpu_s > 0
    assert refused.requests > 0 and refused.statuses == {401: refused.requests}
    assert refused.errors == refused.requests  # a 4xx counts as an error
    assert 0 < refused.p50 <= refused.p99 <= refused.latency_ms["max"]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_parse_wrk_reads_the_summary_line_and_refuses_output_without_one():
    out = ("Running 1s test @ http://x\n"
           'WRK_JSON {"requests": 10.0, "duration_us": 2000000.0, "bytes": 990.0, "latency_us": {"p50": 1500.0, '
           '"p90": 2000.0, "p99": 3000.0, "max": 3500.0, "mean": 1600.0}, "statuses": {"200": 7.0, "503": 3.0}, '
           '"errors": {"connect": 0.0, "read": 1.0, "write": 0.0, "status": 3.0, "timeout": 0.0}}\n')
    r = h.parse_wrk(out)
    assert (r.requests, r.rps, r.p50, r.p99) == (10, 5.0, 1.5, 3.0)
    assert r.statuses == {200: 7, 503: 3}
    assert r.count(lambda c: c >= 500) == 3
    assert r.errors == 4  # three 503s and one read error; wrk's own "status" count is not added twice
    with pytest.raises(ValueError, match="WRK_JSON"):
        h.parse_wrk("Running 1s test @ http://x\n  0 requests in 1.00s\n")


def test_profile_summary_gives_each_sample_to_its_innermost_phase(tmp_path: Path):
    loop = "BaseEventLoop._run_once (asyncio/base_events.py:1922)"
    mw = "LatencyMiddleware.__call__ (api/metrics.py:90)"
    stacks = tmp_path / "p.txt"
    stacks.write_text("\n".join([
        f"{loop};{mw};authenticate (service/store/auth.py:95);Cursor.execute (psycopg/cursor.py:97) 3",
        f"{loop};{mw};get_job (service/jobs/crud.py:243);Session.get (sqlalchemy/orm/session.py:1) 5",
        f"{loop};{mw} 2",
        "Thread.run (threading.py:1);WorkerThread.run (anyio/_backends/_asyncio.py:9);Condition.wait (threading.py:3) 7",
    ]) + "\n")
    text = profile_summary.summarize(stacks, requests=10, rate=100)
    lines = {line.split("  ")[-1].strip(): line for line in text.splitlines() if "%" in line}
    phase = {name: line.split("%")[0].strip() for name, line in lines.items()}
    total = 17
    assert phase[profile_summary.PHASES[0][0]] == f"{100 * 3 / total:.1f}"  # auth, not psycopg or middleware
    assert phase[profile_summary.PHASES[1][0]] == f"{100 * 5 / total:.1f}"  # the store query
    assert phase["middleware: api.metrics LatencyMiddleware (histogram observe)"] == f"{100 * 2 / total:.1f}"
    assert phase["waiting (a parked thread, the loop in epoll: not CPU)"] == f"{100 * 7 / total:.1f}"
    assert "17 samples" in text and "10 requests" in text
