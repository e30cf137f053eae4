"""``GET /metrics`` for Prometheus (text exposition format).

Each app has its own CollectorRegistry (several apps live in one test process) holding:

- ``memfit_http_request_duration_seconds{method, route, status}``: a histogram filled by an ASGI
  middleware, labelled by the route *template* (``/v1/fine_tuning/jobs/{job_id}``), never the raw
  path, so job ids do not explode the label set; streams are timed to their first byte;
- gauges read from the database at scrape time: ``memfit_jobs{status}``, ``memfit_queue_depth``,
  ``memfit_queue_oldest_age_seconds``, and ``memfit_job_peak_memory_bytes{job_id, rank}`` for
  running jobs (the highest peak measured on each rank of the current attempt).

Next to it the process-wide counters of service/jobs/metrics.py: ``memfit_scheduler_claims_total``,
``memfit_scheduler_failures_total{code}``, ``memfit_ingest_records_total{kind}``.

/metrics is for the operator's Prometheus, like /health: it carries no tenant data beyond job ids and
should be reachable only from inside the deployment (deploy/prometheus.yml).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from service.jobs import metrics as service_metrics
from service.store.models import Job, SeriesHead

router = APIRouter(tags=["ops"])
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector:
    """Job gauges from the database, computed when Prometheus scrapes (a few indexed queries)."""

    def __init__(self, read_sessions):
        self.read_sessions = read_sessions

    def collect(self):
        by_status = GaugeMetricFamily("memfit_jobs", "Jobs by status.", labels=["status"])
        depth = GaugeMetricFamily("memfit_queue_depth", "Jobs waiting in the queue (status queued).")
        oldest = GaugeMetricFamily("memfit_queue_oldest_age_seconds", "Age of the oldest queued job (0 when none).")
        peak = GaugeMetricFamily("memfit_job_peak_memory_bytes",
                                 "Highest measured memory peak per rank of each running job (current attempt).",
                                 labels=["job_id", "rank"])
        from service.domain.states import JobStatus

        with self.read_sessions() as s:
            counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            for status in JobStatus:
                by_status.add_metric([status.value], counts.get(status.value, 0))
            depth.add_metric([], counts.get(JobStatus.queued.value, 0))
            first = s.scalar(select(func.min(Job.updated_at)).where(Job.status == JobStatus.queued.value))
            if first is not None and first.tzinfo is None:
                first = first.replace(tzinfo=timezone.utc)
            oldest.add_metric([], (datetime.now(timezone.utc) - first).total_seconds() if first else 0.0)
            # The whole-run peaks ingest keeps per attempt and rank (service/jobs/series.py): one row per
            # rank whatever the job's length, not a scan of its samples.
            rows = s.execute(
                select(SeriesHead.job_id, SeriesHead.rank, SeriesHead.peaks)
                .join(Job, (Job.id == SeriesHead.job_id) & (Job.attempt == SeriesHead.attempt))
                .where(Job.status == JobStatus.running.value, SeriesHead.series == "memory")
            ).all()
            for job_id, rank, peaks in rows:
                seen = (peaks or {}).get("any") or {}
                # a traced step's measured peak; before one, the sum of the counted categories' maxima (a bound)
                value = seen.get("total") or sum(v or 0 for c, v in seen.items() if c != "total")
                peak.add_metric([job_id, str(rank)], float(value))
        yield from (by_status, depth, oldest, peak)


class LatencyMiddleware:
    """Pure ASGI (streams pass through untouched): time to the response start, by route template."""

    def __init__(self, app, histogram: Histogram):
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self._observe(scope, status["code"], time.perf_counter() - start)
                status["observed"] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not status.get("observed"):
                self._observe(scope, status["code"], time.perf_counter() - start)

    def _observe(self, scope, code: int, seconds: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", None) or "unmatched"
        if template.startswith("/ui/static"):
            template = "/ui/static"
        self.histogram.labels(scope.get("method", "GET"), template, str(code)).observe(seconds)


def install(app) -> None:
    registry = CollectorRegistry()
    histogram = Histogram("memfit_http_request_duration_seconds", "API request latency to the first response byte.",
                          ["method", "route", "status"], buckets=BUCKETS, registry=registry)
    registry.register(StoreCollector(app.state.read_sessions))
    app.state.metrics_registry = registry
    app.add_middleware(LatencyMiddleware, histogram=histogram)
    app.include_router(router)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    body = generate_latest(request.app.state.metrics_registry) + generate_latest(service_metrics.REGISTRY)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
