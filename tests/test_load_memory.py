"""Host memory at real-model scale, in CI's budget (the ≥ 1B proof is bench/load_memory.py, figures in
docs/benchmarks/load_memory.md): a ~150M-parameter Llama-shaped model built here from a config, saved as bf16
safetensors in a model directory, fine-tuned over HTTP through Ray on 2 ranks with FSDP2 + LoRA, DeepSpeed ZeRO-3 +
LoRA and a 2-stage pipeline + LoRA. Each rank's host memory while it loads, measured from outside (a sampler of the
worker processes' resident memory) and by memfit's own phase telemetry, which agree, stays under
(checkpoint bytes ÷ ranks) + the largest block + 1 GiB; rank 0's merged export adds less than the largest block +
1 GiB to its resident memory and loads with the logits of the base with the trained adapter."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

STRATEGIES = ("fsdp", "zero3", "pipeline")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from bench.load_memory import write_model

    d = tmp_path_factory.mktemp("models") / "llama-150m"
    write_model(d, "small")
    return d


@pytest.fixture(scope="module")
def stack(new_database, ray_head, tmp_path_factory, model_dir):
    from tests.stack import Stack

    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("load-memory-storage"), ray_head, model_dirs=[model_dir.parent])
        from tests.factories import upload
        from tests.stack import rows

        s.text_file = upload(s.http, s.key, rows("text.jsonl"), name="text.jsonl")  # every token a label at 32
        s.start_scheduler()
        yield s
        s.close()


@pytest.fixture(scope="module")
def sampler():
    from bench.load_memory import RssSampler

    s = RssSampler().start()
    yield s
    s.stop()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_loads_its_share_and_the_export_streams(stack, sampler, model_dir, strategy):
    from bench.load_memory import (
        STRATEGIES as BODIES,
    )
    from bench.load_memory import (
        agree,
        job_body,
        logits_match,
        measure_job,
        model_facts,
    )

    facts = model_facts(model_dir)
    assert facts["parameters"] > 100e6 and facts["checkpoint_bytes"] == 2 * facts["parameters"]  # bf16
    stack.http.headers.update(stack.auth)
    res = measure_job(stack.http, sampler, facts, job_body(model_dir, BODIES[strategy], stack.text_file,
                                                           stack.text_file, steps=2), timeout_s=900)
    assert [r["rank"] for r in res["load"]] == [0, 1]
    for r in res["load"]:
        assert r["telemetry_bytes"] <= r["bound_bytes"], r
        assert r["sampler_bytes"] is not None and r["sampler_bytes"] <= r["bound_bytes"], r
        assert agree(r), r  # the outside sampler and the worker's own high-water mark
        # each rank read about its share of the checkpoint, not the whole model
        assert r["bytes_read"] < 0.6 * facts["checkpoint_bytes"], r
    e = res["export"]
    assert e is not None and e["added_bytes"] <= e["bound_added_bytes"], e
    lg = logits_match(model_dir, res["artifacts"])
    assert lg["merged_dtypes"] == ["torch.bfloat16"]
    assert lg["relative"] < 2e-2, lg  # bf16's rounding of the merged weights
    # the plan has every phase, and the memory view says which peaks
    assert set(res["planned"]) == {"load", "step", "eval", "checkpoint", "export"}
    assert res["view_phases"]["measured_peak"]["0"]["host"]["phase"]
