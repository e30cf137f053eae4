"""The preset cache on a cold machine: many processes building at once, a folder poisoned by a crash
or a stray writer, and the publication protocol itself (workers/published.py) without a host lock,
as on a filesystem several nodes share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.published import SEAL, is_published, publish_once

ROOT = Path(__file__).resolve().parent.parent

# A build that takes a while and writes its files one by one, so that racing builders overlap.
_BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from workers.published import publish_once

    target, start_at, lock = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "lock"
    while time.time() < start_at:
        time.sleep(0.005)

    def build(tmp):
        for i in range(5):
            (tmp / f"part-{i}.bin").write_bytes(bytes([i]) * (1000 + i))
            time.sleep(0.02)

    print(publish_once(target, "k1", build, lock=lock))
""")


def _race(target: Path, n: int, *, lock: bool) -> list[str]:
    start_at = time.time() + 2.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(target), str(start_at), "lock" if lock else "nolock"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.") and not p.name.endswith(".lock"))


@pytest.mark.parametrize("lock", [True, False], ids=["host-lock", "no-lock (shared filesystem)"])
def test_sixteen_builders_at_once_publish_one_whole_directory(tmp_path, lock):
    target = tmp_path / "cache" / "thing"
    outs = _race(target, 16, lock=lock)
    assert set(outs) == {str(target)}
    assert is_published(target, "k1")
    assert sorted(p.name for p in target.iterdir()) == sorted([SEAL] + [f"part-{i}.bin" for i in range(5)])
    assert _leftovers(target.parent, "thing") == []  # no temporary or set-aside folder remains


def test_a_reader_sees_nothing_or_the_whole_directory(tmp_path):
    """Poll the target while a slow build runs: it never exists half-written."""
    target = tmp_path / "thing"
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(target), str(time.time()), "lock"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    seen = set()
    while proc.poll() is None:
        if target.exists():
            seen.add(tuple(sorted(p.name for p in target.iterdir())))
    proc.communicate()
    assert proc.returncode == 0
    whole = tuple(sorted([SEAL] + [f"part-{i}.bin" for i in range(5)]))
    assert seen <= {whole}


@pytest.mark.parametrize("poison", ["tokenizer-only", "crashed-before-seal", "truncated-after-seal", "a-file", "wrong-key"])
def test_a_poisoned_target_is_replaced_not_reused(tmp_path, poison):
    target = tmp_path / "thing"

    def build(tmp: Path) -> None:
        (tmp / "weights.bin").write_bytes(b"w" * 4096)
        (tmp / "config.json").write_text("{}")

    if poison == "a-file":
        target.write_text("not a directory")
    else:
        target.mkdir()
        if poison == "tokenizer-only":  # what the cold-start report found left in the cache
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                (target / name).write_text("{}")
        elif poison == "crashed-before-seal":
            (target / "config.json").write_text("{}")
        else:
            build(target)
            files = {"weights.bin": 4096, "config.json": 2}
            (target / SEAL).write_text(json.dumps({"key": "other" if poison == "wrong-key" else "k1", "files": files}))
            if poison == "truncated-after-seal":
                (target / "weights.bin").write_bytes(b"w" * 10)
    assert not is_published(target, "k1")
    assert publish_once(target, "k1", build) == target
    assert is_published(target, "k1")
    assert sorted(p.name for p in target.iterdir()) == sorted([SEAL, "config.json", "weights.bin"])
    assert _leftovers(tmp_path, "thing") == []


def test_a_stray_writer_into_the_target_during_the_build_does_not_break_it(tmp_path):
    target = tmp_path / "thing"

    def build(tmp: Path) -> None:
        # While we build, something else creates the final folder and writes into it.
        target.mkdir(exist_ok=True)
        (target / "tokenizer.json").write_text("{}")
        (tmp / "weights.bin").write_bytes(b"w" * 100)

    publish_once(target, "k1", build)
    assert is_published(target, "k1")
    assert sorted(p.name for p in target.iterdir()) == [SEAL, "weights.bin"]


def test_abandoned_builds_of_a_crashed_builder_are_swept(tmp_path):
    target = tmp_path / "thing"
    old = tmp_path / ".thing.build-deadbeef"
    old.mkdir()
    (old / "half.bin").write_bytes(b"x")
    past = time.time() - 2 * 3600
    os.utime(old, (past, past))
    young = tmp_path / ".thing.build-alive"  # a live builder on another node: left alone
    young.mkdir()
    publish_once(target, "k1", lambda tmp: (tmp / "a").write_text("a"))
    assert not old.exists() and young.exists()


# --- the real preset, on a cold cache --------------------------------------------------------------

_PRESET = textwrap.dedent("""
    import sys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from workers.models import build_preset
    print("ready", flush=True)
    sys.stdin.readline()  # every racer is imported and waiting: the test lets them go at once
    d = build_preset("preset:tiny-llama")
    AutoModelForCausalLM.from_pretrained(d)
    AutoTokenizer.from_pretrained(d)
    print(d)
""")


@pytest.mark.slow
def test_racing_ranks_build_the_tiny_preset_once_on_a_cold_cache_then_from_a_poisoned_one(tmp_path):
    cache = tmp_path / "presets"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMFIT_PRESET_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def race(n: int) -> set[str]:
        procs = [subprocess.Popen([sys.executable, "-c", _PRESET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
        for p in procs:  # every interpreter has imported torch, transformers and memfit's builder
            assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = set()
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.add(out.strip().splitlines()[-1])
        return outs

    (target,) = race(4)
    target = Path(target)
    names = sorted(p.name for p in target.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", SEAL} <= set(names)
    assert _leftovers(cache, target.name) == []

    # Poison it the way the cold-start report found it: the final folder with only tokenizer files.
    for p in target.iterdir():
        if p.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            p.unlink()
    assert race(2) == {str(target)}
    assert sorted(p.name for p in target.iterdir()) == names


# What the cold-start report hit: in a Ray Train job the process group is up before the ranks build
# the preset, and the rank that wins the build may not be rank 0.
_RANK = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from workers.models import build_preset
    if rank == 1:  # rank 1 builds first; rank 0 asks once it is published
        d = build_preset("preset:tiny-qwen2")
    dist.barrier()
    if rank == 0:
        d = build_preset("preset:tiny-qwen2")
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(d)
    dist.destroy_process_group()
    print(d)
""")


@pytest.mark.slow
def test_a_preset_built_by_a_rank_other_than_0_holds_the_model_not_only_the_tokenizer(tmp_path):
    from service.scheduler.local_head import free_port

    cache = tmp_path / "presets"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMFIT_PRESET_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.strip().splitlines()[-1])
    (target,) = set(outs)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(target).iterdir()}
