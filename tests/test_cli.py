"""`memfit keys create/revoke/list` and `memfit db upgrade` against the database the API uses."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from service import auth, db
from service.cli import app
from service.errors import Unauthorized
from service.settings import get_settings


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
