"""Every example job spec under examples/ is a valid job: the schema, the cross-field rules, and
its data files (paths relative to the YAML) exist and validate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.domain.spec import JobSpec, check_rules

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPECS = sorted(EXAMPLES.glob("*.yaml"))


def test_there_is_an_example_per_strategy():
    names = {p.name for p in SPECS}
    assert "tiny-lora.yaml" in names
    strategies = {yaml.safe_load(p.read_text()).get("training", {}).get("strategy", "ddp") for p in SPECS}
    assert {"ddp", "fsdp", "deepspeed"} <= strategies


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_example_spec_is_valid(path):
    body = yaml.safe_load(path.read_text())
    assert path.read_text().startswith("# A memfit job"), "document the file format at the top"
    spec = JobSpec.model_validate(body)
    assert check_rules(spec) == []
    from service.domain.datafmt import validate_jsonl

    for field in ("training_file", "validation_file"):
        if body.get(field):
            data = (path.parent / body[field]).resolve()
            assert data.exists(), f"{field}: {data} is missing"
            assert validate_jsonl(data).rows > 0
