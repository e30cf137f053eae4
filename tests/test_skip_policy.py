"""No silent skips in CI: under MEMFIT_NO_SKIPS=1 (set by .ci/run) a skip whose reason is not in
tests/skip_allowlist.txt fails, whether it happens in a test or at collection (a module-level
``pytest.importorskip``); an allowed reason still skips, and without the flag every skip is a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import allowed_skips
from tests.test_pg_fallback import outcomes

REPO = Path(__file__).resolve().parent.parent

CASES = '''
import pytest

def test_skips_for_an_unlisted_reason():
    pytest.skip("the frobnicator extra is not installed")

def test_skips_for_a_listed_reason():
    pytest.skip("needs CUDA")

def test_passes():
    pass
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("a_module_that_is_not_installed_anywhere")

def test_never_collected():
    pass
'''


def run(tmp_path: Path, source: str, no_skips: bool) -> tuple[subprocess.CompletedProcess, Path]:
    test = tmp_path / "test_cases.py"
    test.write_text(source)
    junit = tmp_path / f"junit-{no_skips}.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("MEMFIT_NO_SKIPS", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env.update(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    if no_skips:
        env["MEMFIT_NO_SKIPS"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), f"--junitxml={junit}", str(test)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return done, junit


@pytest.mark.parametrize("no_skips", [True, False], ids=["ci", "developer"])
def test_a_skip_fails_only_in_ci_and_only_when_its_reason_is_not_allowed(tmp_path, no_skips):
    done, junit = run(tmp_path, CASES, no_skips)
    assert outcomes(junit) == {"test_skips_for_an_unlisted_reason": "failed" if no_skips else "skipped",
                               "test_skips_for_a_listed_reason": "skipped", "test_passes": "passed"}, done.stdout[-3000:]
    if no_skips:
        assert "not in tests/skip_allowlist.txt" in done.stdout and "frobnicator" in done.stdout


@pytest.mark.parametrize("no_skips", [True, False], ids=["ci", "developer"])
def test_a_module_skipped_at_collection_fails_in_ci(tmp_path, no_skips):
    done, _ = run(tmp_path, MODULE_SKIP, no_skips)
    if no_skips:
        assert done.returncode != 0 and "a_module_that_is_not_installed_anywhere" in done.stdout, done.stdout[-3000:]
    else:
        assert done.returncode == 5 and "1 skipped" in done.stdout, done.stdout[-3000:]  # 5: nothing ran


def test_every_allowlist_entry_says_why():
    entries = allowed_skips()
    assert entries and all(len(why) > 40 for _, why in entries)
