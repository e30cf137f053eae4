"""Liveness, readiness (checks the database and its schema) and the OpenAPI document."""

from __future__ import annotations


def test_healthz(client):
    assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_checks_database(client):
    from service.store.db import head_revision

    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "database": "ok", "schema": head_revision()}


def test_readyz_503_when_database_is_unreachable(api_settings, tmp_path):
    from starlette.testclient import TestClient

    from api.app import create_app

    app = create_app(api_settings)
    app.state.engine = __import__("service.store.db", fromlist=["make_engine"]).make_engine(
        "postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1")
    r = TestClient(app).get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


def test_readyz_503_when_schema_is_behind(api_app):
    from starlette.testclient import TestClient

    head = api_app.state.schema_head
    api_app.state.schema_head = "9999"
    try:
        r = TestClient(api_app).get("/readyz")
    finally:
        api_app.state.schema_head = head
    assert r.status_code == 503 and r.json()["expected_schema"] == "9999"


def test_openapi_lists_the_routes(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/files", "/v1/files/{file_id}/content", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{job_id}",
                 "/v1/fine_tuning/jobs/{job_id}/cancel", "/v1/fine_tuning/jobs/{job_id}/pause",
                 "/v1/fine_tuning/jobs/{job_id}/resume", "/v1/fine_tuning/jobs/{job_id}/events",
                 "/v1/fine_tuning/jobs/{job_id}/checkpoints", "/healthz", "/readyz"):
        assert path in doc["paths"], path
    assert "multipart/form-data" in doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert "JobPublic" in doc["components"]["schemas"]
    body = doc["paths"]["/v1/fine_tuning/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpec"}
    assert "TrainingOptions" in doc["components"]["schemas"]
    assert "training" in doc["components"]["schemas"]["JobSpec"]["properties"]
