"""A job's memory and metrics over its whole run, read at a cost that does not grow with its length.

A job stores a few rows per step per rank (memory samples, metrics events), so anything that reads
them all — or the first N of them — gets slower, or silently stops at the start of the run, as the
job grows. This module keeps, as ingest stores each *new* sample (a replayed or retried one is not
stored again, so it is not counted again):

- ``series_rollups``: per (job, attempt, series, rank) buckets of 10, 100, 1 000, 10 000 and 100 000
  steps, each with every field's min / max / last (the value at the bucket's latest step) and the
  number of samples folded in — what a time-series store's downsampling keeps;
- ``series_heads``: per (job, attempt, series, rank) the step range and count, and for memory the
  running peak of each compared category (service/memory/compare.py) over the steady-state steps and
  over all steps — so the measured peaks cover the whole run without scanning it.

A read (:func:`memory_points`, :func:`metric_points`) takes, per rank, the last
:data:`RECENT_STEPS` steps at full resolution from the raw rows and everything before from the
narrowest bucket width that covers it in at most :data:`MAX_BUCKETS` buckets: at most
RECENT_STEPS + MAX_BUCKETS + 1 points per rank whatever the job's length (the oldest bucket at the
boundary may also hold some of the first full-resolution steps). Raw rows stay stored; only what is
read is bounded.

The memory series folds every phase's samples (a bucket's max is the highest any phase measured);
the metrics series is rank 0's (what the page charts). Writes to a job's series happen under the
job's row lock that ingest holds (``SELECT … FOR UPDATE``), so a read-modify-write of its buckets is
safe on Postgres and SQLite alike.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, NamedTuple

from sqlalchemy import and_, bindparam, delete, or_, select
from sqlalchemy.orm import Session

from service.memory.compare import STEADY_STATE_STEP, measured_categories
from service.store.models import MEMORY_BYTE_COLUMNS, JobEvent, MemorySample, SeriesHead, SeriesRollup

MEMORY, METRICS = "memory", "metrics"
WIDTHS = (10, 100, 1_000, 10_000, 100_000)
RECENT_STEPS = 250  # per rank, at full resolution
MAX_BUCKETS = 250  # per rank, before them
METRIC_FIELDS = ("train_loss", "valid_loss", "tokens_per_s", "learning_rate", "grad_norm", "step_time_s",
                 "trained_tokens")


class Sample(NamedTuple):
    """One new sample to fold in: its place and its numeric fields (None = not measured)."""

    attempt: int
    rank: int
    step: int
    values: dict[str, Any]


def memory_sample(r: Any) -> Sample:
    """A MemoryRecord or MemorySample row as a Sample of the memory series."""
    return Sample(r.attempt, r.rank, r.step, {c: getattr(r, c, None) for c in MEMORY_BYTE_COLUMNS})


def metrics_sample(attempt: int, data: dict[str, Any]) -> Sample:
    """A metrics event's data (service/jobs/ingest.py: _metrics_event) as a Sample of the metrics series."""
    return Sample(attempt, data.get("rank", 0), data["step"], {f: data.get(f) for f in METRIC_FIELDS})


# --- folding ------------------------------------------------------------------------------------


def _fold(stats: dict, last_step: int | None, s: Sample) -> None:
    lo, hi, last = stats.setdefault("min", {}), stats.setdefault("max", {}), stats.setdefault("last", {})
    for k, v in s.values.items():
        if v is None:
            continue
        if k not in lo or v < lo[k]:
            lo[k] = v
        if k not in hi or v > hi[k]:
            hi[k] = v
    if last_step is None or s.step >= last_step:
        stats["last"] = {k: v for k, v in s.values.items() if v is not None} or last


def _fold_peaks(peaks: dict, s: Sample) -> None:
    """The running per-category peak, over steady-state steps and over all (compare.measured_peaks' rule)."""
    measured = measured_categories(s.values)
    scopes = ["any"] + (["steady"] if s.step >= STEADY_STATE_STEP else [])
    if s.step >= STEADY_STATE_STEP:
        peaks["steady_count"] = peaks.get("steady_count", 0) + 1
    for scope in scopes:
        row = peaks.setdefault(scope, {})
        for c, v in measured.items():
            if v is not None and (row.get(c) is None or v > row[c]):
                row[c] = v


def add(session: Session, job_id: str, series: str, samples: Iterable[Sample]) -> None:
    """Fold newly stored samples into the job's buckets and heads. Call it only with samples that were
    not stored before (what an insert-or-ignore reports new): a sample folded twice counts twice."""
    samples = sorted(samples, key=lambda s: (s.attempt, s.rank, s.step))
    if not samples:
        return
    _add_rollups(session, job_id, series, samples)
    _add_heads(session, job_id, series, samples)


def _add_rollups(session: Session, job_id: str, series: str, samples: list[Sample]) -> None:
    groups: dict[tuple[int, int, int, int], list[Sample]] = defaultdict(list)
    for s in samples:
        for w in WIDTHS:
            groups[(s.attempt, s.rank, w, s.step // w * w)].append(s)
    ranges: dict[tuple[int, int, int], list[int]] = {}
    for a, r, w, b in groups:
        lohi = ranges.setdefault((a, r, w), [b, b])
        lohi[0], lohi[1] = min(lohi[0], b), max(lohi[1], b)
    t = SeriesRollup.__table__
    q = select(t).where(t.c.job_id == job_id, t.c.series == series, or_(*(
        and_(t.c.attempt == a, t.c.rank == r, t.c.width == w, t.c.bucket.between(lo, hi))
        for (a, r, w), (lo, hi) in ranges.items())))
    existing = {(row.attempt, row.rank, row.width, row.bucket): row for row in session.execute(q)}
    inserts, updates = [], []
    for key, group in groups.items():
        row = existing.get(key)
        stats = {k: dict(v) for k, v in row.stats.items()} if row is not None else {}
        first, last, count = (row.first_step, row.last_step, row.count) if row is not None else (None, None, 0)
        for s in group:
            _fold(stats, last, s)
            first = s.step if first is None else min(first, s.step)
            last = s.step if last is None else max(last, s.step)
            count += 1
        a, r, w, b = key
        values = {"first_step": first, "last_step": last, "count": count, "stats": stats}
        if row is None:
            inserts.append({"job_id": job_id, "attempt": a, "series": series, "rank": r, "width": w, "bucket": b,
                            **values})
        else:
            updates.append({"k_attempt": a, "k_rank": r, "k_width": w, "k_bucket": b, **values})
    if inserts:
        session.execute(t.insert(), inserts)
    if updates:
        session.execute(t.update().where(
            t.c.job_id == job_id, t.c.series == series, t.c.attempt == bindparam("k_attempt"),
            t.c.rank == bindparam("k_rank"), t.c.width == bindparam("k_width"),
            t.c.bucket == bindparam("k_bucket")), updates)


def _add_heads(session: Session, job_id: str, series: str, samples: list[Sample]) -> None:
    t = SeriesHead.__table__
    existing = {(h.attempt, h.rank): h for h in session.execute(
        select(t).where(t.c.job_id == job_id, t.c.series == series))}
    groups: dict[tuple[int, int], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[(s.attempt, s.rank)].append(s)
    inserts, updates = [], []
    for (a, r), group in groups.items():
        head = existing.get((a, r))
        peaks = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ((head.peaks if head else None) or {}).items()}
        first = head.first_step if head is not None else group[0].step
        last = head.last_step if head is not None else group[-1].step
        count = head.count if head is not None else 0
        for s in group:
            if series == MEMORY:
                _fold_peaks(peaks, s)
            first, last, count = min(first, s.step), max(last, s.step), count + 1
        values = {"first_step": first, "last_step": last, "count": count, "peaks": peaks or None}
        if head is None:
            inserts.append({"job_id": job_id, "attempt": a, "series": series, "rank": r, **values})
        else:
            updates.append({"k_attempt": a, "k_rank": r, **values})
    if inserts:
        session.execute(t.insert(), inserts)
    if updates:
        session.execute(t.update().where(t.c.job_id == job_id, t.c.series == series,
                                         t.c.attempt == bindparam("k_attempt"), t.c.rank == bindparam("k_rank")),
                        updates)


def rebuild(session: Session, job_id: str, *, chunk: int = 5000) -> None:
    """Fold a job's stored samples in from scratch (the 0002 migration's backfill of jobs that existed
    before the series did; tests). Replaces what the job's series held. Caller commits."""
    session.execute(delete(SeriesRollup).where(SeriesRollup.job_id == job_id))
    session.execute(delete(SeriesHead).where(SeriesHead.job_id == job_id))
    last_id = 0
    while True:
        rows = list(session.scalars(select(MemorySample).where(MemorySample.job_id == job_id, MemorySample.id > last_id)
                                    .order_by(MemorySample.id).limit(chunk)))
        if not rows:
            break
        add(session, job_id, MEMORY, [memory_sample(r) for r in rows])
        last_id = rows[-1].id
    last_id = 0
    while True:
        rows = session.execute(select(JobEvent.id, JobEvent.attempt, JobEvent.data)
                               .where(JobEvent.job_id == job_id, JobEvent.type == "metrics", JobEvent.id > last_id)
                               .order_by(JobEvent.id).limit(chunk)).all()
        if not rows:
            break
        add(session, job_id, METRICS, [metrics_sample(a or 0, d) for _, a, d in rows
                                       if d and d.get("step") is not None and d.get("rank", 0) == 0])
        last_id = rows[-1][0]


# --- reading ------------------------------------------------------------------------------------


def heads(session: Session, job_id: str, series: str) -> list[SeriesHead]:
    """The job's heads of ``series``, every attempt and rank (a handful of rows)."""
    return list(session.scalars(select(SeriesHead).where(SeriesHead.job_id == job_id, SeriesHead.series == series)
                                .order_by(SeriesHead.attempt, SeriesHead.rank)))


def window(first_step: int, last_step: int) -> tuple[int | None, int]:
    """(the bucket width for the steps before the full-resolution ones, or None when every step is
    recent; the first full-resolution step) for a rank whose samples span first_step..last_step."""
    recent_from = max(first_step, last_step - RECENT_STEPS + 1)
    if recent_from <= first_step:
        return None, first_step
    span = recent_from - first_step
    width = next((w for w in WIDTHS if -(-span // w) <= MAX_BUCKETS), WIDTHS[-1])
    return width, recent_from


def rollups_before(session: Session, job_id: str, series: str, attempt: int, rank: int, width: int,
                   before_step: int) -> list[SeriesRollup]:
    """The rank's buckets of ``width`` that start before ``before_step``, oldest first (≤ MAX_BUCKETS + 1)."""
    return list(session.scalars(
        select(SeriesRollup).where(SeriesRollup.job_id == job_id, SeriesRollup.attempt == attempt,
                                   SeriesRollup.series == series, SeriesRollup.rank == rank,
                                   SeriesRollup.width == width, SeriesRollup.bucket < before_step)
        .order_by(SeriesRollup.bucket)))


def latest_attempt(hs: list[SeriesHead]) -> int | None:
    return max((h.attempt for h in hs), default=None)


def memory_peaks(hs: list[SeriesHead]) -> tuple[int | None, dict[int, dict[str, int | None]]]:
    """(the latest attempt, its whole-run peak per category per rank) from the memory heads: over the
    steady-state steps when any rank has one, else over all steps (compare.measured_peaks' rule)."""
    attempt = latest_attempt(hs)
    latest = [h for h in hs if h.attempt == attempt]
    steady = any((h.peaks or {}).get("steady_count") for h in latest)
    scope = "steady" if steady else "any"
    return attempt, {h.rank: dict((h.peaks or {}).get(scope) or {}) for h in latest
                     if (h.peaks or {}).get(scope) is not None}


def memory_points(session: Session, job_id: str, attempt: int, hs: list[SeriesHead], *,
                  phase: str | None = None) -> tuple[dict[int, list[SeriesRollup]], list[MemorySample]]:
    """({rank: buckets before its full-resolution steps}, the raw samples of those steps, by rank and
    step) for ``attempt``; ``phase`` keeps only that phase's raw samples."""
    buckets: dict[int, list[SeriesRollup]] = {}
    raw: list[MemorySample] = []
    for h in hs:
        if h.attempt != attempt:
            continue
        width, recent_from = window(h.first_step, h.last_step)
        if width is not None:
            buckets[h.rank] = rollups_before(session, job_id, MEMORY, attempt, h.rank, width, recent_from)
        q = select(MemorySample).where(MemorySample.job_id == job_id, MemorySample.attempt == attempt,
                                       MemorySample.rank == h.rank, MemorySample.step >= recent_from)
        if phase is not None:
            q = q.where(MemorySample.phase == phase)
        raw += session.scalars(q.order_by(MemorySample.step, MemorySample.phase))
    return buckets, raw


def metric_points(session: Session, job_id: str) -> dict[int, dict[str, Any]]:
    """Rank 0's metrics per step over the whole run: {step: data}, at most RECENT_STEPS + MAX_BUCKETS + 1
    steps per attempt. Older steps are buckets drawn at their last step with that step's values, and
    ``rollup`` (from/to step, count, min, max); where the bucket that straddles the first full-resolution
    step would be drawn, the raw point is. A resumed attempt's steps replace the earlier attempt's from
    its first step on (an earlier bucket drawn past that step goes with them)."""
    out: dict[int, dict[str, Any]] = {}
    for h in [h for h in heads(session, job_id, METRICS) if h.rank == 0]:
        width, recent_from = window(h.first_step, h.last_step)
        points: dict[int, dict[str, Any]] = {}
        if width is not None:
            for b in rollups_before(session, job_id, METRICS, h.attempt, 0, width, recent_from):
                points[b.last_step] = {"step": b.last_step, **b.stats.get("last", {}),
                                       "rollup": {"from_step": b.first_step, "to_step": b.last_step,
                                                  "count": b.count, "min": b.stats.get("min", {}),
                                                  "max": b.stats.get("max", {})}}
        # The newest rank-0 metrics events of the attempt, newest first: a bounded walk back along
        # (job_id, id) — each step has one event per rank, so RECENT_STEPS of rank 0 cover the window.
        recent = session.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "metrics",
                                        JobEvent.dedupe_key.like(f"m:{h.attempt}:0:%"))
            .order_by(JobEvent.id.desc()).limit(RECENT_STEPS))
        raw: dict[int, dict[str, Any]] = {}
        for d in recent:
            if d and d.get("step") is not None and d["step"] >= recent_from:
                raw.setdefault(d["step"], d)  # newest first: a repeated step keeps its newest event
        points.update(raw)  # the bucket that straddles recent_from is drawn at its last step: raw wins there
        for step in [s for s in out if s >= h.first_step]:
            del out[step]  # a later attempt repeats the steps after its checkpoint
        out.update(points)
    return dict(sorted(out.items()))
