"""What the scheduler reads off a running job (service/scheduler/loop.py): the stall bound
(Scheduler._stall_bound, how long a run may go without a new step; the end-to-end restart and
failure are tests/test_e2e.py -k stall) and Ray Train's retry decisions from the driver log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.domain.spec import JobSpec
from service.scheduler.loop import Scheduler, _Watch


def scheduler(**kw) -> Scheduler:
    return Scheduler(sessions=None, settings=SimpleNamespace(lease_seconds=30), ray=SimpleNamespace(call_timeout_s=60), **kw)


def watched(first: tuple[int, float], last: tuple[int, float]) -> _Watch:
    return _Watch(first_step=first, last_step=last)


def test_the_spec_bound_wins():
    assert scheduler()._stall_bound(watched((1, 0.0), (50, 10.0)), 42)[0] == 42.0


def test_a_slow_run_gets_ten_times_its_mean_step_time():
    bound, why = scheduler()._stall_bound(watched((1, 100.0), (11, 1100.0)), None)  # 100 s per step
    assert bound == pytest.approx(1000.0) and "mean step time" in why


def test_a_fast_run_gets_the_floor():
    s = scheduler(stall_floor_s=300.0)
    assert s._stall_bound(watched((1, 0.0), (101, 50.0)), None)[0] == 300.0  # 0.5 s per step
    assert s._stall_bound(watched((7, 5.0), (7, 5.0)), None)[0] == 300.0  # one step seen: no rate yet


def test_the_spec_refuses_a_bound_too_short_to_mean_anything():
    body = {"model": "preset:tiny-llama", "training_file": "file-x"}
    with pytest.raises(ValueError, match="stall_timeout_s"):
        JobSpec.model_validate({**body, "training": {"stall_timeout_s": 1}})
    assert JobSpec.model_validate({**body, "training": {"stall_timeout_s": 5}}).training.stall_timeout_s == 5


def test_a_ray_train_retry_is_told_with_its_source_and_count():
    from service.scheduler.loop import _retry_detail

    lines = ["(TrainController pid=77)   Source: controller", "(TrainController pid=77)   Error count: 2 (max allowed: inf)"]
    assert _retry_detail(lines) == ("controller", "2 (max allowed: inf)")
    assert _retry_detail(["  Source: worker group", "  Error count: 1 (max allowed: 2)"]) == ("worker group", "1 (max allowed: 2)")
    assert _retry_detail([]) == (None, None)  # the lines after it not read yet: the event says less
