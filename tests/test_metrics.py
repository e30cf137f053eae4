"""GET /metrics on real Postgres: every named series is exposed with the values the store and the
process hold (jobs by status, queue depth and age, scheduler claims, ingest records, request latency by
route template, per-running-job peak memory per rank)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.store.models import File
from tests.factories import create_job, new_key, upload
from tests.scheduler_support import app_without_ray


def scrape(client) -> dict[str, dict[tuple, float]]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture(scope="module")
def env(new_database, tmp_path_factory):
    # exact job counts: nobody else's jobs in this database
    with app_without_ray(new_database, tmp_path_factory.mktemp("storage")) as stack:
        yield stack


def test_metrics_expose_the_named_series_with_real_values(env):
    app, client, sched = env
    before = scrape(client)
    claims_before = before.get("memfit_scheduler_claims_total", {}).get((), 0.0)
    mem_before = before.get("memfit_ingest_records_total", {}).get((("kind", "memory"),), 0.0)

    key = new_key(app.state.sessions)
    auth = {"Authorization": f"Bearer {key}"}
    running = create_job(client, key, upload(client, key))["id"]
    sched.validate_pending()
    token = {j: t for j, _, t in sched.claim(limit=10)}[running]
    create_job(client, key, upload(client, key))  # stays queued
    cancelled = create_job(client, key, upload(client, key))["id"]
    sched.validate_pending()
    assert client.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel", headers=auth).status_code == 200
    # A job whose training file vanished from storage fails validation: a scheduler failure.
    broken_file = upload(client, key)
    create_job(client, key, broken_file)
    with app.state.sessions() as s:
        Path(s.get(File, broken_file).path).unlink()
    sched.validate_pending()
    now = time.time()
    records = [{"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": 1, "loss": 2.0}]
    for rank, peak in ((0, 7_000_000), (1, 6_500_000)):
        records += [{"kind": "memory", "attempt": 1, "time": now, "rank": rank, "step": step,
                     "parameters_bytes": 1_000_000, "peak_bytes": peak - 1000 * (2 - step)} for step in (1, 2)]
    r = client.post(f"/v1/internal/jobs/{running}/ingest", json={"records": records},
                    headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert client.get(f"/v1/fine_tuning/jobs/{running}", headers=auth).status_code == 200
    time.sleep(0.05)

    m = scrape(client)
    jobs = {dict(k)["status"]: v for k, v in m["memfit_jobs"].items()}
    assert jobs["running"] == 1 and jobs["queued"] == 1 and jobs["cancelled"] == 1 and jobs["failed"] == 1
    assert jobs["succeeded"] == 0
    failures = before.get("memfit_scheduler_failures_total", {}).get((("code", "file_missing"),), 0.0)
    assert m["memfit_scheduler_failures_total"][(("code", "file_missing"),)] == failures + 1
    assert m["memfit_queue_depth"][()] == 1
    assert m["memfit_queue_oldest_age_seconds"][()] > 0
    peaks = {dict(k)["rank"]: v for k, v in m["memfit_job_peak_memory_bytes"].items() if dict(k)["job_id"] == running}
    assert peaks == {"0": 7_000_000, "1": 6_500_000}
    assert m["memfit_scheduler_claims_total"][()] == claims_before + 1
    assert m["memfit_ingest_records_total"][(("kind", "memory"),)] == mem_before + 4
    assert m["memfit_ingest_records_total"][(("kind", "metrics"),)] >= 1
    # Request latency by route *template* (no job ids in labels), with the status code.
    latency = m["memfit_http_request_duration_seconds_count"]
    get_job = [v for k, v in latency.items()
               if dict(k) == {"method": "GET", "route": "/v1/fine_tuning/jobs/{job_id}", "status": "200"}]
    assert get_job and get_job[0] >= 1
    assert not any(running in dict(k)["route"] for k in latency)
    ingest = [v for k, v in latency.items() if dict(k)["route"] == "/v1/internal/jobs/{job_id}/ingest"]
    assert ingest and ingest[0] >= 1


def test_a_job_that_stops_running_leaves_the_peak_gauge(env):
    app, client, sched = env
    key = new_key(app.state.sessions)
    job = create_job(client, key, upload(client, key))["id"]
    sched.validate_pending()
    token = {j: t for j, _, t in sched.claim(limit=10)}[job]
    r = client.post(f"/v1/internal/jobs/{job}/ingest", headers={"Authorization": f"Bearer {token}"},
                    json={"records": [{"kind": "memory", "attempt": 1, "time": time.time(), "rank": 0, "step": 1,
                                       "peak_bytes": 1234}]})
    assert r.status_code == 200
    assert any(dict(k)["job_id"] == job for k in scrape(client)["memfit_job_peak_memory_bytes"])
    assert client.post(f"/v1/fine_tuning/jobs/{job}/cancel", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert not any(dict(k)["job_id"] == job for k in scrape(client).get("memfit_job_peak_memory_bytes", {}))
