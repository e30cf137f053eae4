"""The planner's arithmetic on known cases: model-state formulas, ZeRO stages, suggestions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.domain.spec import JobSpec
from service.memory.gpus import CATALOGUE, get_gpu
from service.memory.planner import (
    plan,
    suggest,
    zero2_gradient_buffer_elements,
)
from service.memory.shape import shape_from_config

LLAMA2_7B = shape_from_config({
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False,
})
P7 = 6_738_415_616


def spec(**training) -> JobSpec:
    t = {"hyperparameters": {"micro_batch_size": 1, "max_seq_length": 512},
         "resources": {"gpus_per_worker": 1, "gpu_type": "a100-40gb"}}
    for k, v in training.items():
        if isinstance(v, dict) and isinstance(t.get(k), dict):
            t[k] = {**t[k], **v}
        else:
            t[k] = v
    return JobSpec.model_validate({"model": "meta-llama/Llama-2-7b-hf", "training_file": "file-x", "training": t})


def test_llama2_7b_full_fp32_adamw_needs_16_bytes_per_param_and_does_not_fit():
    p = plan(spec(), LLAMA2_7B, "a100-40gb")
    d = p.model_dump(mode="json")
    assert d["parameter_count"] == d["trainable_parameter_count"] == P7
    per_rank = d["per_rank"]["device"]
    assert per_rank["parameters"] == 4 * P7
    assert per_rank["gradients"] == 4 * P7
    assert per_rank["optimizer_states"] == 8 * P7
    assert per_rank["parameters"] + per_rank["gradients"] + per_rank["optimizer_states"] == 16 * P7
    assert not d["fits"]
    assert d["capacity_bytes"] == CATALOGUE["a100-40gb"].capacity_bytes
    assert per_rank["total"] > d["capacity_bytes"]
    for key in ("parameters", "gradients", "optimizer_states", "activations", "temporary", "overhead", "total"):
        assert key in d["per_rank"]["device"] and key in d["per_rank"]["host"]


def test_lora_r16_bf16_checkpointing_fits_a100_40gb():
    s = spec(peft={"method": "lora", "r": 16}, precision="bf16", gradient_checkpointing=True)
    p = plan(s, LLAMA2_7B, "a100-40gb")
    assert p.fits, p.model_dump(mode="json")
    # r=16 on q,k,v,o of 32 layers of 4096×4096: 16·(4096+4096)·4·32
    assert p.trainable_parameter_count == 16 * 8192 * 4 * 32
    assert p.model_states.device.optimizer_states == 8 * p.trainable_parameter_count
    # the workers keep the frozen base in bf16 and the adapter in fp32 (service/domain/training.py: regime, cast_frozen_base)
    assert p.model_states.device.parameters == 2 * P7 + 4 * p.trainable_parameter_count
    fp32 = plan(spec(peft={"method": "lora", "r": 16}, gradient_checkpointing=True), LLAMA2_7B, "a100-40gb")
    assert fp32.model_states.device.parameters == 4 * (P7 + p.trainable_parameter_count)
    assert p.parameter_count == P7 + p.trainable_parameter_count
    assert p.device.total <= p.usable_bytes


def test_checkpointing_and_bf16_cut_activations():
    base = plan(spec(), LLAMA2_7B, "h100-80gb")
    ckpt = plan(spec(gradient_checkpointing=True), LLAMA2_7B, "h100-80gb")
    bf16 = plan(spec(precision="bf16"), LLAMA2_7B, "h100-80gb")
    assert ckpt.activations_saved_bytes < base.activations_saved_bytes / 4
    # Under autocast the bf16 copy of every fp32 weight is cached and kept for backward (2 B/param):
    # with one short sequence that outweighs the halved activations, with a real batch it does not.
    cast_bytes = 2 * (LLAMA2_7B.num_layers * sum(i * o for i, o in LLAMA2_7B.linear_shapes().values())
                      + LLAMA2_7B.vocab * LLAMA2_7B.hidden)
    assert bf16.activations_saved_bytes > cast_bytes
    big = {"hyperparameters": {"micro_batch_size": 8, "max_seq_length": 2048}}
    assert plan(spec(precision="bf16", **big), LLAMA2_7B, "h100-80gb").activations_saved_bytes < \
        plan(spec(**big), LLAMA2_7B, "h100-80gb").activations_saved_bytes
    longer = plan(spec(hyperparameters={"micro_batch_size": 1, "max_seq_length": 2048}), LLAMA2_7B, "h100-80gb")
    assert longer.activations_saved_bytes > 3.9 * base.activations_saved_bytes


def test_zero_stage_arithmetic_per_rank():
    n = 8
    common = {"precision": "bf16", "strategy": "deepspeed",
              "resources": {"num_workers": n, "gpus_per_worker": 1, "gpu_type": "a100-80gb"}}
    z1 = plan(spec(**common, deepspeed={"zero_stage": 1}), LLAMA2_7B, "a100-80gb").device
    z2 = plan(spec(**common, deepspeed={"zero_stage": 2}), LLAMA2_7B, "a100-80gb").device
    z3 = plan(spec(**common, deepspeed={"zero_stage": 3}), LLAMA2_7B, "a100-80gb").device
    # ZeRO paper, mixed-precision Adam with K = 12 (fp32 master + two moments):
    assert z1.parameters == 2 * P7 and z1.gradients == 2 * P7 and z1.optimizer_states == 12 * P7 // n
    assert z2.parameters == 2 * P7 and z2.optimizer_states == 12 * P7 // n
    # ZeRO-2's gradient partition, plus the rest of the tensor its fullest rank's boundary cuts through
    assert z2.gradients == 2 * zero2_gradient_buffer_elements(LLAMA2_7B.parameter_numels(), n)
    assert 2 * P7 // n < z2.gradients <= 2 * (P7 // n + 32000 * 4096)
    assert z3.parameters == 2 * P7 // n and z3.gradients == 2 * P7 // n and z3.optimizer_states == 12 * P7 // n
    off = plan(spec(**common, deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
               LLAMA2_7B, "a100-80gb")
    assert off.device.optimizer_states == 0 and off.device.parameters == 0
    assert off.host.optimizer_states == 12 * P7 // n and off.host.parameters == 2 * P7 // n


def test_zero2_gradient_buffer_holds_whole_tensors_across_partition_boundaries():
    # 20 elements, 2 ranks: partitions [0, 10) and [10, 20)
    assert zero2_gradient_buffer_elements([10, 6, 4], 2) == 10  # the boundary falls between tensors
    assert zero2_gradient_buffer_elements([6, 8, 6], 2) == 14  # both ranks allocate the whole middle tensor
    assert zero2_gradient_buffer_elements([3, 3, 3, 3, 3, 3, 1], 2) == 12  # 19 padded to 20; [0, 10) touches 4
    assert zero2_gradient_buffer_elements([7], 1) == 7


def test_fsdp_shards_model_states():
    n = 4
    p = plan(spec(strategy="fsdp", resources={"num_workers": n, "gpus_per_worker": 1, "gpu_type": "h100-80gb"}),
             LLAMA2_7B, "h100-80gb")
    assert p.device.parameters == 4 * P7 // n
    assert p.device.optimizer_states == 8 * P7 // n


def test_suggestions_are_ordered_and_each_fits():
    s = spec()
    options = suggest(s, LLAMA2_7B, "a100-40gb")
    assert options, "some change must make a 7B fine-tune fit on an A100-40GB"
    costs = [o.cost for o in options]
    assert costs == sorted(costs)
    for o in options:
        assert o.plan.fits
        assert o.plan.peak_bytes <= o.plan.usable_bytes
        again = plan(o.spec, LLAMA2_7B, "a100-40gb")
        assert again.fits and again.peak_bytes == o.plan.peak_bytes


def test_micro_batch_suggestion_keeps_the_global_batch():
    shape = shape_from_config({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                               "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
                               "vocab_size": 32000})
    s = spec(hyperparameters={"micro_batch_size": 32, "max_seq_length": 2048}, precision="bf16",
             peft={"method": "lora", "r": 16}, resources={"gpus_per_worker": 1, "gpu_type": "l4"})
    assert not plan(s, shape, "l4").fits
    options = suggest(s, shape, "l4")
    mb = [o for o in options if o.change.startswith("micro_batch_")]
    assert mb, [o.change for o in options]
    for o in mb:
        assert o.spec.resolved().global_batch_size == s.resolved().global_batch_size


def _settings(tmp_path):
    from service.settings import Settings

    return Settings(database_url=f"sqlite:///{tmp_path}/memfit.db", storage_dir=tmp_path / "storage",
                    model_dirs=[tmp_path / "models"])


def test_cpu_worker_capacity_is_the_host_budget(tmp_path):
    from service.memory.preflight import plan_for_spec

    settings = _settings(tmp_path)
    assert settings.memory_safety_margin == pytest.approx(0.10)

    def body(budget=None, **training):
        return JobSpec.model_validate({"model": "preset:small-llama", "training_file": "file-x", "training": {
            "resources": {"host_memory_budget_bytes": budget}, **training}})

    full = plan_for_spec(body(), settings)
    ckpt = plan_for_spec(body(gradient_checkpointing=True), settings)
    assert full.gpu is None and full.fits and full.capacity_bytes is None  # informative: nothing to fit into
    # A budget between the two: the full run does not fit, checkpointing does.
    budget = int((full.runtime_bytes + (full.peak_bytes + ckpt.peak_bytes) // 2) / 0.9)
    out = plan_for_spec(body(budget), settings)
    assert out.capacity_bytes == budget
    assert out.fits is False and out.suggestions
    assert all(s.fits for s in out.suggestions)
    assert "gradient_checkpointing" in [s.change for s in out.suggestions]
    assert out.model.family == "llama"


def test_fits_carries_the_strategys_measured_error_as_its_margin():
    """need = peak (+ runtime) + peak × the strategy's measured under-prediction (service/memory/accuracy.py);
    a peak that fits only without that margin does not fit."""
    from service.memory.accuracy import MARGINS, accuracy_margin

    fsdp = spec(strategy="fsdp", resources={"num_workers": 2}, peft={"method": "lora", "r": 16}, precision="bf16")
    p = plan(fsdp, LLAMA2_7B)
    assert p.accuracy_margin == MARGINS["fsdp2"].under_prediction > 0 and "fsdp2" in p.accuracy_source
    assert p.need_bytes == p.peak_bytes + p.accuracy_margin_bytes and p.accuracy_margin_bytes > 0
    assert p.fits and p.margin_bytes == p.usable_bytes - p.need_bytes
    # a safety margin that leaves room for the peak but not for the planner's error: refused
    between = 1 - (p.peak_bytes + p.accuracy_margin_bytes // 2) / p.capacity_bytes
    tight = plan(fsdp, LLAMA2_7B, safety_margin=between)
    assert tight.peak_bytes <= tight.usable_bytes < tight.need_bytes and not tight.fits
    # a variant no matrix measured gets the largest measured margin, and says so
    zero1 = accuracy_margin(spec(strategy="deepspeed", deepspeed={"zero_stage": 1}, resources={"num_workers": 2}))
    assert zero1[0] == max(m.under_prediction for m in MARGINS.values()) and "no accuracy matrix" in zero1[1]
    # DeepSpeed carries its ZeRO stage's margin, with accumulation and with a frozen base too: the CPU-only rows
    # those once had measured gloo's unrecorded frees, not memory (service/memory/accuracy.py)
    assert "zero_accumulation_gloo" not in MARGINS and "zero3_frozen_gloo" not in MARGINS
    zero2_acc = spec(strategy="deepspeed", deepspeed={"zero_stage": 2}, resources={"num_workers": 2},
                     hyperparameters={"gradient_accumulation_steps": 3})
    assert accuracy_margin(zero2_acc) == (MARGINS["zero2"].under_prediction, MARGINS["zero2"].where)
    zero3 = {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}, "resources": {"num_workers": 2}}
    for method in ("lora", "prompt_tuning", "ia3"):
        assert accuracy_margin(spec(**zero3, peft={"method": method}))[0] == MARGINS["zero3"].under_prediction
    cpu = JobSpec.model_validate({"model": "preset:small-llama", "training_file": "file-x", "training": {
        "strategy": "deepspeed", "deepspeed": {"zero_stage": 3}, "resources": {"num_workers": 2},
        "peft": {"method": "lora"}, "hyperparameters": {"gradient_accumulation_steps": 2}}})
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model

    p_cpu = plan(cpu, shape_for_model(resolve_model(cpu.model, ())))
    assert (p_cpu.accuracy_margin, p_cpu.accuracy_source) == (MARGINS["zero3"].under_prediction,
                                                               MARGINS["zero3"].where)


def test_unknown_gpu_is_named():
    with pytest.raises(KeyError, match="a100-40gb"):
        get_gpu("a101")


def test_render_prints_a_table(tmp_path):
    from rich.console import Console

    from service.memory.preflight import plan_for_spec
    from service.views.plan_table import render

    console = Console(record=True, width=140)
    render(plan_for_spec(spec(), _settings(tmp_path)), console)
    text = console.export_text()
    assert "does not fit" in text and "optimizer_states" in text and "changes that would fit" in text


def test_service_planner_does_not_import_torch():
    code = "import sys, service.memory.planner, service.memory.gpus, service.memory.shape; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_suggestions_propose_a_pipeline_whose_fullest_stage_fits():
    from service.domain.spec import check_rules

    s = spec(resources={"num_workers": 4, "gpus_per_worker": 1, "gpu_type": "a100-40gb"})
    assert not plan(s, LLAMA2_7B, "a100-40gb").fits  # ddp: every rank holds the whole 7B with its AdamW states
    options = {o.change: o for o in suggest(s, LLAMA2_7B, "a100-40gb", limit=20)}
    pipe = options["pipeline_4"]
    t = pipe.spec.training
    assert (t.strategy.value, t.pipeline.stages, t.pipeline.schedule) == ("pipeline", 4, "gpipe")  # 1 row: one chunk
    assert pipe.plan.fits and not check_rules(pipe.spec)
    stages = [plan(pipe.spec, LLAMA2_7B, "a100-40gb", stage=i).peak_bytes for i in range(4)]
    assert pipe.plan.peak_bytes == max(stages)  # the most loaded stage decides
    assert "pipeline_2" not in options  # two stages of a 7B in fp32 do not fit 40 GB
    # not offered where the pipeline strategy cannot run the job
    for other in (spec(resources={"num_workers": 4, "gpus_per_worker": 1, "gpu_type": "a100-40gb"},
                       peft={"method": "prefix_tuning"}),
                  spec(resources={"num_workers": 4, "gpus_per_worker": 1, "gpu_type": "a100-40gb"}, loss_chunk_tokens=1024),
                  spec(resources={"num_workers": 1, "gpus_per_worker": 1, "gpu_type": "a100-40gb"})):
        assert not [o for o in suggest(other, LLAMA2_7B, "a100-40gb", limit=20) if o.change.startswith("pipeline")]
    gemma = shape_from_config({"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "head_dim": 256,
                               "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                               "vocab_size": 256000})  # a family the pipeline workers do not split
    assert not [o for o in suggest(s, gemma, "a100-40gb", limit=20) if o.change.startswith("pipeline")]


def test_suggestions_propose_tensor_parallel_where_the_heads_split():
    """4 workers of a 7B that does not fit under DDP: tensor parallelism over the 4 (and over 2, with two
    FSDP2 replicas) is offered with one rank's plan, and the spec it proposes passes the rules; not for a
    model whose heads the ranks cannot share, nor where the tensor strategy cannot run the job."""
    from service.domain.spec import check_rules

    s = spec(resources={"num_workers": 4, "gpus_per_worker": 1, "gpu_type": "a100-40gb"})
    options = {o.change: o for o in suggest(s, LLAMA2_7B, "a100-40gb", limit=40)}
    tp = options["tensor_4"]
    assert (tp.spec.training.strategy.value, tp.spec.training.tensor_parallel.size) == ("tensor", 4)
    assert tp.plan.fits and not check_rules(tp.spec)
    assert tp.plan.peak_bytes == plan(tp.spec, LLAMA2_7B, "a100-40gb").peak_bytes < plan(s, LLAMA2_7B, "a100-40gb").peak_bytes
    assert all("+" not in o.change or o.change.count("tensor") + o.change.count("pipeline") <= 1 for o in options.values())
    three_heads = shape_from_config({"model_type": "llama", "hidden_size": 4032, "intermediate_size": 11008,
                                     "num_hidden_layers": 32, "num_attention_heads": 42, "num_key_value_heads": 42,
                                     "vocab_size": 32000})  # 42 heads: not over 4 ranks, over 2 they split
    changes = [o.change for o in suggest(s, three_heads, "a100-40gb", limit=40)]
    assert "tensor_4" not in changes
    fp16 = spec(resources={"num_workers": 4, "gpus_per_worker": 1, "gpu_type": "a100-40gb"}, precision="fp16")
    assert not [o for o in suggest(fp16, LLAMA2_7B, "a100-40gb", limit=40) if o.change.startswith("tensor")]


def test_qlora_7b_holds_an_nf4_base_and_no_16bit_copy_of_it():
    """QLoRA's base is bitsandbytes' NF4 (service/memory/nf4.py): 0.5 B/param of packed codes plus the
    double-quantised block constants; embeddings, norms and lm_head fp32 (prepare_model_for_kbit_training).
    Its 4-bit linears dequantise per call, so autocast keeps no bf16 copy of the base (the old plan did: 2 B/param)."""
    from service.memory.nf4 import nf4_weight_bytes

    lin = [i * o for i, o in LLAMA2_7B.linear_shapes().values()] * LLAMA2_7B.num_layers
    q = plan(spec(peft={"method": "qlora", "r": 16}, precision="bf16"), LLAMA2_7B, "a100-40gb")
    Pt = q.trainable_parameter_count
    assert Pt == 16 * 8192 * 4 * 32
    assert q.model_states.device.parameters == sum(map(nf4_weight_bytes, lin)) + 4 * (P7 - sum(lin)) + 4 * Pt
    # packed codes 0.5 B + a uint8 absmax per 64 + an fp32 absmax per 64·256 (+ per-tensor constants)
    assert sum(map(nf4_weight_bytes, lin)) == pytest.approx(sum(lin) * (0.5 + 1 / 64 + 4 / (64 * 256)), rel=1e-3)
    lora32 = plan(spec(peft={"method": "lora", "r": 16}), LLAMA2_7B, "a100-40gb")
    q32 = plan(spec(peft={"method": "qlora", "r": 16}), LLAMA2_7B, "a100-40gb")
    # fp32: the 4-bit linears save nothing a frozen fp32 linear would not, so the activations are LoRA's
    assert q32.activations_saved_bytes == lora32.activations_saved_bytes
    # bf16 autocast: less than all-fp32 LoRA (the old plan's 2 B/param copy alone was 12 GiB here)
    assert q.activations_saved_bytes < lora32.activations_saved_bytes < 2 * sum(lin)
    assert q.fits and q.peak_bytes < 0.6 * plan(spec(peft={"method": "lora", "r": 16}, precision="bf16"),
                                                  LLAMA2_7B, "a100-40gb").peak_bytes



def _small_llama_fsdp2(gpu: str | None = None, model: str = "preset:small-llama", **training):
    from service.domain.model_ref import resolve_model
    from service.memory.shape import shape_for_model

    t = {"strategy": "fsdp", "hyperparameters": {"micro_batch_size": 2, "max_seq_length": 256},
         "resources": {"num_workers": 2}}
    if gpu:
        t["resources"].update(gpus_per_worker=1, gpu_type=gpu)
    for k, v in training.items():
        t[k] = {**t[k], **v} if isinstance(v, dict) and isinstance(t.get(k), dict) else v
    s = JobSpec.model_validate({"model": model, "training_file": "file-x", "training": t})
    shape = shape_for_model(resolve_model(s.model, ()))
    return plan(s, shape, gpu), shape


def test_fsdp2_plans_the_roots_reduce_scatter_with_the_gradient_its_loop_keeps_and_gloos_copy_on_cpu():
    """FSDP2, full fine-tune on 2 ranks: at the root's reduce-scatter (the last of backward) every gradient shard
    exists, beside the root's reduce-scatter input, the root's last gradient (foreach_reduce's loop variable keeps
    it: lm_head's vocab × hidden when untied, the final norm's weight when tied) and, on gloo, the input's copy
    ProcessGroupGloo reduces. No such instant for LoRA (the root does not train) or one rank (no reduce-scatter);
    accumulation adds nothing to it (memfit reduces every micro-batch)."""
    def temporaries(p):  # the instant's bytes beyond the model states (sharded, all on the device here)
        st = p.model_states.device
        return p.phases["root_reduce"] - st.parameters - st.gradients - st.optimizer_states

    cpu, shape = _small_llama_fsdp2()
    gpu, _ = _small_llama_fsdp2("a100-40gb")
    root = shape.parameter_count() - shape.num_layers * shape.layer_params()
    assert not shape.tied_embeddings
    assert temporaries(cpu) == 2 * root * 4 + shape.vocab * shape.hidden * 4
    assert temporaries(gpu) == root * 4 + shape.vocab * shape.hidden * 4
    bf16, _ = _small_llama_fsdp2(precision="bf16")  # fp32 shards gathered in bf16, reduced in fp32
    assert temporaries(bf16) == 2 * root * 4 + shape.vocab * shape.hidden * 2
    acc, _ = _small_llama_fsdp2(hyperparameters={"gradient_accumulation_steps": 3})
    assert temporaries(acc) == temporaries(cpu)
    tied, tied_shape = _small_llama_fsdp2(model="preset:small-qwen2")
    tied_root = tied_shape.parameter_count() - tied_shape.num_layers * tied_shape.layer_params()
    assert tied_shape.tied_embeddings and temporaries(tied) == 2 * tied_root * 4 + tied_shape.hidden * 4
    lora, _ = _small_llama_fsdp2(peft={"method": "lora", "r": 8})
    one, _ = _small_llama_fsdp2(resources={"num_workers": 1})
    assert "root_reduce" not in lora.phases and "root_reduce" not in one.phases
