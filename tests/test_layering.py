"""The layering (STYLE.md, Layers): import-linter's contracts in pyproject.toml hold over grimp's import
graph, which sees imports made inside functions too; and importing the API loads no training stack."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import sys
import api.app, api.routes.jobs, api.routes.files, service.jobs.crud, service.domain.spec, service.cli.main, service.store.db, service.store.auth
import service.jobs.files, service.domain.datafmt, service.domain.states, service.store.models
app = api.app.create_app(__import__("service.settings", fromlist=["Settings"]).Settings(
    database_url="sqlite:///" + sys.argv[1], storage_dir=sys.argv[2]))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "transformers", "deepspeed", "peft"))
print(",".join(heavy))
"""


def test_api_and_service_do_not_import_torch_or_ray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "l.db"), str(tmp_path / "s")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout}"


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports is not installed (pip install -e '.[dev]')"
    # --no-cache: a cached graph can lag behind files edited within the same second.
    out = subprocess.run([exe, "--no-cache"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_import_contracts_are_kept():
    """Every contract in pyproject.toml is checked and kept: api above service (only service.cli may
    start the app), the layers inside service, workers off api and the database, no training stack
    in api/service outside the Ray Jobs client, and no import cycles."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert {c["id"] for c in contracts} >= {"api-above-service", "service-layers", "workers-not-api",
                                            "service-torch-free", "no-cycles"}
    report = _lint_imports()
    for c in contracts:
        line = next((ln for ln in report.splitlines() if ln.startswith(c["name"] + " ")), None)
        assert line is not None and "KEPT" in line, f"{c['id']}: {line!r}\n{report}"
    assert f"Contracts: {len(contracts)} kept, 0 broken." in report


def test_exceptions_are_exactly_the_deliberate_ones():
    """The narrow exceptions stay narrow: one import of the app from the CLI, one of ray from the
    Ray Jobs client (both also named in the report as ignored)."""
    contracts = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
    assert contracts["api-above-service"]["ignore_imports"] == ["service.cli.embedded -> api.app"]
    assert contracts["service-torch-free"]["ignore_imports"] == ["service.scheduler.ray_jobs -> ray"]
    assert contracts["service-layers"].get("exhaustive") is True  # a new package under service/ needs a layer
