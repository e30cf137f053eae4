"""workers/telemetry.py on real training steps of a tiny model: exact counters, a measured peak that
agrees with PyTorch's MemTracker, sharded accounting under FSDP2, and the host-memory budget."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from workers.telemetry import (  # noqa: E402
    HostMemoryExceeded,
    StepTelemetry,
    process_rss_bytes,
    release_free_heap,
)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}


def tiny_model(lora: bool = False):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY),
                                                          attn_implementation="sdpa")
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    return model


def one_step(model, opt, tel, step, ids):
    tel.begin_step(step)
    loss = model(input_ids=ids, labels=ids).loss
    tel.mark("forward")
    loss.backward()
    tel.mark("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    tel.mark("optimizer")
    return tel.end_step(step)


@pytest.mark.parametrize("lora", [False, True])
def test_counters_are_exact(lora):
    """In a process of its own: glibc's malloc statistics are the whole process's, and a thread an earlier test
    left in this one (a server, a scheduler) allocates between the referee's readings."""
    from workers.local import start_processes

    start_processes(_counters_are_exact, (lora,), 1)


def _counters_are_exact(rank: int, lora: bool):
    ids = torch.randint(0, 512, (2, 32))
    warm = tiny_model(lora)  # the CPU kernels' first-use state, as a process that has trained before holds it
    warm(input_ids=ids, labels=ids).loss.backward()
    del warm
    model = tiny_model(lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=False)
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=100)
    recs = []
    for step in (1, 2):
        recs = one_step(model, opt, tel, step, ids)
    (rec,) = recs  # step 2: sampled, not traced
    assert rec["phase"] == "step" and rec["rank"] == 0 and rec["source"] == "counters"
    assert rec["parameters_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert rec["gradients_bytes"] == sum(p.numel() * 4 for p in trainable)
    # two fp32 moments per trainable parameter plus AdamW's scalar step counter
    assert rec["optimizer_bytes"] == sum(p.numel() * 8 + 4 for p in trainable)
    assert rec["process_rss_bytes"] > 0
    assert rec["host_optimizer_bytes"] == 0 and set(rec["device"]) == {"referee"}
    # the referee (glibc's malloc statistics): what the first steps allocated and kept beyond the counted state
    # (the CPU kernels' and autograd's own, under 1 MiB here) stays as it is from step to step; a tensor kept
    # across steps outside the model and the optimizer (a leak) shows up as that much more, step after step
    referee = rec["device"]["referee"]
    assert referee["source"] == "mallinfo2" and abs(referee["unattributed_bytes"]) < 2**20, referee
    kept = []
    seen = []
    for step in (3, 4, 5, 6):
        seen.append(one_step(model, opt, tel, step, ids)[0]["device"]["referee"]["unattributed_bytes"])
        if step >= 4:
            kept.append(torch.ones(2**20, dtype=torch.uint8))
    assert abs(seen[1] - seen[0]) < 64 * 1024, seen  # steady: nothing kept
    assert all(abs(b - a - 2**20) < 64 * 1024 for a, b in zip(seen[1:], seen[2:])), seen  # 1 MiB more each step


def test_traced_step_peak_matches_memtracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=100)
    ids = torch.randint(0, 512, (4, 64))
    for step in (1, 2):
        one_step(model, opt, tel, step, ids)
    recs = one_step(model, opt, tel, 3, ids)  # step 3 is always traced
    step_rec = recs[0]
    assert step_rec["source"] == "profiler"
    assert {r["phase"] for r in recs[1:]} == {"forward", "backward", "optimizer"}
    assert max(r["peak_bytes"] for r in recs[1:]) == step_rec["peak_bytes"]

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracked = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    tracked_total = tracked["Total"]
    assert abs(step_rec["peak_bytes"] - tracked_total) <= 0.01 * tracked_total, (step_rec["peak_bytes"], tracked_total)
    act = [v for k, v in tracked.items() if "ACT" in str(k)][0]
    assert abs(step_rec["activations_bytes"] - act) <= 0.02 * act + 64 * 1024


def test_memory_trace_records_what_the_full_profiler_records_without_the_operators():
    """MemoryTrace enables the profiler for the marks and allocations only: on the same step (same seed,
    same allocations) its summary must equal torch.profiler.profile(profile_memory=True)'s, with
    fewer events (no operator events)."""
    from torch.profiler import ProfilerActivity, profile

    from workers.telemetry import _MARK_PREFIX, MemoryTrace, summarize_profile

    model = tiny_model(lora=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)
    ids = torch.randint(0, 512, (4, 64))

    def step():
        for phase in ("begin", None, "forward", "backward", "optimizer"):
            if phase is None:
                loss = model(input_ids=ids, labels=ids).loss
                continue
            with torch.profiler.record_function(_MARK_PREFIX + phase):
                pass
            if phase == "forward":
                loss.backward()
            elif phase == "backward":
                opt.step()
                opt.zero_grad(set_to_none=True)

    step()  # AdamW's state exists from here on: both traced steps allocate the same
    trace = MemoryTrace(torch.device("cpu"))
    trace.start()
    step()
    scoped = trace.stop()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    full = prof.profiler.kineto_results.events()
    cpu = torch.device("cpu")
    mine, theirs = summarize_profile(scoped, cpu, 0), summarize_profile(full, cpu, 0)
    assert mine["peak_bytes"] > 0 and set(mine["phase_peak_bytes"]) == {"forward", "backward", "optimizer"}
    assert mine == theirs
    n_memory = sum(e.name() == "[memory]" for e in scoped)
    assert n_memory == sum(e.name() == "[memory]" for e in full) > 0
    # no operator is recorded (user ranges are: the marks, and torch.optim's own "Optimizer.step#AdamW.step")
    assert any(e.name().startswith("aten::") for e in full)
    assert not any(e.name().startswith("aten::") for e in scoped) and len(scoped) < len(full) / 2


def test_cadence():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tel = StepTelemetry(rank=1, device="cpu", model=model, optimizer=opt, every_steps=4, trace_every_steps=10)
    ids = torch.randint(0, 512, (1, 16))
    out = {step: one_step(model, opt, tel, step, ids) for step in range(1, 11)}
    assert out[1] == [] and out[2] == [] and out[5] == []
    assert len(out[3]) == 4  # step 3: always traced (first steady-state step)
    assert len(out[4]) == 1 and out[4][0]["source"] == "counters"
    assert len(out[10]) == 4 and out[10][0]["rank"] == 1


def test_host_budget_raises_and_post_mortem_says_where():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=10,
                        host_budget_bytes=50 * 2**20)
    tel.suggestions = [{"change": "gradient_checkpointing"}]
    ids = torch.randint(0, 512, (2, 16))
    tel.begin_step(1)
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(HostMemoryExceeded) as info:
        tel.mark("forward")
    exc = info.value
    assert exc.budget_bytes == 50 * 2**20 and exc.rss_bytes > exc.budget_bytes
    pm = tel.post_mortem(exc, step=1, phase="forward")
    assert (pm["rank"], pm["step"], pm["phase"]) == (0, 1, "forward")
    assert pm["limit_bytes"] == 50 * 2**20 and pm["used_bytes"] == exc.rss_bytes
    assert pm["dominant_category"] in pm["categories_bytes"]
    assert pm["breakdown"]["parameters_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert pm["suggestions"] == [{"change": "gradient_checkpointing"}]
    del loss


def test_host_budget_counts_what_is_held_not_what_malloc_kept_after_a_free():
    """Freed memory that glibc keeps in its heap (the holes between live blocks) is not an out-of-memory:
    the mark hands it back to the OS and re-reads RSS first, as CUDA's allocator frees its cache and
    retries. Memory that is really held still raises, after a release of its own."""
    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc): there is nothing to hand back")
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    MiB = 2**20
    release_free_heap()
    base = process_rss_bytes()
    # 300 MiB of 96 KiB blocks (below malloc's mmap threshold, so they live in the heap, every page
    # written); freeing all but every 16th leaves ~280 MiB of holes that no tensor or object holds.
    blocks = [b"x" * (96 * 1024) for _ in range(3200)]
    kept = blocks[::16]
    del blocks
    held = process_rss_bytes()
    assert held - base > 200 * MiB, "glibc handed the holes back by itself: this test no longer tests anything"
    budget = base + 100 * MiB
    tel = StepTelemetry(rank=0, device="cpu", model=model, optimizer=opt, every_steps=1, trace_every_steps=10,
                        host_budget_bytes=budget)
    tel.begin_step(1)
    tel.mark("forward")  # over the budget by ~180 MiB of free heap: released, not raised
    assert process_rss_bytes() < budget
    grown = [b"y" * (96 * 1024) for _ in range(2000)]  # ~190 MiB really held: still out of memory
    with pytest.raises(HostMemoryExceeded) as info:
        tel.mark("backward")
    assert info.value.rss_bytes > budget and info.value.phase == "backward"
    assert info.value.before_release_bytes is not None  # it was measured again after the release
    assert "exceeded the host memory budget" in str(info.value)
    del kept, grown


def _fsdp_rank(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = tiny_model()
        full = sum(p.numel() * 4 for p in model.parameters())
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        tel = StepTelemetry(rank=rank, device="cpu", model=model, optimizer=opt, every_steps=1,
                            trace_every_steps=100, strategy="fsdp")
        ids = torch.randint(0, 512, (2, 16))
        recs = []
        for step in (1, 2):
            recs = one_step(model, opt, tel, step, ids)
        q.put((rank, full, recs[0]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo ranks
def test_fsdp2_two_ranks_count_their_shards():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (full, rec)) for r, full, rec in (q.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    for rank, (full, rec) in got.items():
        # Every tiny-llama dim-0 is even: FSDP2 shards exactly in half, no padding.
        assert rec["parameters_bytes"] == full // 2, (rank, rec)
        assert rec["gradients_bytes"] == full // 2
        assert rec["optimizer_bytes"] >= full  # 2 moments × half the params (+ step scalars)


def test_a_collective_output_freed_on_gloo_thread_is_not_counted_live_by_a_traced_step():
    """The profiler records a free only on a thread it profiles, and gloo's worker thread keeps a finished
    work (with its output) until after it has woken the waiter: an all-gather output dropped right after its
    wait is sometimes freed on that thread, unrecorded, and a trace would count it live to the end of the
    step (without the pause: 0 to 36 of 300 such traces on the developers' 2-core machine, by its load).
    MemoryTrace pauses after every wait while it records (workers/telemetry.py: _CollectiveWaits): the waits
    last the pause during a trace and are the library's own again after it, and no trace counts the output."""
    import time

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work

    from workers import telemetry
    from workers.telemetry import MemoryTrace, summarize_profile

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)  # gloo's own worker thread, no default group
    # the threads a wait settles on (past the pause, while one is runnable): found by the name each gives
    # itself as it starts (a moment after the group is made)
    deadline = time.monotonic() + 10
    while not telemetry.gloo_thread_states() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert telemetry.gloo_thread_states(), "no pt_gloo_runloop thread: a wait on a loaded machine would not settle"
    cpu = torch.device("cpu")
    out_bytes = 250_000 * 4
    original = (Work.wait, funcol.wait_tensor)

    def still_live_after_drop() -> tuple[bool, float]:
        src = torch.ones(250_000)
        trace = MemoryTrace(cpu)
        trace.start()
        assert (Work.wait, funcol.wait_tensor) != original
        out = torch.empty(250_000)
        work = group._allgather_base(out, src)
        t0 = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - t0
        del work, out
        live = summarize_profile(trace.stop(), cpu, 0)["end_delta_bytes"] >= out_bytes
        assert (Work.wait, funcol.wait_tensor) == original
        return live, waited

    runs = [still_live_after_drop() for _ in range(300)]
    assert min(waited for _, waited in runs) >= telemetry._CollectiveWaits.PAUSE_S
    assert sum(live for live, _ in runs) == 0
