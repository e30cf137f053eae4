"""MEMFIT_* settings as the environment gives them: every documented form is read, and every value
memfit cannot use becomes one line naming the variable, the value and what it expects."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.settings import Settings, SettingsInvalid, load_settings


@pytest.fixture
def env(monkeypatch):
    """A clean MEMFIT_* environment; returns a setter."""
    for key in list(os.environ):
        if key.upper().startswith("MEMFIT_"):
            monkeypatch.delenv(key)
    return monkeypatch.setenv


@pytest.mark.parametrize("value", [
    "/srv/a,/srv/b",                 # the documented comma-separated form
    f"/srv/a{os.pathsep}/srv/b",     # os.pathsep, like PATH
    '["/srv/a", "/srv/b"]',          # a JSON list
    " /srv/a , /srv/b ,",            # spaces and a trailing separator
])
def test_model_dirs_in_every_documented_form(env, value):
    env("MEMFIT_MODEL_DIRS", value)
    assert Settings().model_dirs == [Path("/srv/a"), Path("/srv/b")]


def test_one_model_dir_and_none(env, tmp_path):
    env("MEMFIT_MODEL_DIRS", str(tmp_path))
    assert Settings().model_dirs == [tmp_path.resolve()]
    env("MEMFIT_MODEL_DIRS", "")
    assert Settings().model_dirs == []


def test_scalar_settings_from_the_environment(env, tmp_path):
    env("MEMFIT_DATABASE_URL", "postgresql://memfit@db:5432/memfit")
    env("MEMFIT_STORAGE_DIR", str(tmp_path / "storage"))
    env("MEMFIT_MAX_UPLOAD_BYTES", "2048")
    env("MEMFIT_API_URL", "https://memfit.example:8000")
    env("MEMFIT_RAY_ADDRESS", "http://ray-head:8265")
    env("MEMFIT_RAY_AUTH_MODE", "token")
    env("MEMFIT_SCHEDULER_ENABLED", "false")
    env("MEMFIT_LEASE_SECONDS", "12.5")
    env("MEMFIT_POLL_SECONDS", "0.2")
    env("MEMFIT_MEMORY_SAFETY_MARGIN", "0")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://memfit@db:5432/memfit"
    assert s.storage_dir == (tmp_path / "storage").resolve()
    assert (s.max_upload_bytes, s.api_url, s.ray_address, s.ray_auth_mode) == (
        2048, "https://memfit.example:8000", "http://ray-head:8265", "token")
    assert (s.scheduler_enabled, s.lease_seconds, s.poll_seconds, s.memory_safety_margin) == (False, 12.5, 0.2, 0.0)


def test_an_empty_ray_address_means_a_local_head(env):
    env("MEMFIT_RAY_ADDRESS", "")
    assert Settings().ray_address is None


# One value memfit cannot use, for every field of Settings (the test below checks none is missing).
BAD = {
    "database_url": ("mysql://x", "sqlite:/// or postgresql+psycopg:// URL"),
    "storage_dir": ("/", "filesystem root"),
    "storage_url": ("/data/memfit", "expected s3://bucket or s3://bucket/prefix"),
    "storage_endpoint": ("minio:9000", "http://host:port"),
    "storage_region": ("US East", "a region name such as us-east-1"),
    "model_dirs": ("/", "filesystem root"),
    "max_upload_bytes": ("1", "an integer from 1024 to"),
    "api_url": ("localhost:8000", "http:// or https:// URL"),
    "ray_address": ("ray://head:10001", "Ray Jobs API's URL"),
    "ray_auth_mode": ("tokens", "'disabled' or 'token'"),
    "scheduler_enabled": ("maybe", "true or false"),
    "lease_seconds": ("abc", "a number from 2 to 3600"),
    "db_connect_timeout_s": ("0", "a number from 1 to 300"),
    "db_statement_timeout_s": ("never", "a number from 1 to 3600"),
    "db_keepalive_idle_s": ("0", "a number from 1 to 3600"),
    "poll_seconds": ("0", "a number > 0 and <= 60"),
    "memory_safety_margin": ("1", "a number from 0 to 0.9"),
    "max_json_body_bytes": ("10", "an integer from 1024 to"),
    "max_json_depth": ("2", "an integer from 8 to 512"),
    "max_header_bytes": ("1", "an integer from 1024 to"),
    "max_header_count": ("0", "an integer from 8 to 1000"),
    "rate_limit_enabled": ("maybe", "true or false"),
    "rate_limit_key_per_s": ("-1", "a number from 0 to"),
    "rate_limit_key_burst": ("0", "an integer from 1 to"),
    "rate_limit_ip_per_s": ("fast", "a number from 0 to"),
    "rate_limit_ip_burst": ("0", "an integer from 1 to"),
    "rate_limit_ingest_per_s": ("-1", "a number from 0 to"),
    "rate_limit_ingest_burst": ("0", "an integer from 1 to"),
    "max_ingest_body_bytes": ("10", "an integer from 65536 to"),
    "rate_limit_storage_uri": ("memcached://x", "memory:// or a redis:// URL"),
    "forwarded_allow_ips": ("10.0.0.0/8,proxy", "addresses or networks separated by ','"),
    "quota_queued_jobs": ("-1", "an integer from 0 to"),
    "quota_running_jobs": ("many", "an integer from 0 to"),
    "quota_storage_bytes": ("-5", "an integer from 0 to"),
    "max_model_bytes": ("huge", "an integer from 0 to"),
    "cluster_nodes": ('[{"memory": 1}]', 'a JSON list of nodes: [{"memory_bytes"'),
    "serve_ray_address": ("ray://head:10001", "Ray Jobs API's URL"),
    "serve_engine": ("tgi", "'transformers', 'vllm' or 'auto'"),
    "serve_min_replicas": ("-1", "an integer from 0 to 1000"),
    "serve_max_replicas": ("0", "an integer from 1 to 1000"),
    "serve_replica_cpus": ("lots", "a number from 0 to 1024"),
    "serve_replica_gpus": ("-1", "a number from 0 to 64"),
    "serve_max_batch": ("0", "an integer from 1 to 4096"),
    "serve_max_adapters": ("0", "an integer from 1 to 10000"),
    "serve_max_tokens": ("0", "an integer from 1 to"),
    "serve_request_timeout_s": ("0", "a number > 0 and <= 3600"),
    "serve_start_timeout_s": ("never", "a number > 0 and <= 3600"),
    "serve_concurrent_per_tenant": ("-1", "an integer from 0 to"),
    "serve_tokens_per_minute": ("-1", "an integer from 0 to"),
    "serve_replica_memory_bytes": ("-1", "an integer from 0 to"),
}


def test_every_setting_has_a_bad_value_below():
    assert set(BAD) == set(Settings.model_fields)


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_bad_setting_is_one_line_naming_variable_value_and_expectation(env, field):
    value, expected = BAD[field]
    env(f"MEMFIT_{field.upper()}", value)
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    (line,) = caught.value.lines
    assert line.startswith(f"MEMFIT_{field.upper()}={value!r}: ")
    assert expected in line and "\n" not in line


def test_a_lowercase_variable_is_named_as_documented(env):
    env("memfit_lease_seconds", "abc")  # pydantic-settings matches names case-insensitively
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    assert caught.value.lines == ["MEMFIT_LEASE_SECONDS='abc': expected a number from 2 to 3600"]


def test_model_dirs_that_look_like_json_but_are_not(env):
    env("MEMFIT_MODEL_DIRS", "[/models")
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    (line,) = caught.value.lines
    assert line.startswith("MEMFIT_MODEL_DIRS='[/models': expected directories separated by ','")


def test_several_bad_settings_are_one_line_each(env):
    env("MEMFIT_LEASE_SECONDS", "abc")
    env("MEMFIT_MODEL_DIRS", '["/ok", "/"]')
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    assert [line.split("=", 1)[0] for line in caught.value.lines] == ["MEMFIT_MODEL_DIRS", "MEMFIT_LEASE_SECONDS"]
