"""A long job's memory and metrics through the real ingest endpoint, on Postgres and SQLite: the memory
view and the job page read a bounded number of points per rank (the last steps in full, older ones as
min / max / last buckets), the measured peaks cover the whole run, a replayed batch counts nothing
twice, and the 0002 migration backfills jobs stored before the series existed.

The window is shrunk (series.RECENT_STEPS, series.MAX_BUCKETS) so a run of a few hundred steps rolls up
as a 100 000-step run does with the real sizes; bench/long_job.py measures that one.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from service.jobs import ingest, series
from service.memory.compare import measured_categories
from service.store.db import session_scope
from service.store.models import MEMORY_BYTE_COLUMNS, MemorySample, SeriesHead, SeriesRollup
from tests.test_memory_api import claimed

RANKS, STEPS, RECENT, BUCKETS = 2, 400, 30, 12
SPIKE_RANK, SPIKE_STEP = 1, 17  # a peak early in the run, long before the full-resolution window
GiB = 2**30


@pytest.fixture
def small_window(monkeypatch):
    monkeypatch.setattr(series, "RECENT_STEPS", RECENT)
    monkeypatch.setattr(series, "MAX_BUCKETS", BUCKETS)


def memory(rank: int, step: int) -> dict:
    peak = GiB + step * 1000 + rank
    if (rank, step) == (SPIKE_RANK, SPIKE_STEP):
        peak = 7 * GiB
    return {"kind": "memory", "attempt": 1, "time": time.time(), "rank": rank, "step": step,
            "parameters_bytes": 100 + rank, "gradients_bytes": 200, "optimizer_bytes": 300 + step % 7,
            "activations_bytes": 1000 + step, "temporary_bytes": 50, "other_bytes": 5, "peak_bytes": peak,
            "process_rss_bytes": 900 + step}


def metrics(rank: int, step: int) -> dict:
    return {"kind": "metrics", "attempt": 1, "time": time.time(), "rank": rank, "step": step,
            "total_steps": STEPS, "loss": 10.0 / step, "tokens_per_s": 1000.0 + step}


def batches():
    """What the sink posts: every rank's memory sample and metrics per step, a few steps per batch."""
    batch = []
    for step in range(1, STEPS + 1):
        for rank in range(RANKS):
            batch += [memory(rank, step), metrics(rank, step)]
        if len(batch) >= 40:
            yield batch
            batch = []
    if batch:
        yield batch


def post(client, job_id, token, records):
    r = client.post(f"/v1/internal/jobs/{job_id}/ingest", json={"records": records},
                    headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()


def snapshot(api_app, job_id):
    with session_scope(api_app.state.sessions) as s:
        rollups = sorted((r.attempt, r.series, r.rank, r.width, r.bucket, r.first_step, r.last_step, r.count,
                          repr(sorted((k, sorted(v.items())) for k, v in r.stats.items())))
                         for r in s.scalars(select(SeriesRollup).where(SeriesRollup.job_id == job_id)))
        heads = sorted((h.attempt, h.series, h.rank, h.first_step, h.last_step, h.count, repr(h.peaks))
                       for h in s.scalars(select(SeriesHead).where(SeriesHead.job_id == job_id)))
    return rollups, heads


@pytest.fixture
def long_job(client, api_app, tenant, create_job, small_window):
    job_id = create_job(tenant, model="preset:small-llama", training={"resources": {"num_workers": RANKS}}).json()["id"]
    token = claimed(api_app, job_id)
    sent = list(batches())
    for b in sent:
        post(client, job_id, token, b)
    return job_id, token, sent


def test_memory_view_is_bounded_and_its_peaks_cover_the_whole_run(client, api_app, tenant, long_job):
    job_id, _, _ = long_job
    view = client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=tenant.headers).json()
    assert set(view["samples"]) == {str(r) for r in range(RANKS)}
    for rank in range(RANKS):
        points = view["samples"][str(rank)]
        assert len(points) <= RECENT + BUCKETS + 1
        raw = [p for p in points if p["phase"] != "rollup"]
        assert [p["step"] for p in raw] == list(range(STEPS - RECENT + 1, STEPS + 1))  # the last steps in full
        rolled = [p for p in points if p["phase"] == "rollup"]
        assert rolled and rolled[0]["rollup"]["from_step"] == 1  # the buckets reach back to the first step
        assert [p["step"] for p in points] == sorted(p["step"] for p in points)
        width = rolled[0]["rollup"]["width"]
        assert width == next(w for w in series.WIDTHS if -(-(STEPS - RECENT) // w) <= BUCKETS)
        # Each bucket is exactly min / max / last of the samples that fell in it.
        for p in rolled:
            lo, hi = p["rollup"]["from_step"], p["rollup"]["to_step"]
            inside = [memory(rank, s) for s in range(1, STEPS + 1) if lo <= s <= hi]
            assert p["rollup"]["count"] == len(inside) and hi - lo < width
            assert p["rollup"]["max"]["peak_bytes"] == max(m["peak_bytes"] for m in inside) == p["peak_bytes"]
            assert p["rollup"]["min"]["optimizer_bytes"] == min(m["optimizer_bytes"] for m in inside)
            assert p["rollup"]["last"]["activations_bytes"] == inside[-1]["activations_bytes"]

    # The peaks are the whole run's: rank 1's spike at step 17 is in a bucket, and still its peak.
    for rank in range(RANKS):
        steady = [measured_categories(memory(rank, s)) for s in range(3, STEPS + 1)]
        expect = {c: max(m[c] for m in steady) for c in steady[0]}
        assert view["measured_peaks"][str(rank)] == expect
    assert view["measured_peaks"][str(SPIKE_RANK)]["total"] == 7 * GiB
    summary = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=tenant.headers).json()["memory"]
    assert summary["measured_peak_bytes"] == 7 * GiB and summary["measured_step"] == SPIKE_STEP


def test_replayed_batches_count_nothing_twice_and_match_a_rebuild(client, api_app, long_job):
    job_id, token, sent = long_job
    before = snapshot(api_app, job_id)
    heads = {(h[1], h[2]): h for h in before[1]}
    assert heads[("memory", 0)][5] == STEPS and heads[("metrics", 0)][5] == STEPS  # count
    assert ("metrics", 1) not in heads  # the metrics series is rank 0's
    for b in sent[:5] + sent[-3:]:  # the sink retries what it already delivered
        assert post(client, job_id, token, b)["accepted"] == 0
    with session_scope(api_app.state.sessions) as s:  # and the scheduler replays a run's spool
        assert ingest.replay(s, api_app.state.settings, job_id, sent[1] + sent[7]).accepted == 0
    assert snapshot(api_app, job_id) == before
    # A batch mixing new steps with ones already stored folds in only the new ones.
    extra = [memory(0, STEPS + 1), memory(0, STEPS), metrics(0, STEPS + 1), metrics(0, STEPS), memory(0, STEPS + 1)]
    assert post(client, job_id, token, extra)["accepted"] == 2
    after = snapshot(api_app, job_id)
    heads = {(h[1], h[2]): h for h in after[1]}
    assert heads[("memory", 0)][5] == STEPS + 1 and heads[("metrics", 0)][5] == STEPS + 1
    # What ingest folded in, batch by batch, is what folding every stored row afresh gives.
    with session_scope(api_app.state.sessions) as s:
        series.rebuild(s, job_id)
    assert snapshot(api_app, job_id) == after


def test_job_page_reads_a_bounded_number_of_points(client, api_app, tenant, long_job):
    job_id, _, _ = long_job
    view = client.get(f"/ui/jobs/{job_id}/view.json", headers=tenant.headers).json()
    steps = view["metrics"]["steps"]
    assert len(steps) <= RECENT + BUCKETS + 1 and steps[-1] == STEPS
    # Older steps are buckets drawn at their last step, with that step's values: 1..99 is drawn at 99.
    assert steps[0] == 99 and view["metrics"]["loss"][0] == pytest.approx(10.0 / 99)
    assert steps[-RECENT:] == list(range(STEPS - RECENT + 1, STEPS + 1))
    assert view["metrics"]["loss"][-1] == pytest.approx(10.0 / STEPS)
    mem = view["memory"]
    for rank in range(RANKS):
        points = [p for p in mem["samples"] if p["rank"] == rank]
        assert len(points) <= RECENT + BUCKETS + 1 and points[-1]["step"] == STEPS
        assert max(p["peak"] for p in points) == (7 * GiB if rank == SPIKE_RANK else GiB + STEPS * 1000 + rank)
    assert mem["last_sample_id"] > 0
    assert len(view["events"]) <= 300 and view["events"][-1]["id"] == view["last_event_id"]
    # The live update after the page's newest sample: nothing new yet.
    r = client.get(f"/ui/jobs/{job_id}/memory.json", params={"after_id": mem["last_sample_id"]}, headers=tenant.headers)
    assert r.status_code == 200 and r.json()["samples"] == []
    page = client.get(f"/ui/jobs/{job_id}", headers=tenant.headers)
    assert page.status_code == 200


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_migration_backfills_jobs_stored_before_it(backend, tmp_path, request):
    """A database at 0001 with a job's samples, upgraded: the job's series and peaks are there."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.store import db
    from service.store.models import Job, JobEvent, Tenant

    urls = [f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("fresh_pg_url")]
    for url in urls:
        db.upgrade(url, "0001")
        engine = create_engine(db.normalize_url(url))
        with Session(engine) as s:
            s.add(Tenant(id="t-old", name="old"))
            s.flush()
            s.add(Job(id="ftjob-old", tenant_id="t-old", status="succeeded", spec={}, model="m", training_file="f",
                      attempt=1))
            s.flush()
            for step in range(1, 41):
                row = memory(0, step)
                s.add(MemorySample(job_id="ftjob-old", attempt=1, rank=0, step=step, phase="step",
                                   **{c: row.get(c) for c in MEMORY_BYTE_COLUMNS}))
                s.add(JobEvent(job_id="ftjob-old", type="metrics", message=f"Step {step}", attempt=1,
                               data={"step": step, "rank": 0, "train_loss": 1.0 / step}, dedupe_key=f"m:1:0:{step}"))
            s.commit()
        db.upgrade(url)
        with Session(engine) as s:
            hs = series.heads(s, "ftjob-old", series.MEMORY)
            assert [(h.rank, h.first_step, h.last_step, h.count) for h in hs] == [(0, 1, 40, 40)]
            assert series.memory_peaks(hs)[1][0]["total"] == max(memory(0, st)["peak_bytes"] for st in range(3, 41))
            assert sorted(series.metric_points(s, "ftjob-old")) == list(range(1, 41))
        engine.dispose()


def test_a_resumed_attempt_replaces_the_steps_it_repeats_and_the_peaks_are_its_own(client, api_app, tenant, create_job,
                                                                                   small_window):
    from service.store.tokens import new_ingest_token
    from service.store.transitions import transition

    job_id = create_job(tenant, model="preset:small-llama").json()["id"]
    token = claimed(api_app, job_id)
    first = [r for s in range(1, 201) for r in (memory(0, s), metrics(0, s))]
    for i in range(0, len(first), 100):
        post(client, job_id, token, first[i:i + 100])
    token2, token2_hash = new_ingest_token()
    with session_scope(api_app.state.sessions) as s:  # the scheduler requeues and claims it again
        transition(s, job_id, "queued")
        transition(s, job_id, "running", attempt=2, ingest_token_hash=token2_hash)
    second = [{**r, "attempt": 2, **({"peak_bytes": 2 * GiB} if r["kind"] == "memory" else {"loss": 0.5})}
              for s in range(150, 181) for r in (memory(0, s), metrics(0, s))]
    post(client, job_id, token2, second)

    view = client.get(f"/ui/jobs/{job_id}/view.json", headers=tenant.headers).json()
    steps, loss = view["metrics"]["steps"], view["metrics"]["loss"]
    # Attempt 2's last 30 steps in full (its step 150 is in the bucket before them), attempt 1's before 150.
    assert steps[-30:] == list(range(151, 181)) and all(v == 0.5 for v in loss[-30:])
    assert max(steps[:-30]) < 150 and loss[0] == pytest.approx(10.0 / steps[0])
    mem = client.get(f"/v1/fine_tuning/jobs/{job_id}/memory", headers=tenant.headers).json()
    assert mem["attempt"] == 2 and mem["measured_peaks"]["0"]["total"] == 2 * GiB
    assert [p["step"] for p in mem["samples"]["0"] if p["phase"] != "rollup"] == list(range(151, 181))
