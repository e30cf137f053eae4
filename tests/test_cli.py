"""`memfit keys create/revoke/list` and `memfit db upgrade` against the database the API uses, and a bad
MEMFIT_* setting as every command meets it (one line on stderr, exit status 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli.main import app
from service.domain.errors import Unauthorized
from service.settings import get_settings
from service.store import auth, db


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("MEMFIT_DATABASE_URL", url)
    monkeypatch.setenv("MEMFIT_STORAGE_DIR", str(tmp_path / "storage"))
    get_settings.cache_clear()
    yield url
    get_settings.cache_clear()


def test_keys_create_prints_a_working_key_once_then_revoke(cli_env):
    runner = CliRunner()
    r = runner.invoke(app, ["keys", "create", "--tenant", "acme"])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    assert key.startswith("mf_live_")
    sessions = db.make_sessionmaker(db.make_engine(cli_env))
    with db.session_scope(sessions) as s:
        principal = auth.authenticate(s, f"Bearer {key}")
        assert [t.name for _, t in auth.list_keys(s)] == ["acme"]
    listed = runner.invoke(app, ["keys", "list"])
    assert key[:16] in listed.stdout and key not in listed.stdout
    assert runner.invoke(app, ["keys", "revoke", key[:16]]).exit_code == 0
    with db.session_scope(sessions) as s:
        with pytest.raises(Unauthorized):
            auth.authenticate(s, f"Bearer {key}")
    again = runner.invoke(app, ["keys", "revoke", key[:16]])
    assert again.exit_code == 1 and "No active API key" in again.output
    assert principal.tenant_id


def test_db_upgrade(cli_env):
    r = CliRunner().invoke(app, ["db", "upgrade"])
    assert r.exit_code == 0, r.output
    assert db.current_revision(db.make_engine(cli_env)) == db.head_revision()


# --- a bad MEMFIT_* setting, as each command meets it: one line on stderr, exit status 2 -------------

ROOT = Path(__file__).resolve().parent.parent


def _memfit(args: list[str], cwd: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("MEMFIT_", "RAY_ADDRESS"))}
    env.update({"PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": f"sqlite:///{cwd / 'memfit.db'}",
                "MEMFIT_STORAGE_DIR": str(cwd / "storage"), **settings})
    return subprocess.run([sys.executable, "-m", "service.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("args", "variable", "value"), [
    (["serve", "--port", "1"], "MEMFIT_LEASE_SECONDS", "abc"),
    (["scheduler"], "MEMFIT_DATABASE_URL", "mysql://x"),
    (["run", str(ROOT / "examples" / "tiny-lora.yaml")], "MEMFIT_MAX_UPLOAD_BYTES", "1"),
    (["keys", "create", "--tenant", "acme"], "MEMFIT_RAY_AUTH_MODE", "tokens"),
    (["db", "upgrade"], "MEMFIT_MODEL_DIRS", "[/models"),
], ids=["serve", "scheduler", "run", "keys-create", "db-upgrade"])
def test_a_bad_setting_is_one_line_on_stderr_and_exit_2(tmp_path, args, variable, value):
    proc = _memfit(args, tmp_path, **{variable: value})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"memfit: {variable}={value!r}: expected"), line
    assert not (tmp_path / "memfit.db").exists()  # refused before anything was touched


def test_model_dirs_in_the_documented_form_reach_the_command(tmp_path):
    proc = _memfit(["db", "upgrade"], tmp_path, MEMFIT_MODEL_DIRS=f"{tmp_path}/a,{tmp_path}/b:{tmp_path}/c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "database at head" in proc.stdout


def test_serve_starts_with_model_dirs_in_the_documented_form(tmp_path):
    """The report's command: `MEMFIT_MODEL_DIRS=/models memfit serve` (scheduler off: no Ray head)."""
    import httpx

    from service.scheduler.local_head import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("MEMFIT_", "RAY_ADDRESS"))}
    env.update({"PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": f"sqlite:///{tmp_path / 'memfit.db'}",
                "MEMFIT_STORAGE_DIR": str(tmp_path / "storage"), "MEMFIT_SCHEDULER_ENABLED": "false",
                "MEMFIT_MODEL_DIRS": f"{tmp_path}/models,{tmp_path}/more"})
    proc = subprocess.Popen([sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
