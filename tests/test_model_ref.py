"""A job's ``model`` → preset / local directory / hub id, in one place (service/domain/model_ref.py), and
the callers that used to keep their own copy — job creation, the scheduler's validation, the planner's
shape lookup, the workers — answering the same for the same string."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.domain.model_ref import ModelRef, ModelRefError, resolve_model
from service.domain.presets import PRESETS

LLAMA = json.dumps(PRESETS["tiny-llama"])


@pytest.fixture
def dirs(tmp_path):
    """Two model directories: /a holds tiny (a config.json), org/name (one too) and empty (none); /b holds other."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d, cfg in ((a / "tiny", LLAMA), (a / "org" / "name", LLAMA), (a / "empty", None), (b / "other", LLAMA)):
        d.mkdir(parents=True)
        if cfg:
            (d / "config.json").write_text(cfg)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text(LLAMA)
    (a / "escape").symlink_to(tmp_path / "outside")
    return [a, b]


def _refused(model: str, model_dirs, **kw) -> ModelRefError:
    with pytest.raises(ModelRefError) as caught:
        resolve_model(model, model_dirs, **kw)
    assert caught.value.param == "model" and caught.value.status == 422
    return caught.value


def test_presets(dirs):
    assert resolve_model("preset:tiny-llama", dirs) == ModelRef("preset", "preset:tiny-llama", preset="tiny-llama")
    err = _refused("preset:nope", dirs)
    assert err.code == "model_not_found"
    assert err.message == f"unknown preset 'preset:nope'; known: {', '.join('preset:' + n for n in PRESETS)}"


def test_local_paths_must_lie_inside_a_model_dir_and_hold_config_json(dirs, tmp_path):
    ref = resolve_model(str(dirs[0] / "tiny"), dirs)
    assert (ref.kind, ref.path, ref.local_dir) == ("local", dirs[0] / "tiny", str(dirs[0] / "tiny"))
    assert resolve_model(str(dirs[1] / "other" / ".." / "other"), dirs).path == dirs[1] / "other"
    for outside in ("/etc", "../../etc/passwd", str(tmp_path / "outside"), str(dirs[0] / "escape"),
                    str(dirs[0] / ".." / "outside"), "a/b/c", "C:\\models\\x"):
        err = _refused(outside, dirs)
        assert err.code == "model_not_allowed", outside
        assert err.message == (f"model {outside!r} is a local path outside MEMFIT_MODEL_DIRS; "
                               "a local model must lie inside one of them")
    assert _refused(str(dirs[0] / "empty"), dirs).message == f"model directory {str(dirs[0] / 'empty')!r} has no config.json"
    missing = _refused(str(dirs[0] / "missing"), dirs)
    assert (missing.code, missing.message) == ("model_not_found", f"model directory {str(dirs[0] / 'missing')!r} does not exist")
    assert _refused(str(dirs[0] / "tiny"), []).code == "model_not_allowed"  # no model dirs: no local path at all


def test_a_name_inside_a_model_dir_comes_before_a_hub_id(dirs):
    assert resolve_model("tiny", dirs).path == dirs[0] / "tiny"
    assert resolve_model("other", dirs).path == dirs[1] / "other"  # the second directory is searched too
    assert resolve_model("org/name", dirs) == ModelRef("local", "org/name", path=dirs[0] / "org" / "name")
    assert resolve_model("org/name", []) == ModelRef("hub", "org/name", hub_id="org/name")
    assert resolve_model("Qwen/Qwen2.5-0.5B", dirs) == ModelRef("hub", "Qwen/Qwen2.5-0.5B", hub_id="Qwen/Qwen2.5-0.5B")
    assert resolve_model("Qwen/Qwen2.5-0.5B", dirs).local_dir is None
    err = _refused("empty", dirs)
    assert (err.code, err.message) == ("model_not_found", "model directory 'empty' has no config.json")
    assert _refused("org/", dirs).message == "model directory 'org/' has no config.json"  # a directory, not a model
    # A symlink inside a model directory that points out of it is not allowed (tests/test_paths.py).
    assert _refused("escape", dirs).code == "model_not_allowed"


@pytest.mark.parametrize("model", ["not a model", "gpt2", "tiny-nope", "x/", "/", "", "org/.."])
def test_anything_else_is_invalid(dirs, model):
    err = _refused(model, dirs)
    if model == "/":
        assert err.code == "model_not_allowed"
        return
    assert err.code == "invalid_model"
    assert err.message == (f"model {model!r} is not 'preset:<name>', a directory under MEMFIT_MODEL_DIRS, "
                           "or a hub id 'org/name'")


def test_a_resolved_model_path_wins_and_is_only_checked_for_config_json(dirs, tmp_path):
    outside = str(tmp_path / "outside")
    assert resolve_model("preset:tiny-llama", [], model_path=outside) == ModelRef(
        "local", "preset:tiny-llama", path=Path(outside))
    assert _refused("x/y", [], model_path=str(dirs[0] / "empty")).message == (
        f"model directory {str(dirs[0] / 'empty')!r} has no config.json")


# --- the callers agree --------------------------------------------------------------------------


def _settings(tmp_path, model_dirs):
    from service.settings import Settings

    return Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_dir=tmp_path / "storage",
                    model_dirs=model_dirs)


def _validate(settings, model: str, tmp_path):
    """The scheduler's validating_files stage on a job whose data is fine (a stub session hands out the file)."""
    from service.scheduler.validate import validate_job

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    file = SimpleNamespace(tenant_id="t", path=str(data), filename="train.jsonl")
    session = SimpleNamespace(get=lambda cls, key: file)
    job = SimpleNamespace(tenant_id="t", spec={"model": model, "training_file": "file-1"})
    return validate_job(session, job, settings)


def test_the_scheduler_fails_a_job_with_the_resolvers_code_and_message(dirs, tmp_path):
    from service.scheduler.validate import ValidationFailed

    settings = _settings(tmp_path, dirs)
    for model, code in (("preset:nope", "model_not_found"), ("/etc", "model_not_allowed"),
                        (str(dirs[0] / "empty"), "model_not_found"), ("empty", "model_not_found"),
                        ("gpt2", "invalid_model")):
        with pytest.raises(ValidationFailed) as caught:
            _validate(settings, model, tmp_path)
        expected = _refused(model, dirs)
        assert caught.value.error == {"code": code, "message": expected.message, "param": "model", "details": {}}
    spec, plan = _validate(settings, "tiny", tmp_path)  # a name in a model dir: planned from its config.json
    assert plan["model"]["source"] == "local" and plan["model"]["num_layers"] == PRESETS["tiny-llama"]["num_hidden_layers"]


def test_the_planner_reads_the_shape_the_resolver_points_at(dirs, tmp_path):
    from service.domain.spec import JobSpec
    from service.memory.preflight import UnknownModelShape, resolve_shape

    settings = _settings(tmp_path, dirs)

    def spec(model):
        return JobSpec.model_validate({"model": model, "training_file": "file-1"})

    assert resolve_shape(spec("preset:tiny-gpt2"), settings).source == "preset"
    assert resolve_shape(spec("org/name"), settings).source == "local"
    assert resolve_shape(spec(str(dirs[0] / "tiny")), settings).shape.num_layers == 2
    assert resolve_shape(spec("meta-llama/Llama-2-7b-hf"), settings).source == "hub"
    for model, why in (("someorg/some-model", "is a hub id whose shape the planner does not know"),
                       ("/etc", "outside MEMFIT_MODEL_DIRS"), ("preset:nope", "unknown preset")):
        with pytest.raises(UnknownModelShape) as caught:
            resolve_shape(spec(model), settings)
        assert str(caught.value).startswith(f"unknown model shape for {model!r}: ") and why in str(caught.value)


def test_the_workers_resolve_the_same_way(dirs, tmp_path, monkeypatch):
    """Workers have no MEMFIT_MODEL_DIRS: the run request's model_path is the directory; the refusals
    are the resolver's messages."""
    from workers.models import ModelSourceError, resolve_model_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    tiny = resolve_model("tiny", dirs)
    assert resolve_model_dir("tiny", tiny.local_dir) == tiny.local_dir
    assert resolve_model_dir("org/name") == "org/name"  # the scheduler found no directory: a hub id
    for model, model_path in (("preset:nope", None), ("gpt2", None), (str(dirs[0] / "tiny"), None),
                              ("empty", str(dirs[0] / "empty"))):
        with pytest.raises(ModelSourceError) as caught:
            resolve_model_dir(model, model_path)
        assert str(caught.value) == _refused(model, [], model_path=model_path).message
