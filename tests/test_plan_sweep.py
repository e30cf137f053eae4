"""Plans byte for byte: a deterministic slice of bench/plan_sweep.py (every 25th of its ~12,700 spec × model ×
GPU × planner-argument entries, every strategy variant, PEFT method and precision among them) against the
digests committed in tests/data/plan_sweep_digests.json, recorded from the planner before it was split into
per-strategy and per-component modules (service/memory/), which changed none of them; re-recorded three times since:
when DDP's reducer buckets became held at every instant of a step (service/memory/strategies/ddp.py), which
changed the DDP-over-2-ranks entries and no other (bench/plan_sweep.py --check: 865 of 12,756, all ddp2), and
when DDP's accuracy margin rose from 0.11% to 0.13% (service/memory/accuracy.py: the chunked-loss rows), which
changed the DDP entries' need and margin and no other (1,726: ddp1 and ddp2), and when ZeRO-1's optimizer step
stopped holding the full gradients (service/memory/strategies/deepspeed.py: DeepSpeed frees them once reduced),
which changed the ZeRO-1 entries and no other (741, all zero1), and when the host plan learnt sharded loading
and streamed export with a job_phases table (issue 33: every plan gains job_phases, load/export bytes fall) while
packing became refused where examples cannot be kept apart (issue 34: 1,046 packed pipeline, tensor, prompt- and
prefix-tuning entries left the sweep, 12,756 -> 11,710).
A change to what the planner predicts fails here:
whoever makes one on purpose re-records the digests (``python bench/plan_sweep.py --slice 25 --save
tests/data/plan_sweep_digests.json``) and says why in the commit."""

from __future__ import annotations

import json
from pathlib import Path

from bench.plan_sweep import combined, sweep

DIGESTS = json.loads((Path(__file__).parent / "data" / "plan_sweep_digests.json").read_text())


def test_every_plan_of_the_sweep_slice_is_byte_identical():
    got = sweep(DIGESTS["slice"])
    want = DIGESTS["digests"]
    changed = [k for k in want if got.get(k) != want[k]]
    assert not changed, f"{len(changed)} of {len(want)} plans changed, e.g. {changed[:5]}"
    assert list(got) == list(want)  # the same entries, in the same order
    assert combined(got) == DIGESTS["combined"]
