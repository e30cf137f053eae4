"""Process-wide Prometheus counters that service code increments (no api import, no web framework).

The scheduler counts its claims and failures here, the ingest path the records it stores; the API's
``GET /metrics`` (api/metrics.py) exposes this registry next to the app's own (request latency and
the gauges it reads from the database at scrape time).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry()

SCHEDULER_CLAIMS = Counter(
    "memfit_scheduler_claims", "Jobs claimed from the queue by a scheduler in this process (one per attempt).",
    registry=REGISTRY,
)
SCHEDULER_FAILURES = Counter(
    "memfit_scheduler_failures", "Jobs a scheduler in this process moved to failed, by error code.",
    ["code"], registry=REGISTRY,
)
INGEST_RECORDS = Counter(
    "memfit_ingest_records", "Records posted to the ingest endpoint and accepted, by kind.",
    ["kind"], registry=REGISTRY,
)


def count_ingested(records) -> None:
    """Count an accepted ingest batch's records by kind (called once per committed batch)."""
    for r in records:
        INGEST_RECORDS.labels(getattr(r, "kind", "unknown")).inc()
