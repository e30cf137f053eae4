"""Every plan the planner makes, as a digest: the check that a refactor of service/memory/ changes no byte.

    .venv/bin/python bench/plan_sweep.py --count                       # how many entries the sweep has
    .venv/bin/python bench/plan_sweep.py --save /tmp/before.json       # a digest per entry (~1-2 min)
    .venv/bin/python bench/plan_sweep.py --check /tmp/before.json      # the same entries again: any difference?
    .venv/bin/python bench/plan_sweep.py --slice 37 --save tests/data/plan_sweep_digests.json

An entry is one (spec, model, GPU, planner arguments): the specs cover every strategy variant the
workers run (DDP over 1 and 2 ranks; FSDP2 with and without resharding and with CPU offload; ZeRO 0-3,
with each kind of offload; pipelines GPipe, 1F1B and interleaved 1F1B, with data-parallel replicas;
tensor parallel with and without FSDP2 replicas), every PEFT method, fp32/bf16 (fp16 on GPUs), with
and without checkpointing, crossed with every preset and a few hub shapes, twice; each entry then rotates
through micro-batch, sequence length, accumulation, attention kernel, chunked loss, activation offload,
QAT, a bucket size, virtual tokens and LoRA rank, the GPU (CPU workers with and without a host budget,
and four catalogue cards), and the planner's own arguments (a data-measured ``seq_length`` and
``padded``, a pipeline ``stage``). What is recorded per entry is the sha256 of
``plan(...).model_dump_json()``, or of the refusal's text where the planner refuses the spec (so a
refactor must refuse the same specs the same way); specs the spec rules refuse (``check_rules``) are
not entries. Every 7th entry also records ``suggest``'s changes (name, cost, predicted peak), which
compose many plans each.

The enumeration is deterministic (no randomness; the rotation is by the entry's index), so the same
code gives the same entries in the same order; ``--slice k`` keeps every k-th entry, what
tests/test_plan_sweep.py checks against its committed digests.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRESETS = ("tiny-llama", "tiny-gpt2", "tiny-qwen2", "small-llama", "small-qwen2", "small-gpt2", "small-gemma",
           "small-qwen3")
HUB = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2-0.5B", "openai-community/gpt2",
       "google/gemma-2b")
GPUS = (None, "host-budget", "a100-80gb", "l4", "v100-16gb", "h100-80gb")
PEFT = ("none", "lora", "qlora", "ia3", "loha", "lokr", "prefix_tuning", "prompt_tuning")

# (name, workers, training fields) for each strategy variant the workers build
STRATEGIES: tuple[tuple[str, int, dict], ...] = (
    ("ddp1", 1, {"strategy": "ddp"}),
    ("ddp2", 2, {"strategy": "ddp"}),
    ("fsdp2", 2, {"strategy": "fsdp"}),
    ("fsdp2_noreshard", 2, {"strategy": "fsdp", "fsdp": {"reshard_after_forward": False}}),
    ("fsdp2_offload", 2, {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}),
    ("fsdp4", 4, {"strategy": "fsdp"}),
    ("zero0", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 0}}),
    ("zero1", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 1}}),
    ("zero2", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}),
    ("zero2_4", 4, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}),
    ("zero2_offload", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}}),
    ("zero3", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}}),
    ("zero3_offload", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu",
                                                                   "offload_param": "cpu"}}),
    ("zero3_offload_opt", 2, {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu"}}),
    ("pp2_1f1b", 2, {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "1f1b"}}),
    ("pp2_gpipe", 2, {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "gpipe"}}),
    ("pp2_interleaved", 2, {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "interleaved_1f1b"}}),
    ("pp2x2", 4, {"strategy": "pipeline", "pipeline": {"stages": 2, "schedule": "1f1b"}}),
    ("tp2", 2, {"strategy": "tensor"}),
    ("tp2x2", 4, {"strategy": "tensor", "tensor_parallel": {"size": 2}}),
)

MICRO = (1, 2, 4, 8)
SEQ = (64, 128, 512, 1024, 2048)
ACCUM = (1, 2, 3)


def _rot(i: int, options, salt: int = 0):
    """The option of entry ``i`` for one axis: deterministic, each axis mixed with its own salt so that the axes
    vary independently of each other and of the product's order."""
    return options[int.from_bytes(hashlib.blake2b(f"{i}:{salt}".encode(), digest_size=8).digest(), "big") % len(options)]


def _body(model: str, strategy: tuple[str, int, dict], peft: str, precision: str, ckpt: bool, i: int,
          gpu: str | None) -> dict:
    name, workers, fields = strategy
    training: dict = json.loads(json.dumps(fields))
    micro = _rot(i, MICRO, 1)
    if name.startswith("pp") and fields["pipeline"]["schedule"] != "gpipe":
        micro = max(micro, 2 if name != "pp2_interleaved" else 4)
    hp = {"micro_batch_size": micro, "gradient_accumulation_steps": _rot(i, ACCUM, 2),
          "max_seq_length": _rot(i, SEQ, 3)}
    if _rot(i, (0, 0, 0, 1), 4):
        hp["packing"] = True
    training["hyperparameters"] = hp
    training["resources"] = {"num_workers": workers}
    if gpu not in (None, "host-budget"):
        training["resources"].update(gpus_per_worker=1, gpu_type=gpu)
    elif gpu == "host-budget":
        training["resources"]["host_memory_budget_bytes"] = _rot(i, (2**30, 8 * 2**30, 64 * 2**30), 5)
    training["precision"] = precision
    training["gradient_checkpointing"] = ckpt
    peft_opts: dict = {"method": peft}
    if peft != "none":
        peft_opts["r"] = _rot(i, (4, 8, 16, 64), 6)
        peft_opts["merge"] = False
        if peft in ("prefix_tuning", "prompt_tuning"):
            peft_opts["num_virtual_tokens"] = _rot(i, (8, 16, 32), 7)
        if _rot(i, (0, 0, 1), 8) and peft in ("lora", "ia3"):
            peft_opts["target_modules"] = ["q_proj", "v_proj"] if "gpt2" not in model else ["c_attn"]
    training["peft"] = peft_opts
    extra = _rot(i, ("none", "eager", "chunked", "offload", "qat", "bucket", "none", "micro_chunks"), 9)
    if extra == "eager":
        training["attention"] = "eager"
    elif extra == "chunked":
        training["loss_chunk_tokens"] = _rot(i, (64, 256, 1024), 10)
    elif extra == "offload" and gpu not in (None, "host-budget"):
        training["activation_offload"] = True
    elif extra == "qat" or (peft == "none" and name.startswith("ddp") and _rot(i, (0, 1), 16)):
        training["qat"] = {"enabled": True, "group_size": _rot(i, (32, 64), 11),
                           "scheme": _rot(i, ("int8-dynamic-act-int4-weight", "int4-weight-only"), 12)}
    elif extra == "bucket" and name.startswith("zero"):
        training["deepspeed"] = {**training.get("deepspeed", {}), "reduce_bucket_elements": 1_000_000}
    elif extra == "micro_chunks" and name.startswith("pp") and micro % 2 == 0:
        training["pipeline"] = {**training["pipeline"], "microbatches": max(2, micro // 2) if
                                fields["pipeline"]["schedule"] != "1f1b" else micro}
    training["memory_policy"] = "ignore"
    return {"model": model if model.count("/") else f"preset:{model}" if model in PRESETS else model,
            "training_file": "file-sweep", "seed": 7, "training": training}


def entries():
    """(key, body, gpu, planner kwargs) for every entry, in order; bodies the spec rules refuse are skipped."""
    from service.domain.spec import check_rules, validate_spec
    from service.domain.errors import SpecInvalid

    models = PRESETS + HUB
    i = 0
    for model, strategy, peft, precision, ckpt, _variant in itertools.product(
            models, STRATEGIES, PEFT, ("fp32", "bf16", "fp16"), (False, True), (0, 1)):
        i += 1
        gpu = _rot(i, GPUS, 13)
        if precision == "fp16" and gpu in (None, "host-budget"):
            continue
        if precision == "bf16" and gpu == "v100-16gb":
            gpu = "a100-80gb"
        body = _body(model, strategy, peft, precision, ckpt, i, gpu)
        try:
            spec = validate_spec(body, None)
        except (SpecInvalid, ValueError):
            continue
        if check_rules(spec):
            continue
        kwargs: dict = {}
        shape_arg = _rot(i, ("bound", "bound", "data", "data_padded"), 14)
        if shape_arg != "bound":
            max_seq = spec.training.hyperparameters.max_seq_length
            kwargs["seq_length"] = max(8, max_seq * 3 // 5)
            kwargs["padded"] = shape_arg == "data_padded"
        if strategy[0].startswith("pp") and _rot(i, (0, 0, 1), 15):
            kwargs["stage"] = 1
        key = f"{i}:{model}:{strategy[0]}:{peft}:{precision}:{'ckpt' if ckpt else 'nockpt'}:{gpu}:{shape_arg}"
        yield key, spec, (None if gpu in (None, "host-budget") else gpu), kwargs


def _shape(model: str):
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model

    return shape_for_model(resolve_model(model, ()))


def digest(spec, gpu, kwargs, with_suggestions: bool, shapes: dict) -> str:
    from service.memory.planner import plan, suggest

    shape = shapes.get(spec.model)
    if shape is None:
        shape = shapes[spec.model] = _shape(spec.model)
    try:
        text = plan(spec, shape, gpu, **kwargs).model_dump_json()
    except Exception as exc:  # noqa: BLE001 - the planner's refusal is part of what must not change
        text = f"refused {type(exc).__name__}: {exc}"
    if with_suggestions:
        try:
            kw = {k: v for k, v in kwargs.items() if k != "stage"}
            text += json.dumps([(c.change, c.cost, c.plan.peak_bytes, c.plan.fits) for c in suggest(spec, shape, gpu, **kw)])
        except Exception as exc:  # noqa: BLE001
            text += f"suggest refused {type(exc).__name__}: {exc}"
    return hashlib.sha256(text.encode()).hexdigest()


def sweep(every: int = 1) -> dict[str, str]:
    shapes: dict = {}
    out = {}
    for n, (key, spec, gpu, kwargs) in enumerate(entries()):
        if n % every:
            continue
        out[key] = digest(spec, gpu, kwargs, with_suggestions=n % 7 == 0, shapes=shapes)
    return out


def combined(digests: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in digests.items()).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", action="store_true", help="only count the entries")
    ap.add_argument("--slice", type=int, default=1, help="keep every k-th entry")
    ap.add_argument("--save", help="write {entry: sha256} here")
    ap.add_argument("--check", help="compare with a saved file; exit 1 on any difference")
    args = ap.parse_args(argv)
    if args.count:
        print(sum(1 for _ in entries()))
        return 0
    t0 = time.perf_counter()
    got = sweep(args.slice)
    took = time.perf_counter() - t0
    print(f"{len(got)} entries in {took:.1f} s, combined sha256 {combined(got)}")
    if args.save:
        Path(args.save).write_text(json.dumps({"slice": args.slice, "combined": combined(got), "digests": got},
                                              indent=0, sort_keys=False))
    if args.check:
        want = json.loads(Path(args.check).read_text())["digests"]
        missing = [k for k in want if k not in got]
        changed = [k for k in want if k in got and got[k] != want[k]]
        extra = [k for k in got if k not in want]
        for k in changed[:20]:
            print("changed:", k)
        print(f"{len(changed)} changed, {len(missing)} missing, {len(extra)} new of {len(want)}")
        return 1 if changed or missing or extra else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
