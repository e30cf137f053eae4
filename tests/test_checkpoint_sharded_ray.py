"""FSDP2's sharded checkpoint through Ray Train (2 gloo workers): every rank's DCP shard file lands
in the one checkpoint folder Ray registers, and a worker group restarted after a rank died resumes
from it and repeats the losses of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from tests.test_workers_ray import _losses, _records, _request, presets  # noqa: E402,F401 - the fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_fsdp_restarted_after_a_worker_dies_resumes_from_every_ranks_shard(ray_session, presets, tmp_path):
    from workers.run import fit

    req = _request(tmp_path, "ftjob-fsdp-resume", presets["tiny-llama"],
                   {"strategy": "fsdp", "checkpoint_every_steps": 3, "max_failures": 1,
                    "hyperparameters": {"max_steps": 6}})
    fit(req, fail_at="5:1")  # rank 1 exits after optimizer step 5, before reporting it
    records = _records(req)
    checkpoints = [r for r in records if r["kind"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [3, 6]
    for c in checkpoints:  # Ray Train merged both ranks' folders: both shards, rank 0's metadata
        d = Path(c["path"])
        assert sorted(p.name for p in (d / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert not (d / "state.pt").exists() and (d / "scheduler.pt").is_file()
    assert sum(r["kind"] == "event" and r["message"] == "Resumed from the checkpoint of step 3" for r in records) == 1
    assert sorted({r["step"] for r in records if r["kind"] == "metrics" and r["rank"] == 0}) == [1, 2, 3, 4, 5, 6]

    # The same run uninterrupted: the same losses at every step, and the same exported model.
    ref = req.model_copy(update={"job_id": "ftjob-fsdp-ref", "output_dir": str(tmp_path / "ref"),
                                 "metrics_path": str(tmp_path / "ref.jsonl")})
    fit(ref)
    assert _losses(records) == pytest.approx(_losses(_records(ref)), rel=1e-5)
    result = [r for r in records if r["kind"] == "result"]
    assert len(result) == 1 and result[0]["artifacts"] == {"model": "model"}
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(Path(req.output_dir) / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(Path(ref.output_dir) / "model").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].allclose(b[k], rtol=1e-5, atol=1e-6), k
