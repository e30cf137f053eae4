"""How far the planner has been measured to under-predict, per strategy: the margin the ``fits`` decision
adds to a plan's peak (service/memory/planner.py: ``need_bytes`` = peak + runtime + peak × margin) on
top of the operator's ``memory_safety_margin``.

Each figure is the worst signed error (predicted − measured) / measured below zero over every config and
rank of the accuracy matrices (bench/memory_accuracy.py on the developers' 2-core CPU machine, gloo, the
worst rank of each config; docs/memory-accuracy.md for small-llama/small-qwen2 and
docs/memory-accuracy-gpt2-gemma.md for small-gpt2/small-gemma), as a positive fraction: the planner's
known error, not a guess. The held-out matrix (bench/holdout_matrix.py, bench/holdout_accuracy.py) adds
its worst under-prediction where it measured a strategy the first matrix has; a variant only it measured,
on a config or two (ZeRO-1, FSDP2 without resharding or with CPU offload), and one neither measured
(ZeRO-0, DeepSpeed with only one kind of offload) get the largest margin of the measured strategies, and
say so. Whoever re-measures a matrix updates its row here.

DeepSpeed once had two CPU-only rows more: with accumulation (−7.17%) and ZeRO-3 with a frozen base (−5.79%), a
step's peak one collective buffer higher at some steps. That buffer was the telemetry's, not the memory's: freed on
gloo's worker thread, where the profiler records no free (workers/telemetry.py: _CollectiveWaits). Re-measured
with traces that pause after each wait (2026-12-05): bench/holdout_accuracy.py --drawn 16 --seed 1 --filter zero
--skip acc1 (8 DeepSpeed configs with accumulation 2-3, 16 rank samples) worst −0.08%, the ZeRO-2 accumulation-3
config 159.3-159.5 MiB against 159.5 planned (160.0-171.8 measured before); --checks --filter zero3 --steps 8,
twice, and its LoRA check three times more: no step above the level planned within +0.89%…+1.22%, the
embedding-sized extra never seen. Both rows are gone: such jobs carry their ZeRO stage's margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.domain.spec import JobSpec, StrategyName


@dataclass(frozen=True)
class Measured:
    under_prediction: float  # fraction of the measured peak, ≥ 0
    where: str  # the command and the table it comes from


MARGINS: dict[str, Measured] = {
    # Re-predicted on 2026-12-06 by the planner of that day (GPT-2's kept embedding lookup under PEFT + checkpointing,
    # prompt tuning's loss over the data's positions only): the first matrix's DDP and ZeRO rows from
    # docs/memory-accuracy*.md's measured MiB (0.1 MiB resolution), the FSDP2, chunked, QLoRA and dp2tp2 rows and the
    # held-out matrix, its checks and the first draw from their saved measurements (docs/measurements/2026-12-06/).
    # Each margin is the worst under-prediction of its strategy over all of them (none is under by more than 0.8%).
    # The chunked-loss matrix's DDP rows (bench/memory_accuracy.py --chunked, docs/measurements/2026-12-06/
    # chunk_all.json) were left out of this row until the drift alarm's check (bench/alarm_silence.py) found their
    # worst, −0.13% (small-qwen2 s512 bf16 chunk512; small-llama's −0.12%: 303 KiB each), under the 0.11% it said.
    "ddp": Measured(0.0013, "bench/memory_accuracy.py ddp1, both grids (worst −0.08%, re-predicted 2026-12-06), "
                            "--chunked (worst −0.13%, small-qwen2 s512 bf16 chunk512) and bench/holdout_accuracy.py at 1-3 ranks "
                            "(worst −0.11%, small-gpt2 LoRA r16 ×2 mb8)"),
    # FSDP2 ×2 over gloo, resharding after forward. With traces that pause after each collective's wait
    # (workers/telemetry.py: _CollectiveWaits, FSDP2 included since 2026-12-06) every config peaks at one level at
    # every step and rank, and the planner plans what FSDP2 holds (planner.py: fsdp_root_reduce), no race level:
    # --filter fsdp2 on both grids (64 configs, 128 rank samples) worst −0.1% with the embedding-leaf term (−0.97%
    # before it: small-gpt2 LoRA fp32 + checkpointing s512), llama/qwen2 within 0.04%; --qlora --filter fsdp2 and
    # --mesh (dp2tp2) within 0.04%; the held-out FSDP2 configs within +0.37%. The worst is the chunked loss:
    # --chunked --filter fsdp2, −0.80% (small-qwen2 bf16 s512, 1.4 MiB, both ranks; not explained).
    "fsdp2": Measured(0.008, "bench/memory_accuracy.py --filter fsdp2, both grids (128 rank samples, every step at one "
                             "level): worst −0.1%; with a chunked loss (--chunked --filter fsdp2) −0.80%"),
    # FSDP2 with CPU offload (resharding after forward): the held-out matrix's two configs and the six checks, four
    # with accumulation 2-4 (bench/holdout_accuracy.py --filter fsdp2 and --checks --filter fsdp2 --fsdp-steps 8,
    # 2026-12-06): every rank within +0.01%, none under. (Accumulation once read 0 to 4 extra reduce-scatter
    # buffers from step to step: gloo's unrecorded frees, gone with the pause.)
    "fsdp2_offload": Measured(0.0, "bench/holdout_accuracy.py --filter fsdp2 and --checks --filter fsdp2 "
                                   "--fsdp-steps 8: 2 held-out configs and 6 checks, none under (worst +0.01%)"),
    # ZeRO: both grids re-predicted (see above) and the held-out matrix, checks and first draw. Before 2026-12-06 the
    # worst were GPT-2 LoRA fp32 + checkpointing at s512 (−0.93% ZeRO-2, −0.80% ZeRO-3: GPT-2's kept embedding lookup).
    "zero2": Measured(0.0008, "bench/memory_accuracy.py zero2, both grids (worst −0.04%) and bench/holdout_accuracy.py "
                              "(worst −0.08%)"),
    # ZeRO-3's worst is GPT-2 LoRA with checkpointing: the final norm's output is live at the loss there (seen with
    # bench/peak_tensors.py, −0.80% at s512 fp32), not modelled; since 2026-12-06 the frozen weights no backward reaches
    # (GPT-2's position embeddings, block 0's input linears) are released (planner.py: ZeRO-3 gathered).
    "zero3": Measured(0.008, "bench/memory_accuracy.py zero3, both grids: worst −0.80% (small-gpt2 LoRA fp32 + "
                             "checkpointing s512, measured 2026-12-06); held-out worst −0.43% (gpt2 s1024 LoRA bf16 "
                             "+ checkpointing)"),
    "zero3_offload": Measured(0.0072, "bench/memory_accuracy.py zero3_offload (optimizer and parameters), both grids "
                                      "re-predicted: worst −0.72% (small-gpt2 LoRA bf16 + checkpointing s512)"),
    # Pipelines, re-measured 2026-12-06 with the stages' receive buffers counted by the telemetry (CPU traces
    # cannot see them) and planned with them, Schedule1F1B's held sends, the forward's MLP-projection instant and the
    # recomputation's (planner.py: pipeline_stages): bench/memory_accuracy.py --filter pp2 (llama/qwen2, 64 configs,
    # 128 rank samples) worst −0.2%, max +1.85%; --families small-gpt2 --filter pp2 (32 configs) worst −0.6%
    # (LoRA bf16, rank 0), max +1.1%; the held-out GPipe config +0.03%.
    "pp2": Measured(0.006, "bench/memory_accuracy.py --filter pp2 (pp2 rows), small-llama/small-qwen2 and small-gpt2 "
                           "(48 configs, 96 rank samples, 2026-12-06): worst −0.6% (small-gpt2 LoRA bf16, rank 0)"),
    "pp2i": Measured(0.006, "bench/memory_accuracy.py --filter pp2 (pp2i rows), small-llama/small-qwen2 and small-gpt2 "
                            "(48 configs, 96 rank samples, 2026-12-06): worst −0.6% (small-gpt2 LoRA bf16, rank 0)"),
    # tp2 (strategy tensor, size 2, one replica): bench/memory_accuracy.py --filter tp2 (32 configs, both
    # families), worst −1.10% (small-llama s512 fp32, rank 1 only: 4 MiB more than rank 0 in every phase).
    # small-gpt2 (its Conv1D blocks split by the worker's own styles): --families small-gpt2 --filter tp2,
    # 16 configs, 32 rank samples, worst −0.94%, median |error| 0.54% (inside the margin; not fitted on).
    # With the vocabulary split too (rank_shape's vocab/size, loss_parallel's loss terms): --filter tp2,s128
    # --families small-llama,small-qwen2,small-gpt2, 24 configs, 48 rank samples, worst −1.23%, median
    # |error| 0.58%; the s512 half (--filter tp2,s512, same families, 24 configs): worst −2.73% (small-llama
    # LoRA fp32 + checkpointing, rank 0). Those missing bytes were found (2026-12-05, the profiler's live
    # allocations at the peak) and are planned now (service/memory/planner.py: embedding_leaf, lora_autocast,
    # the frozen first block's weight casts). What was left, one or two fp32 tokens × hidden at some steps and ranks
    # (−2.38% at worst over 144 rank samples), was gloo's worker thread freeing an all-reduce output where the
    # profiler records no free (workers/telemetry.py: _CollectiveWaits). With traces that pause after each wait,
    # --filter tp2,s512 and --filter tp2,s128 (same families, 48 configs, 96 rank samples, 2026-12-05): every step
    # of every rank at one level, worst −0.24% (small-gpt2 s128 LoRA bf16), max +1.09%. The margin is that worst.
    "tp2": Measured(0.0024, "bench/memory_accuracy.py --filter tp2,s512 and --filter tp2,s128 (48 configs over "
                            "small-llama, small-qwen2, small-gpt2, vocabulary split; 96 rank samples, traces pausing "
                            "after each collective's wait): worst −0.24%"),
}


def matrix_key(spec: JobSpec) -> str | None:
    """The accuracy-matrix row that measured ``spec``'s strategy, or None for a variant none measured."""
    t = spec.training
    if t.strategy == StrategyName.ddp:
        return "ddp"
    if t.strategy == StrategyName.fsdp:
        if not t.fsdp.reshard_after_forward:
            return None
        return "fsdp2_offload" if t.fsdp.cpu_offload else "fsdp2"
    if t.strategy == StrategyName.pipeline:
        return "pp2i" if t.pipeline.schedule == "interleaved_1f1b" else "pp2"
    if t.strategy == StrategyName.tensor:
        n = t.resources.num_workers
        return "tp2" if (t.tensor_parallel.size or n) == 2 == n else None
    if t.strategy == StrategyName.deepspeed:
        ds = t.deepspeed
        offloads = (ds.offload_optimizer == "cpu", ds.offload_param == "cpu")
        if ds.zero_stage == 2 and offloads == (False, False):
            return "zero2"
        if ds.zero_stage == 3:
            return {(False, False): "zero3", (True, True): "zero3_offload"}.get(offloads)
    return None


def accuracy_margin(spec: JobSpec) -> tuple[float, str]:
    """(the margin as a fraction of the peak, where it was measured) for ``spec``."""
    key = matrix_key(spec)
    if key is not None:
        m = MARGINS[key]
        return m.under_prediction, m.where
    worst_key = max(MARGINS, key=lambda k: MARGINS[k].under_prediction)
    return (MARGINS[worst_key].under_prediction,
            f"this variant is in no accuracy matrix: the largest measured margin ({worst_key})")
