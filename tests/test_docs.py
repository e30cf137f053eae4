"""The docs site (STYLE.md: the docs are a site, the README a front door): it builds with
`mkdocs build --strict` (no warning, no broken link or anchor), its generated pages cover every
JobSpec field and every API operation, and the README stays short."""

from __future__ import annotations

import html
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from api.app import create_app
from service.domain.spec import JobSpec
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module with the venv's mkdocs, as `make docs` builds it."""
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its successor, not a warning
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return out


def _models(annotation, in_list: bool = False):
    """(model, in a list?) for each pydantic model a field's annotation holds (directly, optional, list items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, in_list
        return
    for arg in typing.get_args(annotation):
        yield from _models(arg, in_list or typing.get_origin(annotation) is list)


def leaf_fields(model: type[BaseModel], prefix: str = ""):
    """Every field that holds a value, by dotted name (``a[].b``: field b of each item of list a)."""
    for name, field in model.model_fields.items():
        nested = next(_models(field.annotation), None)
        if nested is None:
            yield prefix + name, field
        else:
            inner, in_list = nested
            yield from leaf_fields(inner, prefix + name + ("[]." if in_list else "."))


def test_site_builds_strict(site):
    assert (site / "index.html").is_file()
    assert (site / "job-page.png").is_file()


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_every_spec_field_has_a_description():
    undocumented = [name for name, field in leaf_fields(JobSpec) if not (field.description or "").strip()]
    assert not undocumented, f"JobSpec fields without a description: {undocumented}"


def test_spec_page_lists_every_field(site):
    page = html.unescape((site / "spec" / "index.html").read_text())
    names = [name for name, _ in leaf_fields(JobSpec)]
    assert len(names) > 60 and "training.peft.r" in names and "integrations[].wandb.project" in names
    missing = [name for name in names if f"<code>{name}</code>" not in page]
    assert not missing, f"fields missing from the generated spec page: {missing}"


def test_api_page_lists_every_operation(site, tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db", storage_dir=tmp_path / "storage"))
    paths = app.openapi()["paths"]
    page = html.unescape((site / "api" / "index.html").read_text())
    assert "/v1/fine_tuning/jobs" in paths
    missing = [f"{method.upper()} {path}" for path, ops in paths.items() for method in ops
               if f"<code>{method.upper()} {path}</code>" not in page]
    assert not missing, f"operations missing from the generated API page: {missing}"
