"""The drift alarm against the accuracy matrices' saved measurements: it must stay silent on every one.

    .venv/bin/python bench/alarm_silence.py                     # every bench/memory_accuracy.py file of 2026-12-06
    .venv/bin/python bench/alarm_silence.py FILE [FILE …]       # others saved with --save

Each saved config of bench/memory_accuracy.py (its Case and every rank's measured steps) is re-predicted with
the current planner (the bench's own ``predict``: the rank's stage for a pipeline) and every measured step peak
(``step_peaks``, else the rank's peak) goes through the drift rule of service/memory/alarms.py (``drifted``:
measured above the plan by more than the strategy's measured margin, service/memory/accuracy.py, and 256 KiB).
Prints the configs, the steps checked and every alarm that would fire; exit 1 when any does. (The leak rule reads
steps 3 onwards of a run; the matrices measured at most steps 3-5 of their runs, so it is checked on the HTTP jobs
of bench/step_accuracy.py and the session's finished job instead.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SAVED = ROOT / "docs" / "measurements" / "2026-12-06"
FILES = ("m1_fsdp2.json", "m2_fsdp2.json", "pp.json", "pp_gpt2.json", "mesh.json", "chunk_fsdp2.json", "chunk_all.json",
         "qlora_fsdp2.json", "qlora_all.json")


def check(paths: list[Path]) -> tuple[int, int, list[str]]:
    from bench.memory_accuracy import PIPELINES, Case, predict
    from service.domain.spec import JobSpec
    from service.memory.accuracy import accuracy_margin
    from service.memory.alarms import drifted

    configs = steps = 0
    alarms: list[str] = []
    for path in paths:
        for m in json.loads(Path(path).read_text()):
            case = Case(**m["case"])
            margin, _ = accuracy_margin(JobSpec.model_validate(case.spec_body()))
            configs += 1
            for rk in m["ranks"]:
                plan = predict(case, rk["rank"] if case.strategy in PIPELINES else None)
                for measured in rk.get("step_peaks") or [rk["peak_bytes"]]:
                    steps += 1
                    if drifted(plan["peak_bytes"], measured, margin):
                        alarms.append(f"{Path(path).name}: {case.name} rank {rk['rank']}: measured {measured}, "
                                      f"planned {plan['peak_bytes']} (margin {margin:.2%})")
    return configs, steps, alarms


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [SAVED / f for f in FILES]
    configs, steps, alarms = check(paths)
    for a in alarms:
        print("ALARM", a)
    print(f"{configs} configs, {steps} measured step peaks: {len(alarms)} drift alarm(s)")
    return 1 if alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
