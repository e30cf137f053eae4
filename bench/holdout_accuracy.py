"""Predicted vs measured memory per rank on the held-out matrix (bench/holdout_matrix.py), through the
workers' own training function.

    .venv/bin/python bench/holdout_accuracy.py --save holdout.json          # measure every case (~1 h)
    .venv/bin/python bench/holdout_accuracy.py --filter qwen3 --save q.json  # a slice
    .venv/bin/python bench/holdout_accuracy.py --load holdout.json           # re-predict, no training

Unlike bench/memory_accuracy.py, which rebuilds the step around random full-length batches, each case
here is a job as a user would submit it: the spec body is validated and derived by the service
(service/domain/spec.py), turned into the workers' arguments by workers/args.py, and trained by the
workers' strategy function (workers/strategies/) on a real JSONL file through the real tokeniser,
collation and sampler, on ``world`` gloo processes (workers/local.py). Telemetry traces every step;
a rank's measured peak is the highest profiler peak of steps 3 and later (optimizer states exist from
step 2). The prediction is the plan the service would store for the job.

Data: "long" rows fill max_seq_length after truncation; "chat" is examples/data/chat.jsonl (64 short
chats); "varied" is a generated chat file whose rows run from a few tokens to past max_seq_length.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.holdout_matrix import CHECKS, HOLDOUT, HoldoutCase, drawn  # noqa: E402

MiB = 2**20
STATES = ("parameters", "gradients", "optimizer_states")
STEPS = 4  # measured: steps 3 and 4
FSDP_STEPS = 5  # FSDP2 over gloo peaks differently from step to step: steps 3..5
CHAT = ROOT / "examples" / "data" / "chat.jsonl"
WORDS = ("the of and to in is was for on that with as by at from his her they this are have not be answer "
         "question user assistant system hello world model memory train token learn data what why how when "
         "where which who please thank you yes no one two three four five").split()


def write_long(path: Path, rows: int = 160, words: int = 2600, seed: int = 0) -> Path:
    """Text rows longer than 2048 tokens: every row fills max_seq_length after truncation."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")
    return path


def write_varied(path: Path, rows: int = 160, seed: int = 1) -> Path:
    """Chats of varied length: one to six turns, answers of 3 to 900 words (a few past 2048 tokens)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            messages = [{"role": "system", "content": "You answer briefly."}]
            for _ in range(rng.randint(1, 6 if rng.random() < 0.2 else 2)):
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))})
                n = int(rng.lognormvariate(3.5, 1.2))
                messages.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(max(3, min(n, 900))))})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def data_file(case: HoldoutCase, folder: Path) -> Path:
    if case.data == "chat":
        return CHAT
    if case.data == "varied":
        return write_varied(folder / "varied.jsonl")
    return write_long(folder / "long.jsonl")


def spec_body(case: HoldoutCase) -> dict:
    training = json.loads(json.dumps(case.training))
    steps = FSDP_STEPS if training.get("strategy") == "fsdp" else STEPS
    training.setdefault("hyperparameters", {})["max_steps"] = steps
    training.update(memory_trace_every_steps=1, telemetry_every_steps=1, checkpoint_every_steps=1000,
                    memory_policy="ignore")
    return {"model": f"preset:{case.family}", "training_file": "file-bench", "seed": 0, "training": training}


def validated(case: HoldoutCase):
    from service.domain.spec import SpecError, derive, validate_spec

    try:
        spec = validate_spec(spec_body(case))
    except SpecError as exc:
        return None, "; ".join(f"{p.param}: {p.message}" for p in exc.problems)
    return derive(spec).spec, None


def measure(case: HoldoutCase, folder: Path) -> dict:
    """Train the case for a few steps on its data; per rank the highest traced peak of steps ≥ 3."""
    from service.domain.spec import RunRequest
    from workers.args import train_args
    from workers.local import run_local

    spec, refused = validated(case)
    if spec is None:
        return {"name": case.name, "refused": refused}
    data = data_file(case, folder)
    out = folder / "out"
    req = RunRequest(job_id="holdout", spec=spec, training_path=str(data), output_dir=str(out))
    args = train_args(req)
    t0 = time.perf_counter()
    ranks = run_local(args, world_size=spec.training.resources.num_workers)
    seconds = time.perf_counter() - t0
    measured = []
    for rank, result in enumerate(ranks):
        samples = [m for r in result["reports"] if r.get("kind") == "metrics" for m in r.get("memory", ())]
        traced = [r for r in samples if r.get("phase") == "step" and r.get("source") == "profiler" and r["step"] >= 3]
        if not traced:
            raise RuntimeError(f"{case.name}: rank {rank} traced no step ≥ 3")
        best = max(traced, key=lambda r: r["peak_bytes"])
        measured.append(dict({k: best.get(k) for k in (
            "rank", "step", "peak_bytes", "parameters_bytes", "gradients_bytes", "optimizer_bytes", "other_bytes",
            "activations_bytes", "temporary_bytes", "host_parameters_bytes", "host_gradients_bytes",
            "host_optimizer_bytes")}, step_peaks=[r["peak_bytes"] for r in traced]))
    return {"name": case.name, "seconds": round(seconds, 1), "ranks": measured, "data": case.data}


_DATA_DIR: Path | None = None


def formed_width(case: HoldoutCase, rank: int, step: int) -> tuple[int, bool]:
    """The widest micro-batch rank ``rank`` trained at optimizer step ``step`` (1-based) and whether it held
    padding: the workers' own loader, tokenizer and seeded sampler (workers/strategies/common.py: prepare)
    rebuilt here, so these are the very rows of the measured step."""
    lengths, sampler, pieces = _trained_rows(case.name)
    widths = []
    for rows in sampler.micro_batches(step - 1, rank):
        row = [lengths[i] for i in rows]
        # a packed row of several examples is masked block-diagonally, as a padded one is (workers/data.py collate)
        widths.append((max(row), min(row) < max(row) or any(pieces[i] > 1 for i in rows)))
    return max(widths)


@functools.cache
def _trained_rows(name: str):
    """A case's training rows' token counts and its sampler, built once per case (every rank reads them)."""
    from workers.data import StepSampler, load_dataset
    from workers.models import load_tokenizer, resolve_model_dir

    case = next(c for c in [*HOLDOUT, *CHECKS] if c.name == name)
    spec, _ = validated(case)
    hp, r = spec.training.hyperparameters, spec.resolved()
    folder = _data_dir() / case.data
    folder.mkdir(exist_ok=True)
    tokenizer = load_tokenizer(resolve_model_dir(spec.model, None))
    train = load_dataset(str(data_file(case, folder)), tokenizer, hp.max_seq_length, hp.packing)
    sampler = StepSampler(len(train), r.micro_batch_size, r.gradient_accumulation_steps, r.data_parallel_size, r.seed)
    pieces = [sum(1 for t, p in enumerate(pos) if p == 0) for pos in train.positions] if train.positions else \
        [1] * len(train.examples)  # examples (or their pieces) each packed row holds
    return [len(ids) for ids, _ in train.examples], sampler, pieces


def _data_dir() -> Path:
    global _DATA_DIR
    if _DATA_DIR is None:
        _DATA_DIR = Path(tempfile.mkdtemp(prefix="memfit-holdout-data-"))
    return _DATA_DIR


def predict(case: HoldoutCase, rank: int, step: int | None = None) -> dict:
    """The plan the service stores for this job, for its data (service/memory/preflight.py: the widest
    micro-batch the rows can form, service/memory/data.py); for a pipeline the plan of the stage ``rank`` runs.
    With ``step``: the plan for the micro-batches that rank formed at that step (``formed_width``) instead —
    a run of a few steps on rows of varied length need not meet the data's widest micro-batch."""
    from service.domain.model_ref import resolve_model
    from service.memory.data import data_shape
    from service.memory.planner import plan
    from service.memory.shape import shape_for_model

    folder = _data_dir() / case.data
    folder.mkdir(exist_ok=True)
    path = data_file(case, folder)  # seeded: the very rows the case trained on
    spec, _ = validated(case)
    data = data_shape(spec, str(path))
    seq, padded = (data.planned_seq_length if data.measured else None), data.padded
    stages = spec.training.pipeline.stages if spec.training.strategy.value == "pipeline" else None
    if step is not None and not stages:
        seq, padded = formed_width(case, rank, step)
    p = plan(spec, shape_for_model(resolve_model(spec.model, ())), None, stage=rank % stages if stages else None,
             seq_length=seq, padded=padded)
    return p.model_dump(mode="json")


def measured_categories(r: dict) -> dict[str, int]:
    g = lambda k: int(r.get(k) or 0)  # noqa: E731
    return {"parameters": g("parameters_bytes") + g("host_parameters_bytes"),
            "gradients": g("gradients_bytes") + g("host_gradients_bytes"),
            "optimizer_states": g("optimizer_bytes") + g("host_optimizer_bytes"),
            "activations": g("activations_bytes"), "total": g("peak_bytes")}


def predicted_categories(p: dict) -> dict[str, int]:
    st = p["model_states"]
    out = {c: st["device"][c] + st["host"][c] for c in STATES}
    out["activations"] = p["per_rank"]["device"]["activations"] + p["per_rank"]["host"]["activations"]
    out["total"] = p["peak_bytes"]
    return out


def error(pred: int, meas: int) -> float | None:
    return None if not meas else (pred - meas) / meas


def report(results: list[dict]) -> int:
    rows, errs, state_errs, under, bound_misses = [], [], [], 0, 0
    for res in results:
        if "refused" in res:
            rows.append(f"| {res['name']} | refused: {res['refused']} | | | | | |")
            continue
        case = next(c for c in [*HOLDOUT, *CHECKS] if c.name == res["name"])
        # the planner predicts each model state on the rank that holds the most of it (FSDP2 shards on dim 0, ZeRO's
        # partitions end inside tensors): each rank's states are compared with the fullest rank's
        fullest = {c: max(measured_categories(r)[c] for r in res["ranks"]) for c in STATES}
        for r in res["ranks"]:
            m = {**measured_categories(r), **fullest}
            stored = predicted_categories(predict(case, r["rank"]))
            # varied/chat rows: the error is against the plan for the rows the measured step formed; the
            # service's plan (the widest micro-batch of the data) must be at least the measured peak
            p = predicted_categories(predict(case, r["rank"], r["step"])) if case.data != "long" else stored
            e = error(p["total"], m["total"])
            bound = error(stored["total"], m["total"])
            bound_misses += bound < -0.01
            errs.append(abs(e))
            under += e < -0.01
            se = [abs(error(p[c], m[c])) for c in STATES if m[c]]
            state_errs.extend(se)
            rows.append(f"| {res['name']} | {r['rank']} | {m['total'] / MiB:.1f} | {p['total'] / MiB:.1f} | "
                        f"{e:+.2%} | {max(se, default=0):.3%} | {stored['total'] / MiB:.1f} ({bound:+.1%}) |")
    print("| config | rank | measured MiB | predicted MiB | error | model states max error | plan for the data MiB |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if errs:
        print(f"\n{len(errs)} rank samples: max |error| {max(errs):.2%}, median {statistics.median(errs):.2%}, "
              f"under-predicted beyond 1%: {under}, model states max |error| {max(state_errs, default=0):.3%}, "
              f"within 3%: {sum(e <= 0.03 for e in errs)}/{len(errs)}; the plan for the data below the measured "
              f"peak by more than 1%: {bound_misses}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--filter", default="", help="comma-separated substrings; a case runs if its name has all")
    ap.add_argument("--skip", default="", help="comma-separated substrings; a case whose name has any is skipped")
    ap.add_argument("--checks", action="store_true",
                    help="run bench/holdout_matrix.py's CHECKS (written after the first run) instead of the matrix")
    ap.add_argument("--drawn", type=int, default=0,
                    help="instead of the matrix: this many configs drawn by bench/holdout_matrix.py: drawn (with --seed)")
    ap.add_argument("--seed", type=int, default=0, help="with --drawn: the draw's seed")
    ap.add_argument("--with-fsdp2", action="store_true",
                    help="with --drawn: draw FSDP2 at 2 workers too (bench/holdout_matrix.py: WITH_FSDP2)")
    ap.add_argument("--save", help="write the measurements (JSON) here")
    ap.add_argument("--load", help="comma-separated saved files: report them with the current planner")
    ap.add_argument("--fsdp-steps", type=int, default=FSDP_STEPS,
                    help=f"steps an FSDP2 case runs, all traced from step 3 (default {FSDP_STEPS}): its level varies "
                         "from step to step over gloo, so more steps meet more of them")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help=f"steps any other case runs, traced from step 3 (default {STEPS})")
    a = ap.parse_args(argv)
    globals()["FSDP_STEPS"] = a.fsdp_steps  # spec_body reads them
    globals()["STEPS"] = a.steps
    if a.drawn:  # (with --load too: report looks the saved cases up by name)
        from bench.holdout_matrix import STRATEGIES, WITH_FSDP2

        # where _trained_rows and predict look cases up by name
        CHECKS.extend(drawn(a.drawn, a.seed, WITH_FSDP2 if a.with_fsdp2 else STRATEGIES))
    if a.load:
        results = [r for f in a.load.split(",") for r in json.loads(Path(f).read_text())]
        return report(results)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wanted = [w for w in a.filter.split(",") if w]
    skipped = [w for w in a.skip.split(",") if w]
    pool = CHECKS[-a.drawn:] if a.drawn else (CHECKS if a.checks else HOLDOUT)
    cases = [c for c in pool if all(w in c.name for w in wanted) and not any(w in c.name for w in skipped)]
    results = []
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="memfit-holdout-") as tmp:
            print(f"… {case.name}", file=sys.stderr, flush=True)
            try:
                results.append(measure(case, Path(tmp)))
            except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the rest run
                results.append({"name": case.name, "refused": f"failed: {type(exc).__name__}: {str(exc)[:300]}"})
        if a.save:
            Path(a.save).write_text(json.dumps(results, indent=1))
    return report(results)


if __name__ == "__main__":
    raise SystemExit(main())
