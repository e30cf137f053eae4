"""The service never imports torch or ray: api/ and service/ stay light (STYLE.md, Layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout}"


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level imports (also under module-level if/try), not ones deferred inside functions."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                n for h in getattr(node, "handlers", []) for n in h.body]
    return names


def test_service_never_imports_api_statically():
    """service/ may start the app by name ("api.app:create_app"), never import api/ at module level."""
    offenders = {
        path.name
        for path in (ROOT / "service").glob("*.py")
        if "api" in _module_level_imports(ast.parse(path.read_text()))
    }
    assert offenders == set()
