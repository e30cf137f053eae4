"""A slice of bench/memory_accuracy.py's matrix: the planner's per-rank peak is within 5% of what
telemetry measures on real training steps, and parameters/gradients/optimizer states within 1%.
(The full matrix and its table: `.venv/bin/python bench/memory_accuracy.py`.)"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # trains or fuzzes: not in `make test-fast`

from bench.memory_accuracy import (  # noqa: E402
    Case,
    fullest_rank_states,
    measure,
    measured_categories,
    predict,
    predicted_categories,
    run_rank,
)

SLICE_IN_PROCESS = [
    Case("small-llama", 128, "none", "fp32", False, "ddp1"),
    Case("small-qwen2", 128, "lora", "bf16", True, "ddp1"),  # Qwen2: GQA 4:1, tied embeddings, qkv bias
]
SLICE_TWO_RANKS = [
    Case("small-qwen2", 128, "none", "bf16", False, "fsdp2", steps=5),
    Case("small-llama", 128, "lora", "bf16", False, "zero3"),  # ZeRO-3's linear keeps LoRA's frozen inputs
]


@pytest.fixture(scope="module")
def model_dirs():
    from workers.models import build_preset

    return {f: str(build_preset(f"preset:{f}")) for f in ("small-llama", "small-qwen2")}


def check(case: Case, ranks: list[dict]) -> None:
    pred = predicted_categories(predict(case))
    for rk in ranks:
        meas = measured_categories(rk)
        err = (pred["total"] - meas["total"]) / meas["total"]
        assert abs(err) <= 0.05, f"{case.name} rank {rk['rank']}: predicted {pred['total']} measured {meas['total']} ({err:+.2%})"
    states = fullest_rank_states(ranks)  # the planner predicts the rank that holds the most
    for c in ("parameters", "gradients", "optimizer_states"):
        assert abs(pred[c] - states[c]) <= 0.01 * max(states[c], 1) + 4096, (case.name, c, pred[c], states[c])


def test_tensor_parallel_lora_checkpointing_is_planned_at_every_steps_peak(model_dirs):
    """Strategy tensor with the vocabulary split, LoRA, autocast and checkpointing: the three terms found in its
    peak (the embedding's partial lookup kept as a leaf, LoRA's recast of o_proj's input, no kept cast of block
    0's frozen q/k/v weights). Every step's peak (steps 3-5, both ranks) is within 1% of the plan; without the
    terms the plan is ~1.4 MiB under. (Before traces paused after each collective's wait, some steps showed an
    all-reduce output more, freed on gloo's thread where the profiler records no free.)"""
    case = Case("small-llama", 128, "lora", "bf16", True, "tp2", steps=5)
    res = measure(case, model_dirs[case.family], timeout_s=240)
    peaks = [p for rk in res["ranks"] for p in rk["step_peaks"]]
    planned = predicted_categories(predict(case))["total"]
    assert all(abs(planned - p) <= 0.01 * p for p in peaks), (planned, peaks)


def test_fsdp2_peaks_at_one_level_the_root_reduce_scatter_planned(model_dirs):
    """FSDP2 × 2 over gloo, full fp32 fine-tune with checkpointing, small-llama (untied head) at seq 128: the step
    peaks at the root's reduce-scatter — its input, gloo's copy of it and lm_head's gradient, which foreach_reduce's
    loop variable keeps (planner.py: fsdp_root_reduce). Every step's peak (steps 3-5, both ranks) is within 1% of
    the plan. The planner that predicted the upper level of a gloo race there was 22.9% over; traces that did not
    pause after FSDP2's waits read up to four levels, by whole units, from step to step."""
    case = Case("small-llama", 128, "none", "fp32", True, "fsdp2", steps=5)
    res = measure(case, model_dirs[case.family], timeout_s=240)
    peaks = [p for rk in res["ranks"] for p in rk["step_peaks"]]
    planned = predicted_categories(predict(case))["total"]
    assert predict(case)["peak_phase"] == "root_reduce"
    assert all(abs(planned - p) <= 0.01 * p for p in peaks), (planned, peaks)


def test_pipeline_stages_peak_where_their_plans_say_receive_buffers_and_held_sends_included(model_dirs):
    """Two 1F1B stages, small-llama LoRA fp32 + checkpointing at seq 512 (4 chunks): each rank's every step peak
    (steps 3-4) within 1% of its own stage's plan. The telemetry counts the stages' receive buffers (workers/
    strategies/pipeline.py: recv_buffers; 2 MiB a rank here, which CPU traces cannot see), and the plan has them,
    chunk 0's output that Schedule1F1B's send_work keeps, and the MLP backward's three gradients. Before these,
    rank 0 was planned 1.5% under what it holds, and the telemetry read 2 MiB less than the process held."""
    case = Case("small-llama", 512, "lora", "fp32", True, "pp2", steps=4)
    res = measure(case, model_dirs[case.family], timeout_s=240)
    for rk in res["ranks"]:
        planned = predict(case, rk["rank"])["peak_bytes"]
        assert all(abs(planned - p) <= 0.01 * p for p in rk["step_peaks"]), (rk["rank"], planned, rk["step_peaks"])
        assert rk["other_bytes"] >= 4 * 512 * 256 * 4, rk  # each stage's 4 receive buffers of 1 × 512 × 256 fp32


@pytest.mark.parametrize("case", SLICE_IN_PROCESS, ids=lambda c: c.name.replace(" ", "_"))
def test_single_worker_peak_within_5_percent(case, model_dirs, tmp_path):
    records = run_rank(0, case, 0, model_dirs[case.family], {"dir": str(tmp_path)})
    steps = [r for r in records if r["phase"] == "step" and r.get("peak_bytes")]
    assert steps and steps[0]["step"] == 3
    check(case, [{**steps[0], "phase_peaks": {}}])


@pytest.mark.parametrize("case", SLICE_TWO_RANKS, ids=lambda c: c.name.replace(" ", "_"))
def test_two_rank_peak_within_5_percent(case, model_dirs):
    res = measure(case, model_dirs[case.family], timeout_s=240)
    assert len(res["ranks"]) == 2
    check(case, res["ranks"])


def test_drawn_configs_are_fixed_by_their_seed_and_are_jobs_the_service_accepts():
    """bench/holdout_matrix.py: drawn — the configs nobody chose: the same draw for the same seed, another for
    another seed, every one a spec the service validates, none from the refused GPT-2 LyCORIS pairs."""
    from bench.holdout_accuracy import validated
    from bench.holdout_matrix import drawn

    first, again, other = drawn(12, 1), drawn(12, 1), drawn(12, 2)
    assert [c.name for c in first] == [c.name for c in again] != [c.name for c in other]
    assert len({c.name for c in first}) == 12
    for case in first + other:
        spec, refused = validated(case)
        assert spec is not None, (case.name, refused)
        assert not (case.family == "small-gpt2" and spec.training.peft.method.value in ("loha", "lokr"))


def test_zero3_prompt_tuning_is_planned_at_its_measured_level(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 with prompt tuning (no q/k/v adapter): ZeRO-3's linear keeps every frozen linear's input that
    needs a gradient — each block's attention input and the LM head's — which the planner once left out (3.9 MiB,
    −1.21%). Every step's peak (steps 3-6, both ranks) is planned, and the plan is not more than 3% above the
    lowest. (Before traces paused after each collective's wait, some steps showed one more embedding-sized buffer:
    gloo's thread had freed it, unrecorded; workers/telemetry.py: _CollectiveWaits.)"""
    from bench import holdout_accuracy
    from bench.holdout_matrix import CHECKS

    monkeypatch.setattr(holdout_accuracy, "STEPS", 6)
    case = next(c for c in CHECKS if c.name == "check llama s384 prompt_tuning fp32 zero3×2 mb2")
    res = holdout_accuracy.measure(case, tmp_path)
    peaks = [p for rk in res["ranks"] for p in rk["step_peaks"]]
    planned = holdout_accuracy.predicted_categories(holdout_accuracy.predict(case, 0))["total"]
    assert max(peaks) <= planned <= 1.03 * min(peaks), (planned, peaks)
