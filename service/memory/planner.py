"""The memory planner: per-rank bytes by category, before the job runs. Pure arithmetic, no torch.

What it predicts is what workers/telemetry.py measures: the peak of live tensor bytes on one rank
during a steady-state optimizer step, split into parameters, gradients, optimizer states,
activations (saved for backward at the end of forward), temporaries and framework overhead — on
the GPU, plus what lives in host memory (offloaded state). On a GPU the overhead adds what the
allocator never sees (CUDA context, NCCL buffers) and the allocator's rounding/caching.

How the activations are counted. Autograd keeps a tensor exactly when some op's backward needs
it, so the planner walks each family's real block op by op and applies autograd's save rules:
a linear keeps its input only if its weight is trainable (LoRA: the frozen base does not, the
adapter's A does), a norm keeps its normalised input only if its weight is trainable, RMSNorm
upcasts to fp32 (Llama, Qwen2, Mistral, Gemma), SwiGLU keeps gate, SiLU and up, SDPA keeps q, k, v,
its output and a log-sum-exp (eager attention also the s² probabilities), and the loss
(workers/steps.py) keeps the fp32 log-softmax of the logits. Four precision regimes differ (which one
a job runs in, and the dtype of each model state, is service/domain/training.py's ``regime``):
fp32; bf16 autocast (DDP: fp32 weights and residual stream, a bf16 copy of each linear input and
weight); pure bf16 compute (FSDP2's MixedPrecisionPolicy, DeepSpeed bf16); and LoRA with bf16
under DDP (a bf16 frozen base, so a bf16 residual stream, with the fp32 adapter cast per matmul). The peak is the largest
of the candidate instants: the loss in forward, the start of backward (the log-softmax plus two
vocabulary-sized gradients), a checkpointed layer's recomputation, the end of backward and the
optimizer step, each with the model states live at that instant.

Where ranks differ (ZeRO-2's gradient buffer holds whole tensors across partition boundaries), the
figures are the fullest rank's: the one that runs out of memory first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from service.domain.plan import (
    Breakdown,
    ModelStates,
    ModelStatesPerRank,
    PerRank,
    Plan,
)
from service.domain.spec import (
    JobSpec,
    PeftMethod,
    Precision,
    StrategyName,
    check_rules,
)
from service.domain.training import (
    deepspeed_buckets,
    dtype_bytes,
    feedforward_targets,
    in_flight_microbatches,
    interleaved_in_flight,
    local_stages,
    lora_targets,
    loss_chunk_problem,
    pipeline_problem,
    tensor_problem,
    qat_problem,
    regime,
    stage_layers,
)
from service.memory.accuracy import accuracy_margin
from service.memory import host as host_memory
from service.memory.gpus import GPU, MiB, get_gpu
from service.memory.nf4 import (
    constants_bytes,
    largest_quantised,
    packed_bytes,
    qlora_base_bytes,
    quantised_numels,
)
from service.memory.shape import ModelShape
from service.memory.tensor_parallel import check_tensor, rank_shape

DEFAULT_HOST_BYTES = 16 * 2**30  # a CPU worker's memory when no host budget is given
CPU_RUNTIME_BYTES = 600 * MiB  # RSS of a torch + transformers worker process before any tensor (measured)


# --- activations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationSizes:
    """How a regime (service/domain/training.py) stores tensors in forward: element sizes of linear
    outputs and of the residual stream, and whether each linear casts its own copies."""

    name: str  # fp32 | autocast | pure16 | lora16, the Regime's name
    act: int  # bytes per element of linear/attention outputs
    residual: int  # bytes per element of the residual stream between blocks
    casts: bool  # autocast: each linear makes its own bf16 copy of its input (and weight)


ACTIVATION_SIZES = {"fp32": ActivationSizes("fp32", 4, 4, False), "autocast": ActivationSizes("autocast", 2, 4, True),
                    "pure16": ActivationSizes("pure16", 2, 2, False),
                    # a bf16 frozen base (bf16 residual stream, no weight casts) with an fp32 adapter that
                    # PEFT feeds an fp32 copy of its input and autocast casts per matmul
                    "lora16": ActivationSizes("lora16", 2, 2, True)}


@dataclass
class Activations:
    layer_bytes: list[int]  # saved per block with no checkpointing
    final_bytes: int  # final norm + embedding indices + rotary tables
    loss_saved_bytes: int  # fp32 log-softmax kept for backward
    logits_bytes: int  # lm_head output, freed once the loss is computed
    loss_copy_bytes: int  # the fp32 copy/contiguous reshape of the shifted logits, freed in forward
    loss_grad_bytes: int  # two vocabulary-sized fp32 gradients at the start of backward
    ckpt_layer_bytes: int  # what a checkpointed block keeps: its input
    layer_backward_temp_bytes: int  # gradients in flight inside one block's backward
    recompute_bytes: int = 0  # the most a checkpointed block's recomputation saves beyond its kept input
    forward_block_bytes: int = 0  # a block's forward at its fullest: the MLP's output projection (beyond its saves)

    def saved(self, checkpointing: bool) -> int:
        layers = len(self.layer_bytes) * self.ckpt_layer_bytes if checkpointing else sum(self.layer_bytes)
        return layers + self.final_bytes + self.loss_saved_bytes


def _lora_targets(spec: JobSpec, shape: ModelShape) -> set[str] | None:
    """None for a full fine-tune; otherwise the adapted module names."""
    peft = spec.training.peft
    if peft.method == PeftMethod.none:
        return None
    if peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        return set()  # they train virtual tokens; every linear of the blocks stays plain and frozen
    targets = set(lora_targets(shape.family, peft.target_modules))
    if peft.method == PeftMethod.ia3:  # IA3's config adds its feed-forward modules (workers/peft_setup.py)
        targets |= set(feedforward_targets(shape.family, peft.target_modules))
    return targets


def method_terms(spec: JobSpec, shape: ModelShape) -> dict:
    """The spec's training method as :func:`activations` takes it: QAT's (group size, fake-quantised
    activations), IA3's feed-forward targets (workers/peft_setup.py; None when the method is not IA3),
    prefix tuning's virtual tokens, and whether the adapter is LoHa/LoKr. One place for every caller
    (a whole model, a pipeline stage)."""
    t = spec.training
    peft = t.peft
    return {
        "qat": (t.qat.group_size, t.qat.scheme == "int8-dynamic-act-int4-weight") if t.qat.enabled else None,
        "ia3_feedforward": (frozenset(feedforward_targets(shape.family, peft.target_modules))
                            if peft.method == PeftMethod.ia3 else None),
        "prefix_tokens": peft.num_virtual_tokens if peft.method == PeftMethod.prefix_tuning else 0,
        "lycoris": peft.method in (PeftMethod.loha, PeftMethod.lokr),
        "lokr": peft.method == PeftMethod.lokr,
    }


def activations(shape: ModelShape, b: int, s: int, regime: ActivationSizes, targets: set[str] | None, r: int,
                attention: str = "sdpa", zero3_linear: bool = False, input_grad: bool = False,
                padded: bool = False, loss_chunk_tokens: int | None = None,
                qat: tuple[int, bool] | None = None, ia3_feedforward: frozenset[str] | None = None,
                prefix_tokens: int = 0, nf4_base: bool = False, on_gpu: bool = True,
                lycoris: bool = False, lokr: bool = False, loss_parallel: bool = False,
                embedding_leaf: bool = False, virtual_tokens: int = 0) -> Activations:
    """Bytes autograd keeps per block, by the family's ops (see the module docstring).

    ``zero3_linear``: DeepSpeed ZeRO-3 runs every linear through its own autograd function, which
    saves the input even when the weight is frozen (LoRA's base), wherever the input needs a gradient.
    ``input_grad``: the first block's input needs a gradient whatever trains (a pipeline stage after
    the first receives its input from the stage before and sends its gradient back).
    ``padded``: the micro-batch holds rows shorter than its width (workers/data.py: collate pads them), so
    the model hands SDPA a padding mask instead of ``is_causal`` — see ``padding_mask_bytes``.
    ``loss_chunk_tokens``: the LM head and the loss run chunk by chunk (workers/chunked_loss.py); the
    vocabulary-sized terms are one chunk's.
    ``qat``: training.qat's (group size, whether activations are fake-quantised too); every quantised
    linear is torchao's FakeQuantizedLinear (see :func:`qat_linear_bytes`).
    ``ia3_feedforward``: the method is IA3 (not None), with these feed-forward targets. peft's IA3 layer
    (peft/tuners/ia3/layer.py: Linear.forward) multiplies a frozen linear's output by its vector, or, for a
    feed-forward target, its input after casting it to the vector's dtype (fp32); the multiplication keeps
    that output (in the compute dtype) or that fp32 input for the vector's gradient, and the frozen linear
    itself keeps nothing (autograd saves a matmul's input only for its weight's gradient).
    ``prefix_tokens``: prefix tuning's virtual tokens, which peft hands every block as past keys and values
    (see the attention term).
    ``loss_parallel``: the logits are a DTensor sharded on the vocabulary (strategy tensor, ``vocab_parallel``)
    and cross-entropy runs under torch's loss_parallel (torch/distributed/tensor/parallel/loss.py), which
    builds the log-softmax and its backward from their parts instead of aten's fused kernels: see the loss terms.
    ``embedding_leaf``: a frozen embedding (PEFT) with gradient checkpointing, where the first block reads another
    tensor than the lookup's output. transformers' ``activation_checkpointing_enable`` (modeling_utils.py) calls
    ``enable_input_require_grads``, a forward hook on the input embedding that sets ``requires_grad_(True)`` on its
    output: a leaf, whose AccumulateGrad node in the autograd graph holds it until backward ends. Where the first
    block reads that output itself (Llama, Qwen, Gemma's scaled embedding module) the checkpoint keeps it anyway;
    GPT-2's blocks read the lookup plus the position embeddings (measured: the −0.92% of GPT-2 LoRA fp32 +
    checkpointing at s512 under DDP, one tokens × hidden, and ``index_select < aten::embedding`` live at a GPT-2
    pipeline stage's peak), and under strategy tensor with the vocabulary split the hook, registered before
    ``parallelize_module`` added RowwiseParallel's output hook (workers/strategies/common.py enables checkpointing when
    it builds the model), marks the vocabulary-partial lookup (a DTensor, before its all-reduce) while the blocks read
    the all-reduced copy. One more tokens × hidden in the residual dtype, live all step. (Prompt tuning, whose virtual
    tokens are joined to the lookup, is not modelled here: not measured.)
    ``lycoris``: LoHa or LoKr. peft builds each target's whole delta weight (loha/layer.py: HadaWeight keeps
    only its factors; lokr: torch.kron) and runs ``F.linear(x, delta_weight)`` (``_get_delta_activations``),
    which keeps the out × in delta weight (its compute-dtype copy under autocast) beside the input; there is
    no low-rank activation (LoRA's lora_A output). ``lokr``: the method is LoKr, whose delta weight is fp32 under
    autocast (torch.kron is not an autocast op and promotes its mixed inputs), unlike LoHa's (HadaWeight's
    matmuls run under autocast: 16-bit); see the o_proj term.
    ``nf4_base``: QLoRA's base linears are bitsandbytes' Linear4bit (service/memory/nf4.py): their matmul
    (bitsandbytes/autograd/_functions.py MatMul4Bit) saves only the packed weight, which is resident anyway, and
    dequantises it per call, so autocast caches no 16-bit copy of the base (only of the fp32 adapter, as for
    ``lora16``); Linear4bit returns its output in its input's dtype, so under autocast the MLP's gate, up and
    their product stay fp32; in backward, one dequantised weight in the compute dtype at a time. ``on_gpu``:
    peft's 4-bit LoRA layer (peft/tuners/lora/bnb.py) casts a 16-bit input to the fp32 adapter unless
    ``torch.is_autocast_enabled()``, which asks about CUDA's autocast only, so on CPU o_proj's adapter gets an
    fp32 copy of the attention output that autocast casts back to a bf16 copy it keeps (measured).
    """
    T = b * s
    h, qd, kvd, i, V = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.vocab
    full = targets is None
    a, res = regime.act, regime.residual

    def trainable(name: str) -> bool:
        return full or name in (targets or ())

    def adapted(name: str) -> bool:
        return not full and name in (targets or ())

    def linear_input(in_dtype_bytes: int, consumers: list[str], width: int) -> int:
        """Bytes saved for the input shared by ``consumers`` (linears reading the same tensor)."""
        if ia3_feedforward is not None:
            return 0  # IA3's linears are frozen; see ia3_saved
        savers = [c for c in consumers if trainable(c)]
        if not savers:
            return 0
        if regime.casts and in_dtype_bytes == 4:
            return len(savers) * T * width * 2  # each autocast linear casts its own bf16 copy
        return T * width * (in_dtype_bytes if not regime.casts else 2)

    def weight_casts(names: list[str], frozen_input: tuple[str, ...] = ()) -> int:
        """The 16-bit weight copies a block's matmuls keep under autocast. ``frozen_input``: linears whose
        input needs no gradient (the first block's q/k/v under PEFT)."""
        if not regime.casts:
            return 0
        shapes = shape.linear_shapes()
        if regime.name == "lora16" or nf4_base:  # no fp32 base weight to cast; autocast caches bf16 copies of A and B
            return sum(2 * r * (shapes[n][0] + shapes[n][1]) for n in names if adapted(n) or adapted(n.split(".")[-1]))
        # autocast caches the cast of a leaf that requires a gradient (a trained weight) for the whole forward
        # (aten/src/ATen/autocast_mode.cpp: cached_cast); a frozen weight's cast is made per call and kept only
        # where autograd saves it, for the gradient of the matmul's input
        return sum(2 * shapes[n][0] * shapes[n][1] for n in names if full or n not in frozen_input)

    def lora_extra(names: list[str]) -> int:
        if ia3_feedforward is not None:
            return 0
        if lycoris:  # each target's delta weight, kept by F.linear (see the docstring)
            shapes = shape.linear_shapes()
            return sum(din * dout * a for din, dout in (shapes[n] for n in names if n in shapes and adapted(n)))
        return sum(T * r * a for n in names if adapted(n))  # lora_A output, kept by lora_B

    def ia3_saved() -> int:
        """What one block's IA3 multiplications keep (see the docstring): a target's output, a
        feed-forward target's fp32 input."""
        if ia3_feedforward is None:
            return 0
        n = 0
        for name, (din, dout) in shape.linear_shapes().items():
            short = name.split(".")[-1]
            if name in ia3_feedforward or short in ia3_feedforward:
                n += T * din * 4
            elif adapted(name) or adapted(short):
                n += T * dout * a
        return n

    # A LoRA adapter is fp32 beside an fp32 base under autocast too (pipeline and tensor: the "autocast" regime):
    # peft's layer casts SDPA's 16-bit output to the adapter's fp32 (peft/tuners/tuners_utils.py: _cast_input_dtype,
    # which does not ask about autocast) and autocast casts that copy back to 16 bits for lora_A, which keeps it,
    # as under lora16 (measured under strategy tensor: `_to_copy < linear` of o_proj's input live at the peak)
    lora_autocast = regime.name == "autocast" and not (nf4_base or lycoris) and ia3_feedforward is None
    layer: list[int] = []
    recompute: list[int] = []
    small = T * 4  # per-token fp32 statistics (rsqrt, or mean + rstd for LayerNorm)
    for idx in range(shape.num_layers):
        # LoRA: the frozen embedding's output needs no gradient, except under ZeRO-3, whose module hooks
        # hand every block an input that requires one (measured: block 0 then saves as the others do)
        in_grad = full or idx > 0 or zero3_linear or input_grad
        n = 0
        if shape.family == "gpt2":
            ln_in = (T * h * res if in_grad else 0) + 2 * small
            n += ln_in + linear_input(res if not regime.casts else 4, ["c_attn"], h)
            n += T * 3 * qd * a + T * qd * a + shape.num_heads * T * 4  # q,k,v (one c_attn storage), out, lse
            n += padding_mask_bytes(shape, b, s, a) if padded and attention == "sdpa" else 0
            n += lora_extra(["c_attn", "c_proj"])
            if ((regime.name == "lora16" or (nf4_base and regime.casts and not on_gpu) or lora_autocast)
                    and adapted("c_proj") and ia3_feedforward is None):
                n += T * qd * 2  # attn.c_proj's adapter: as o_proj's below, a recast copy of the attention output
            n += T * h * res + 2 * small  # ln_2 input
            n += linear_input(res if not regime.casts else 4, ["c_fc"], h)
            # gelu_new's python ops keep x, tanh, 0.5x, 1+tanh; mlp.c_proj keeps the product when it trains
            # or carries an adapter ("c_proj" adapts both projections)
            n += 4 * T * i * a + (T * i * a if (trainable("c_proj") or trainable("mlp.c_proj"))
                                  and ia3_feedforward is None else 0)
            n += weight_casts(list(shape.linear_shapes()), () if in_grad else ("c_attn",)) + ia3_saved()
        else:
            norm_in = T * h * 4  # RMSNorm's fp32 view of its input, kept by pow
            # the normalised input kept for the norm's weight: in the residual dtype (Llama's RMSNorm casts it back
            # before the weight), fp32 for Gemma's, which multiplies by 1 + weight in fp32 and casts the product
            # (transformers/models/gemma/modeling_gemma.py: GemmaRMSNorm; gemma2/gemma3 the same)
            norm_fp32 = regime.residual == 4 or shape.family.startswith("gemma")
            normalized = T * h * (4 if norm_fp32 else 2)
            # input norm
            n += (norm_in if in_grad else 0) + small + (normalized if full else 0)
            attn_in = ["q_proj", "k_proj", "v_proj"]
            norm_out = 4 if regime.name != "pure16" else 2
            n += linear_input(norm_out, attn_in, h)
            if not full and regime.casts:
                pass  # counted by linear_input: each adapted projection's lora_A casts its own copy
            n += lora_extra(attn_in + ["o_proj"])
            if ((regime.name == "lora16" or (nf4_base and regime.casts and not on_gpu) or (lokr and regime.casts)
                 or lora_autocast) and adapted("o_proj") and ia3_feedforward is None):
                # o_proj's adapter: PEFT's fp32 copy of the attention output, cast again (measured). LoKr under
                # autocast: _get_delta_activations casts its input to the delta weight's dtype, fp32
                # (peft/tuners/lokr/layer.py, _cast_input_dtype), which SDPA's 16-bit output is not, and F.linear
                # keeps autocast's 16-bit recast of that copy beside the output SDPA keeps (LoHa's delta is 16-bit)
                n += T * qd * 2
            # attention: SDPA keeps q, k, v after rotary, its output (= o_proj's input) and the lse
            n += T * qd * a + 2 * T * kvd * a + T * qd * a + b * shape.num_heads * s * 4
            if prefix_tokens and attention == "sdpa":
                # prefix tuning: the cached prefix makes keys and values s + p long, and transformers then
                # passes SDPA a mask, so (as for padding, see padding_mask_bytes) every head's keys and values
                # are materialised by repeat_kv and kept, with the additive b × s × (s + p) mask of each block
                n += 2 * b * shape.num_heads * (s + prefix_tokens) * shape.head_dim * a - 2 * T * kvd * a
                n += b * s * (s + prefix_tokens) * a
            elif padded and attention == "sdpa":
                n += padding_mask_bytes(shape, b, s, a)
            if attention == "eager":
                probs = b * shape.num_heads * s * s
                n += probs * 4 + (probs * 2 if regime.act == 2 else 0)
                n += 2 * T * (qd - kvd) * a  # repeat_kv materialises k and v for every head
            if shape.qk_norm:
                # per-head RMSNorm of q and k (Qwen3): like the block's norms, each keeps its fp32 input (pow)
                # and per-head statistics, and, where its weight trains, the normalised input in q/k's dtype
                n += T * (qd + kvd) * 4 + T * (shape.num_heads + shape.num_kv_heads) * 4
                n += T * (qd + kvd) * (4 if shape.family.startswith("gemma") else a) if full else 0
            # post-attention norm
            n += T * h * 4 + small + (normalized if full else 0)
            n += linear_input(norm_out, ["gate_proj", "up_proj"], h)
            # MLP: gate, act(gate), up kept by the activation and the product; the product by down_proj
            mlp = 4 if nf4_base and regime.casts else a  # Linear4bit hands back fp32 for an fp32 input
            n += 3 * T * i * mlp + (T * i * a if trainable("down_proj") and ia3_feedforward is None else 0)
            if zero3_linear and not full and in_grad:  # ZeRO-3's linear keeps the frozen linears' inputs too
                # (o_proj's is SDPA's output, kept anyway): the attention's input where no q/k/v adapter keeps it
                # (prompt tuning: measured, the input norm's output live at the peak), the MLP's
                n += (T * h * a if not any(trainable(c) for c in attn_in) else 0)
                n += (T * h * a if not any(trainable(c) for c in ("gate_proj", "up_proj")) else 0)
                n += (T * i * a if not trainable("down_proj") else 0)
            n += lora_extra(["gate_proj", "up_proj", "down_proj"])
            base_linears = list(shape.linear_shapes())
            n += weight_casts(base_linears, () if in_grad else tuple(attn_in)) + ia3_saved()
            if shape.norms_per_layer == 4:
                n += 2 * (T * h * 4 + small + (normalized if full else 0))
            if qat:
                if qat[1]:  # each linear keeps its own fake-quantised input instead of the shared one
                    n -= linear_input(norm_out, attn_in, h) + linear_input(norm_out, ["gate_proj", "up_proj"], h)
                    n -= T * i * a if trainable("down_proj") else 0
                n += sum(qat_linear_bytes(T, din, dout, *qat) for din, dout in shape.linear_shapes().values())
        layer.append(n)
        # Recomputed under checkpointing, a block that keeps its input for its first norm keeps the checkpointed
        # input itself (LayerNorm's input; RMSNorm's fp32 view when the stream is fp32, .to(float32) returning it):
        # no new tensor beyond the one the checkpoint holds
        kept_input = in_grad and (shape.family == "gpt2" or res == 4)
        recompute.append(n - (T * h * res if kept_input else 0))
    # A block's forward at its fullest, its MLP's output projection (what a pipeline stage that ends in no loss
    # peaks at, in the newest chunk's last block): transformers' blocks hold the second norm's output in
    # ``hidden_states`` across ``self.mlp`` (GPT2Block, LlamaDecoderLayer; GPT2Block its ``attn_output`` too) and
    # the MLPs their product across the projection, though nothing keeps either where the MLP's linears save no
    # copy of them; beside the projection's output. A LoRA adapter on the projection adds lora_B's output and its scaled copy and, where a 16-bit input meets
    # the fp32 adapter, peft's fp32 copy of the product (tuners_utils.py: _cast_input_dtype) until autocast has cast it
    # back (measured: bench/peak_tensors.py, small-gpt2 pipeline LoRA bf16, every one of these live at rank 0's peak).
    gpt2 = shape.family == "gpt2"
    in_names, out_name = (["c_fc"], "c_proj") if gpt2 else (["gate_proj", "up_proj"], "down_proj")
    norm_bytes = res if gpt2 else (4 if regime.name != "pure16" else 2)
    norm_kept = not regime.casts and any(trainable(n) for n in in_names) and ia3_feedforward is None
    product_kept = (trainable(out_name) and not adapted(out_name)) or (adapted(out_name) and not regime.casts)
    forward_block = (0 if norm_kept else T * h * norm_bytes) + (0 if product_kept else T * i * a) + T * h * a
    if gpt2:  # GPT2Block keeps ``attn_output`` (the attention's projection) in a local until it returns
        forward_block += T * h * a
    if adapted(out_name) and not lycoris and ia3_feedforward is None:
        forward_block += 2 * T * h * a + (T * i * 4 if regime.casts and a == 2 else 0)
    # final norm (+ lm_head input when lm_head trains), embedding indices, rotary cos/sin
    final = T * h * 4 + small if shape.family != "gpt2" else T * h * res + 2 * small
    if full:
        final += T * h * (4 if shape.family.startswith("gemma") else regime.residual)  # normalised input (see normalized)
        final += T * h * (2 if regime.act == 2 else 4)  # lm_head's input (its bf16 copy under autocast)
    if zero3_linear and not full and shape.family != "gpt2":
        # ZeRO-3's linear (deepspeed/runtime/zero/linear.py: LinearFunctionForZeroStage3) keeps the frozen LM head's
        # input, the final norm's output, which needs a gradient once anything before it trains (measured)
        final += T * h * a
    if qat and not shape.tied_embeddings:  # lm_head is quantised unless it is the embedding's weight
        final += qat_linear_bytes(T, h, V, *qat) - (T * h * 4 if qat[1] else 0)
    if regime.casts and regime.name != "lora16":
        final += 2 * shape.vocab * h  # lm_head weight's bf16 copy
    final += T * 8  # embedding indices
    if embedding_leaf:
        final += T * h * res  # the embedding's partial lookup, kept by its AccumulateGrad (see the docstring)
    if shape.family != "gpt2":
        final += 2 * s * shape.head_dim * regime.residual  # cast to the hidden states' dtype
    # workers/steps.py token_loss_sum shifts the labels, not the logits: cross-entropy runs over all
    # T positions (each row's last is ignored), on a contiguous view of the logits. Prompt tuning
    # (``virtual_tokens``): peft prepends the virtual tokens to the embeddings, so the logits cover them too,
    # but token_loss_sum keeps the last len(labels) positions: cross-entropy runs over the data's positions
    # only, and the slice, not contiguous, is copied by the reshape, in the logits' dtype (measured: a prompt
    # tuning job's log-softmax and loss gradients b × s × V, not b × (s + p) × V).
    Tl = b * (s - virtual_tokens)
    logit_bytes = 4 if regime.name == "fp32" else 2
    loss_saved = Tl * V * 4 + Tl * 8  # log-softmax output (fp32) and the int64 targets
    logits = T * V * logit_bytes
    # fp32: a view (or the slice's copy); 16-bit logits: .float() copies
    loss_copy = (Tl * V * logit_bytes if virtual_tokens else 0) + (0 if regime.name == "fp32" else Tl * V * 4)
    loss_grad = 2 * Tl * V * 4
    if loss_parallel:  # V is the rank's share of the vocabulary
        # forward (_log_softmax): ``shifted = x - max`` lives on beside ``exp(shifted)`` while the sum of
        # exponentials is taken, and beside the result (the kept log-softmax) after: one fp32 T × V more than
        # aten's fused log-softmax, which writes its output only
        loss_copy += T * V * 4
        # backward (_nll_loss_and_log_softmax_backward, one op for nll_loss and log_softmax): a zeros_like with
        # -1 at the targets, exp(log-softmax), their sum, then that × the incoming gradient while the local
        # zeros tensor is still referenced: three fp32 T × V at once where aten's two ops hold two
        loss_grad = 3 * T * V * 4
    if loss_chunk_tokens:
        # workers/chunked_loss.py runs each chunk of c tokens under non-reentrant checkpointing
        # (torch/utils/checkpoint.py): forward keeps only the chunk's input and targets, so the plain
        # head's saved input (its bf16 copy under autocast) gives way to the final hidden states themselves,
        # kept whether or not the head trains, in the residual stream's dtype.
        c = min(loss_chunk_tokens, T)
        if full:
            final -= T * h * (2 if regime.act == 2 else 4)
        loss_saved = T * h * res + T * 8  # the head's input, the int64 targets
        # one chunk's fp32 logits (16-bit logits are freed once ``.float()`` has copied them) and its
        # log-softmax, freed when the chunk's loss is summed (measured: the 16-bit logits are not live then)
        logits = c * V * 4
        loss_copy = c * V * 4
        # in backward, one chunk at a time: its recomputed log-softmax and two fp32 gradients, plus the
        # gradient of the hidden states being summed over the chunks and, where the head trains, a chunk's
        # weight gradient in the compute dtype before it is added to .grad (measured, fp32/autocast/LoRA)
        loss_grad = 3 * c * V * 4 + T * h * res + (V * h * a if full else 0)
    ckpt_layer = T * h * res
    # One block's backward at its fullest. A gated MLP (SwiGLU, GeGLU) peaks in the product's backward: down_proj's
    # input gradient and MulBackward0's two outputs, the gradients of act(gate) and of up, all T × intermediate in the
    # activations' dtype (measured: bench/peak_tensors.py, pipeline stages), beside the block's incoming fp32 residual
    # gradient. GPT-2's MLP: two T × intermediate gradients in flight and two fp32 T × hidden.
    bwd_temp = 3 * T * i * a + T * h * 4 if shape.mlp in ("swiglu", "geglu") else 2 * T * i * a + 2 * T * h * 4
    if nf4_base:  # MatMul4Bit.backward dequantises its weight to the compute dtype (quantised from it)
        bwd_temp += largest_quantised(shape) * a
    return Activations(layer, final, loss_saved, logits, loss_copy, loss_grad, ckpt_layer, bwd_temp, max(recompute),
                       forward_block)


def qat_linear_bytes(T: int, din: int, dout: int, group: int, act: bool) -> int:
    """What one of torchao's FakeQuantizedLinear (torchao/quantization/qat/linear.py: forward) keeps for
    backward, fp32, with memfit's scheme (int8 per-token asymmetric activations, int4 per-group weights;
    workers/strategies/qat.py). The activation fake-quantiser (qat/fake_quantizer.py: _per_token_forward,
    quant_primitives' _fake_quantize_affine through its straight-through rounding) keeps the per-token
    scale and zero point and one T × in intermediate, and F.linear keeps the fake-quantised input: 2·T·in
    plus 2·T. The weight fake-quantiser (per group) keeps the weight regrouped as out × in/g × g and
    F.linear the fake-quantised weight: 2·out·in plus a scale and zero point per group (tests/test_qat.py
    holds these to the saved-tensor hooks of a real FakeQuantizedLinear, both schemes). ``act``: the
    activations are fake-quantised (the int8 scheme; weight-only keeps the plain input, counted by the
    caller as without QAT); the plain input the linear would have kept is then the caller's to subtract."""
    return 4 * ((2 * T * din + 2 * T if act else 0) + 2 * dout * din + 2 * dout * (din // group))


def padding_mask_bytes(shape: ModelShape, b: int, s: int, a: int) -> int:
    """What a padded micro-batch adds to one block's SDPA, beyond a causal one. transformers builds a
    boolean b×1×s×s mask when any row is padded (masking_utils.sdpa_mask skips it only when none is), and
    then (integrations/sdpa_attention.py: use_gqa_in_sdpa wants ``attention_mask is None``) gives SDPA
    every head's keys and values through repeat_kv, which SDPA keeps for backward instead of the kv heads:
    2·T·(q_dim − kv_dim) elements. torch's SDPA converts the boolean mask to an additive one in the query's
    dtype (aten/src/ATen/native/transformers/attention.cpp: convert_boolean_attn_mask), a new b×s×s tensor
    in every block, which the kernel keeps for its backward (measured on CPU: small-llama, chat rows)."""
    T = b * s
    return b * s * s * a + 2 * T * (shape.q_dim - shape.kv_dim) * a


def fsdp_root_reduce(shape: ModelShape, reduce_bytes: int, unit_bytes: int, on_gpu: bool) -> int:
    """FSDP2, a full fine-tune on more than one rank: the temporaries of the root unit's (embeddings, final
    norm, lm_head) reduce-scatter, the last of backward, beside every gradient shard.

    - the reduce-scatter input the root's gradients are copied into, in the reduce dtype (``reduce_bytes``;
      torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_reduce, ``reduce_scatter_input``);
    - the root's last gradient: foreach_reduce's loop over ``zip(fsdp_params, unsharded_grads)`` leaves its
      variable ``unsharded_grad`` bound to the group's last gradient, so ``unsharded_grads.clear()`` frees every
      other one and that one lives until foreach_reduce returns — lm_head's weight (vocab × hidden) when the
      head is untied, else the final norm's last parameter — in the gathered unit's dtype (``unit_bytes``: memfit
      reduces every micro-batch, so the gradient is the unsharded parameter's own, never the accumulated one);
    - on gloo (CPU workers), the copy of the input ProcessGroupGloo reduces in (``aten::clone`` inside
      ``c10d::_reduce_scatter_base_``), freed when the collective has finished.
    The root's output shard is its gradient shard, already among the gradients. Found with bench/peak_tensors.py
    (small-llama s128 + checkpointing, fp32: these three, nothing else; bf16: the same with a bf16 lm_head gradient).
    """
    root = shape.parameter_count() - shape.num_layers * shape.layer_params()
    last = shape.lm_head_params() or shape.norm_params() // (2 if shape.norm == "layernorm" else 1)
    return root * (1 if on_gpu else 2) * reduce_bytes + last * unit_bytes


# --- pipeline stages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageView:
    """One pipeline stage as its rank holds it (workers/strategies/pipeline.py builds the same split)."""

    index: int
    blocks: range
    parameters: int  # bytes
    gradients: int
    optimizer_states: int
    act: Activations  # one chunk's, through this stage's blocks (and the loss on the last stage)
    in_flight: int  # chunks whose activations the stage holds at its peak
    largest_trainable: int  # elements of the largest tensor the optimizer updates
    saved_bytes: int | None = None  # interleaved_1f1b: the rank's peak over its local stages (else in_flight × act)
    local_blocks: list[range] | None = None  # interleaved_1f1b: the blocks of each model stage the rank holds
    embedding_grad: int = 0  # first stage, embedding trained: a later chunk's embedding backward's temporaries
    embedding_saved: int = 0  # the other chunks' activations live at that backward
    sent: int = 0  # a chunk's output sent on and input gradient sent back (interleaved_1f1b keeps both: _rank_view)
    recv_buffers: int = 0  # the stage's receive buffers, one per chunk and direction, held all step (pipeline_stages)
    forward_block: int = 0  # a non-last stage's steady forward at its last block's MLP projection, beyond its chunks
    held_sends: int = 0  # what Schedule1F1B's send variables hold at a steady forward or backward (pipeline_stages)


def checkpointed_peft(spec: JobSpec) -> bool:
    """A frozen embedding under gradient checkpointing: transformers' ``enable_input_require_grads`` hook makes the
    lookup's output require a gradient (see :func:`activations`, ``embedding_leaf``), so the first block's input needs
    one as every later block's does, and its recomputation keeps what theirs keep (measured: a one-block pipeline
    stage's recomputation, GPT-2 LoRA bf16, with c_attn's frozen weight cast kept)."""
    return spec.training.gradient_checkpointing and spec.training.peft.method != PeftMethod.none


def embedding_leaf(spec: JobSpec, shape: ModelShape, vocab_split: bool = False) -> bool:
    """Whether the embedding's output is kept as a leaf all step (see :func:`activations`, ``embedding_leaf``)."""
    t = spec.training
    peft = t.peft.method
    return (t.gradient_checkpointing and peft != PeftMethod.none and peft != PeftMethod.prompt_tuning
            and (vocab_split or shape.family == "gpt2"))


def pipeline_stages(spec: JobSpec, shape: ModelShape, rg, targets: set[str] | None, Pt: int, b: int,
                    s: int) -> list[StageView]:
    """Each stage's model states and activations. Stage 0 holds the embeddings, the last stage the final
    norm and the LM head — and, when the two are tied, its own copy of the shared weight, trained on
    both ends. Activations are one chunk's (``b / pipeline.microbatches`` rows) times the chunks in
    flight at the stage's peak (service/domain/training.py: in_flight_microbatches); a stage after the
    first keeps its first block's input for the gradient it sends back, as a block after the first does."""
    t = spec.training
    ranks = t.pipeline.stages
    local = local_stages(t.pipeline.schedule, t.pipeline.virtual_stages)
    stages = ranks * local  # model stages; with interleaved_1f1b rank r holds r, r + ranks, …
    chunks = spec.resolved().pipeline_microbatches
    rows = max(1, b // chunks)
    full = targets is None
    adapter_numels = [] if full else _trainable_numels(spec, shape, targets)
    adapter_per_block = 0 if full else Pt // max(shape.num_layers, 1)
    sizes = ACTIVATION_SIZES[rg.name]
    views = []
    for k, blocks in enumerate(stage_layers(shape.num_layers, stages)):
        first, last = k == 0, k == stages - 1
        n = len(blocks)
        held = n * shape.layer_params()
        held += shape.embedding_params() if first else 0
        held += shape.norm_params() + shape.vocab * shape.hidden if last else 0
        trained = held if full else n * adapter_per_block
        frozen = 0 if full else held
        act = activations(replace(shape, num_layers=n), rows, s, sizes, targets, t.peft.r, t.attention,
                          input_grad=not first or checkpointed_peft(spec),
                          embedding_leaf=first and last and embedding_leaf(spec, shape),
                          **method_terms(spec, shape))
        # torch.distributed.pipelining's stage keeps each chunk's output until that chunk's backward
        # (stage.py: fwd_cache, which backward_one_chunk runs autograd from): the residual stream sent on,
        # or on the last stage the logits, which the plain loop frees once the loss has them.
        # A stage after the first runs on the activation it received: the receive buffer itself (stage.py:
        # _retrieve_recv_activations), held with the others (``recv`` below), so its first block's kept input
        # (the norm's fp32 input, which .to(float32) leaves as it is, or the checkpointed input) is no new tensor.
        chunk_io = rows * s * shape.hidden * sizes.residual
        received = 0 if first else chunk_io
        if not last:  # no final norm, head or loss here: the rotary tables (and the first stage's token ids)
            rotary = 0 if shape.family == "gpt2" else 2 * s * shape.head_dim * sizes.residual
            # backward starts at the stage's last block with all its chunks' activations live and the block's own
            # gradients in flight; the residual gradient it starts from is the one received from the next stage,
            # a receive buffer (below), not a new tensor
            first_backward = act.layer_backward_temp_bytes - rows * s * shape.hidden * 4
            leaf = chunk_io if first and embedding_leaf(spec, shape) else 0  # see activations: embedding_leaf
            act = replace(act, final_bytes=rotary + (rows * s * 8 if first else 0) + chunk_io - received + leaf,
                          loss_saved_bytes=0, logits_bytes=0, loss_copy_bytes=0,
                          loss_grad_bytes=first_backward, layer_backward_temp_bytes=first_backward)
        else:
            ids = 0 if first else rows * s * 8  # the token ids stay on stage 0
            act = replace(act, final_bytes=act.final_bytes - ids + act.logits_bytes - received, logits_bytes=0)
        # torch.distributed.pipelining allocates a receive buffer per chunk for the activation a stage after the
        # first receives and for the gradient a stage before the last receives, once, and keeps them (stage.py:
        # _create_act_recv_info, _create_grad_recv_info): both in the residual stream's dtype
        recv = chunks * chunk_io * ((not first) + (not last))
        largest = max(shape.layer_params(), shape.vocab * shape.hidden if (first or last) else 0) if full \
            else max(adapter_numels, default=1)
        in_flight = in_flight_microbatches(t.pipeline.schedule, stages, k, chunks)
        # Schedule1F1B (torch/distributed/pipelining/schedules.py: _step_microbatches) keeps two sends' tensors past
        # their chunks' backward: ``send_work`` holds the Works of the warm-up's last fired forward send (chunk W−2's
        # output, W = in_flight warm-up forwards) until the cool-down reassigns it, and ``bwd_sends`` holds the last
        # backward's input-gradient send until the next backward has run. At a steady backward (W chunks in flight,
        # after chunk W−2's backward: chunks ≥ 2W − 1) the first is one chunk's output more; on a stage after the
        # first, every backward after the first has the second, one chunk's input gradient. (ScheduleGPipe waits its
        # sends when all forwards, then all backwards, have run: its peak, the first backward, has none beyond its
        # chunks.)
        held_sends = 0
        if t.pipeline.schedule == "1f1b":
            held_sends += chunk_io if not last and in_flight >= 2 and chunks >= 2 * in_flight - 1 else 0
            held_sends += chunk_io if not first and chunks >= 2 else 0
        # live at every backward instant after the first: its start and a checkpointed block's recomputation
        act = replace(act, loss_grad_bytes=act.loss_grad_bytes + held_sends,
                      layer_backward_temp_bytes=act.layer_backward_temp_bytes + held_sends)
        # torch's embedding backward (aten::embedding_dense_backward) builds a dense vocab × hidden gradient
        # and AccumulateGrad adds it into the weight's .grad from an earlier chunk: both live at once, with
        # every other gradient and the chunks still in flight (a 1F1B stage: all but the one going back).
        embedding_grad = shape.vocab * shape.hidden * dtype_bytes(rg.trainable_dtype) + rows * s * shape.hidden * 4 \
            + held_sends if first and full else 0  # + the gradient it reads (fp32: the first block's input gradient)
        # a non-last stage ends in no loss: its forward peaks in the newest chunk's last block, at the MLP's
        # projection (Activations.forward_block_bytes), before that chunk's output exists, with the sends held
        forward_block = act.forward_block_bytes - chunk_io + held_sends if not last else 0
        views.append(StageView(
            k, blocks, frozen * dtype_bytes(rg.frozen_dtype) + trained * dtype_bytes(rg.trainable_dtype),
            trained * dtype_bytes(rg.grad_dtype), trained * 2 * dtype_bytes(rg.optimizer_dtype), act,
            in_flight, largest, embedding_grad=embedding_grad,
            embedding_saved=(in_flight - 1) * act.saved(t.gradient_checkpointing),
            sent=((not last) + (not first)) * rows * s * shape.hidden * sizes.residual, recv_buffers=recv,
            forward_block=forward_block, held_sends=held_sends))
    if local > 1:
        return [_rank_view(r, views[r::ranks], interleaved_in_flight(ranks, local, r, chunks), t.gradient_checkpointing)
                for r in range(ranks)]
    return views


def _rank_view(rank: int, held: list[StageView], order: list[tuple[int, ...]], checkpointing: bool) -> StageView:
    """A rank of interleaved_1f1b: its local model stages' states summed; its activations at the peak of
    the schedule's order (service/domain/training.py: interleaved_in_flight), each local stage's chunks
    weighted by that stage's own activations; the loss and backward terms of the stage that has them
    (the last model stage on the last rank, else the rank's largest)."""
    per_chunk = [v.act.saved(checkpointing) for v in held]
    # + what each chunk whose backward has run sent: _PipelineScheduleRuntime._step_microbatches
    # (schedules.py) keeps every send's Work, which holds its tensor, in send_ops until step() ends
    done, live = [0] * len(held), []
    for i, counts in enumerate(order):
        prev = order[i - 1] if i else (0,) * len(counts)
        done = [d + max(0, p - n) for d, p, n in zip(done, prev, counts)]
        live.append(sum(n * a + d * v.sent for n, a, d, v in zip(counts, per_chunk, done, held)))
    saved = max(live)
    act = held[-1].act if held[-1].act.logits_bytes or held[-1].act.loss_saved_bytes else \
        max(held, key=lambda v: v.act.saved(checkpointing)).act
    # the first local stage's backwards after its first (its embedding's, on rank 0): what stays in flight
    after = [i for i in range(1, len(order)) if order[i][0] < order[i - 1][0]][1:]
    embedding_saved = max((live[i] for i in after), default=0)
    # each forward of a local stage that ends in no loss peaks inside its last block (StageView.forward_block)
    forwards = [live[i] + held[j].forward_block for i in range(len(order)) for j in range(len(held))
                if held[j].forward_block and order[i][j] > (order[i - 1][j] if i else 0)]
    return StageView(rank, range(held[0].blocks.start, held[-1].blocks.stop),
                     sum(v.parameters for v in held), sum(v.gradients for v in held),
                     sum(v.optimizer_states for v in held), act, max(sum(c) for c in order),
                     max(v.largest_trainable for v in held), saved, [v.blocks for v in held],
                     held[0].embedding_grad, embedding_saved, recv_buffers=sum(v.recv_buffers for v in held),
                     forward_block=max(0, max(forwards, default=0) - saved))


# --- model states --------------------------------------------------------------------------------


def trainable_parameters(spec: JobSpec, shape: ModelShape) -> int:
    """What peft's ``get_nb_trainable_parameters`` reports (a test builds every method on the meta
    device for every family and compares), or every parameter for a full fine-tune."""
    return sum(_trainable_numels(spec, shape, _lora_targets(spec, shape)))


def plan(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, world_size: int | None = None,
         safety_margin: float = 0.10, stage: int | None = None, seq_length: int | None = None,
         padded: bool = False, nodes=None) -> Plan:
    """Per-rank memory of ``spec`` training ``shape``; ``gpu`` (catalogue name) or the spec's gpu_type.

    On CPU workers (no GPU) the "device" is host memory: the capacity is the host budget when one is
    set, else ``DEFAULT_HOST_BYTES``, and offloaded state lands in the same RAM. A pipeline's plan is
    its fullest stage's, or stage ``stage``'s when given (the accuracy benchmark compares every rank).
    ``seq_length``: the padded width of the widest micro-batch when the data is known (service/memory/data.py),
    else every row is padded to ``max_seq_length``; ``padded``: that micro-batch holds shorter rows, so
    attention runs with a padding mask (not on a pipeline, whose stages run causal attention unmasked).
    ``host_memory`` is service/memory/host.py's: per rank, and against the fullest of ``nodes``
    (service/memory/nodes.py) when given — a node short of memory makes the plan not fit.
    """
    t = spec.training
    gpu = gpu or t.resources.gpu_type
    g: GPU | None = get_gpu(gpu) if gpu else None
    on_gpu = g is not None
    N = int(world_size or t.resources.num_workers)
    resolved = spec.resolved()
    b, accum = resolved.micro_batch_size, resolved.gradient_accumulation_steps
    s = t.hyperparameters.max_seq_length if seq_length is None else seq_length
    if t.peft.method == PeftMethod.prompt_tuning or t.peft.method == PeftMethod.prefix_tuning:
        s += t.peft.num_virtual_tokens if t.peft.method == PeftMethod.prompt_tuning else 0
    model_shape = shape
    if t.strategy == StrategyName.tensor:  # one rank of a tensor-parallel group: a model of 1/size the heads and columns
        tp = check_tensor(spec, shape)
        shape, N = rank_shape(shape, tp), N // tp
        vocab = (f"1/{tp} of the vocabulary's embedding rows, LM head and logits (cross-entropy under loss_parallel)"
                 if shape.vocab != model_shape.vocab else "the embeddings and LM head whole")
        assumptions_tp = [f"tensor parallel: {tp} ranks each hold 1/{tp} of every block's heads and MLP columns, "
                          f"{vocab} and the norms whole; {N} data-parallel replica(s)"
                          + (" sharded by FSDP2" if N > 1 else "")]
    Pt = trainable_parameters(spec, shape)
    # PEFT adds its adapter to the frozen base: the model holds both.
    P = shape.parameter_count() + (Pt if t.peft.method != PeftMethod.none else 0)
    full = t.peft.method == PeftMethod.none
    targets = _lora_targets(spec, shape)
    rg = regime(t.strategy.value, t.peft.method.value, t.precision.value)
    assumptions: list[str] = [
        (f"sequences padded to max_seq_length={s}, micro-batch {b}, {accum} accumulation step(s)" if seq_length is None
         else f"rows padded to the longest row of the training data, {s} tokens (max_seq_length="
              f"{t.hyperparameters.max_seq_length}), micro-batch {b}, {accum} accumulation step(s)"),
        "AdamW: two fp32 moments per trainable parameter",
        f"activations: {rg.name} regime, {t.attention} attention, "
        f"{'checkpointing every block' if t.gradient_checkpointing else 'no checkpointing'}",
    ]
    strategy = t.strategy.value
    padded = padded and strategy != "pipeline"  # the stages run causal attention without the padding mask
    if padded:
        assumptions.append("the widest micro-batch holds shorter rows: attention runs with a padding mask "
                           "(every head's keys and values and an additive mask kept per block)")
    ds = t.deepspeed
    qlora = t.peft.method == PeftMethod.qlora
    if t.activation_offload and on_gpu:
        assumptions.append("activation offload: the forward's saved activations in pinned host memory (torch's "
                           "pinned allocator rounds each block up to a power of two), one block's back on the "
                           "device at a time in backward")
    if t.loss_chunk_tokens:
        problem = loss_chunk_problem(shape.extra.get("final_logit_softcapping"))
        if problem:
            from service.domain.errors import SpecInvalid

            raise SpecInvalid([{"param": "training.loss_chunk_tokens", "message": problem, "code": "invalid_value"}])
        assumptions.append(f"loss: LM head and cross-entropy over chunks of {min(t.loss_chunk_tokens, b * s)} "
                           "tokens, each recomputed in backward")

    if t.qat.enabled:
        widths = {name: din for name, (din, _) in shape.linear_shapes().items()}
        if not shape.tied_embeddings:
            widths["lm_head"] = shape.hidden
        problem = qat_problem(shape.family, widths, t.qat.group_size)
        if problem:
            from service.domain.errors import SpecInvalid

            raise SpecInvalid([{"param": "training.qat.group_size" if shape.family != "gpt2" else "training.qat.enabled",
                                "message": problem, "code": "invalid_value"}])

    dev, host = Breakdown(), Breakdown()
    # --- model states (steady state: optimizer states exist) -----------------------------
    if rg.cast_frozen_base:
        assumptions.append("LoRA + bf16: the frozen base is held in bf16, the adapter in fp32")
    if not qlora:
        base_param_bytes = (P - Pt) * dtype_bytes(rg.frozen_dtype) + Pt * dtype_bytes(rg.trainable_dtype)
    else:
        base_param_bytes = qlora_base_bytes(shape, dtype_bytes(rg.compute_dtype)) + Pt * 4
        assumptions.append("QLoRA: NF4 base (0.5 B/param + double-quantised block constants, ~0.516 B/param), "
                           "embeddings, norms and lm_head upcast to fp32, the adapter in fp32; no 16-bit copy of "
                           "the base (each 4-bit linear dequantises its weight per call)")
    grad_bytes = dtype_bytes(rg.grad_dtype)
    grads_full = Pt * grad_bytes
    opt = Pt * 2 * dtype_bytes(rg.optimizer_dtype)
    # torch's AdamW keeps a 0-dim fp32 ``step`` per parameter (torch/optim/adam.py: _init_group), on the CPU unless
    # fused or capturable: 4 bytes a trainable tensor, on every rank, beside the moments (measured: the whole
    # difference, 128 B for LoKr's 32 tensors, between planned and counted optimizer states on CPU workers).
    # DeepSpeed's optimizers step flat partitions; on a GPU these few bytes are host memory or negligible.
    adam_steps = 4 * len(_trainable_numels(spec, shape, targets)) if not on_gpu else 0
    master = 0
    gathered = 0  # params materialised at the loss (forward's end, backward's start) beyond the shards
    gathered_layer = 0  # params materialised while one block runs (its forward, recompute or backward)
    root_reduce = 0  # FSDP2, full fine-tune: the root's reduce-scatter temporaries (fsdp_root_reduce)
    loss_gathered = 0  # params gathered while the loss runs (forward) and is differentiated, beyond ``gathered``
    comm = 0  # communication buckets
    opt_temp_unit = max(_largest_trainable(spec, shape, targets), 1) * 4

    stage_views: list[StageView] = []
    if strategy == "pipeline":
        problem = pipeline_problem(shape.family, shape.num_layers,
                                   t.pipeline.stages * local_stages(t.pipeline.schedule, t.pipeline.virtual_stages))
        if problem:
            from service.domain.errors import SpecInvalid

            raise SpecInvalid([{"param": "training.pipeline.stages", "message": problem, "code": "invalid_value"}])
        stage_views = pipeline_stages(spec, shape, rg, targets, Pt, b, s)
        assumptions.append(f"pipeline: {t.pipeline.stages} stages × {N // t.pipeline.stages} data-parallel "
                           f"replica(s), {t.pipeline.schedule}"
                           + (f" ({local_stages(t.pipeline.schedule, t.pipeline.virtual_stages)} model stages per rank)"
                              if t.pipeline.schedule == "interleaved_1f1b" else "")
                           + f", {spec.resolved().pipeline_microbatches} chunk(s) per "
                           "micro-batch; the fullest stage is shown")
    elif strategy == "ddp" or (strategy == "tensor" and N == 1):
        dev.parameters = base_param_bytes
        dev.gradients = grads_full
        dev.optimizer_states = opt + adam_steps
        if N > 1 and strategy == "ddp":
            comm = grads_full  # DDP's gradient buckets: a second fp32 copy of every trainable gradient
            assumptions.append("DDP keeps gradient buckets (one fp32 copy of the trainable gradients)")
    elif strategy in ("fsdp", "tensor"):  # tensor with N > 1 data-parallel replicas: FSDP2 shards each rank's share
        # FSDP2 keeps one dtype per unit: every shard in the trained weights' (QLoRA's packed codes: below)
        dev.parameters = P * dtype_bytes(rg.trainable_dtype) // N
        dev.gradients = grads_full // N
        dev.optimizer_states = opt // N + adam_steps  # every rank steps a shard of every parameter
        if t.peft.method == PeftMethod.ia3 and N > 1:
            # FSDP2 shards each parameter on dim 0 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: Shard(0),
            # chunks of ceil(d0 / N) rows): IA3's feed-forward vectors are 1 × in (peft/tuners/ia3/layer.py), so
            # rank 0 holds each whole and the others none; the plan is the fullest rank's
            ff = feedforward_targets(shape.family, t.peft.target_modules)
            whole = sum(din for din, _ in shape.targeted_linears(ff).values()) * shape.num_layers
            extra = whole - whole // N
            dev.parameters += extra * dtype_bytes(rg.trainable_dtype)
            dev.gradients += extra * grad_bytes
            dev.optimizer_states += extra * 2 * dtype_bytes(rg.optimizer_dtype)
        unit_bytes = dtype_bytes(rg.compute_dtype)  # a unit is gathered in the compute dtype
        adapter_per_layer = 0 if full else Pt // max(shape.num_layers, 1)
        layer_unsharded = (shape.layer_params() + adapter_per_layer) * unit_bytes
        if qlora:
            # the packed 4-bit codes (stored in the compute dtype, workers/peft_setup.py) shard and gather as
            # bytes; their constants are not parameters and stay whole on every rank (service/memory/nf4.py)
            quantised = sum(quantised_numels(shape))
            dev.parameters = (packed_bytes(shape) + (P - quantised) * dtype_bytes(rg.trainable_dtype)) // N \
                + constants_bytes(shape)
            layer_quantised = quantised // max(shape.num_layers, 1)
            layer_unsharded = packed_bytes(shape, 1) + (shape.layer_params() - layer_quantised + adapter_per_layer) * unit_bytes
        root = (shape.parameter_count() - shape.num_layers * shape.layer_params()) * unit_bytes
        if t.fsdp.reshard_after_forward:
            # Every unit, the root included, reshards when its forward ends and re-gathers only when
            # backward reaches it: at the loss no unsharded parameter is live (measured).
            gathered = 0
            gathered_layer = 2 * layer_unsharded  # the running block and the prefetched next one
            if t.loss_chunk_tokens:  # a chunked loss runs inside the root's forward, and it is the root's
                loss_gathered = root  # output, whose pre-backward hook re-gathers the root before the chunks' backward
        else:
            gathered = shape.num_layers * layer_unsharded + root
            gathered_layer = gathered
        comm = (shape.layer_params() * grad_bytes) if full else 0  # one unit's reduce-scatter input
        if full and N > 1:
            root_reduce = fsdp_root_reduce(shape, grad_bytes, unit_bytes, on_gpu)
        if t.fsdp.cpu_offload:
            host.parameters, dev.parameters = dev.parameters, 0
            host.gradients, dev.gradients = dev.gradients, 0
            host.optimizer_states, dev.optimizer_states = dev.optimizer_states, 0
        assumptions.append("FSDP2: one unit per decoder block plus the root (embeddings, final norm, lm_head)")
    elif strategy == "deepspeed":
        stage = ds.zero_stage
        buckets = deepspeed_buckets(shape.hidden, ds.reduce_bucket_elements)
        bucket = buckets.reduce_elements
        p_bytes = dtype_bytes(rg.frozen_dtype)  # DeepSpeed's 16-bit mode converts the whole module
        comm = (buckets.reduce_elements + buckets.allgather_elements) * grad_bytes
        # 16-bit weights: fp32 masters in the optimizer; ZeRO >= 1 also keeps an fp32 flat partition in fp32
        master_bytes = dtype_bytes(rg.master_dtype or "float32")
        master = Pt * master_bytes if rg.master_dtype is not None or stage >= 1 else 0
        if stage == 0:
            dev.parameters = base_param_bytes
            dev.gradients = grads_full
            dev.optimizer_states = opt + (Pt * master_bytes if rg.master_dtype is not None else 0)
        elif stage in (1, 2):
            dev.parameters = base_param_bytes
            dev.gradients = grads_full if stage == 1 else grads_full // N
            numels = _trainable_numels(spec, shape, targets)
            if stage == 2 and ds.offload_optimizer != "cpu" and numels:
                dev.gradients = zero2_gradient_buffer_elements(numels, N) * grad_bytes
            dev.optimizer_states = (opt + master) // N
        else:
            dev.parameters = base_param_bytes // N
            dev.gradients = grads_full // N
            dev.optimizer_states = (opt + master) // N
            prefetch = buckets.prefetch_elements
            if P <= buckets.max_reuse_distance:
                gathered = base_param_bytes  # every param is reused within max_reuse_distance: kept gathered
                gathered_layer = gathered
                if not full and not shape.tied_embeddings and not t.gradient_checkpointing:
                    # a frozen, untied lm_head is released after its forward and is not live at the
                    # loss or at the start of backward (measured with LoRA; with checkpointing it stays)
                    gathered -= shape.vocab * shape.hidden * p_bytes
                if not full:
                    # Other frozen weights no backward reaches are released after their forward too, so they are not
                    # gathered at the loss: GPT-2's position embeddings, and the first block's linears that read its
                    # input where that input needs no gradient (no checkpointing hook, not prompt tuning), whose
                    # frozen weights DeepSpeed's linear (deepspeed/runtime/zero/linear.py) needs for no input gradient
                    # (measured: GPT-2 IA3 under ZeRO-3, wpe and block 0's c_attn not gathered at the loss)
                    gathered -= shape.learned_positions * shape.hidden * p_bytes
                    if not t.gradient_checkpointing and t.peft.method != PeftMethod.prompt_tuning:
                        first = ("c_attn",) if shape.family == "gpt2" else ("q_proj", "k_proj", "v_proj")
                        lin = shape.linear_shapes()
                        gathered -= sum(lin[n][0] * lin[n][1] for n in first) * p_bytes
                assumptions.append("ZeRO-3: the model is smaller than stage3_max_reuse_distance, so gathered "
                                   "parameters stay live through forward and backward")
            else:
                gathered = gathered_layer = (2 * shape.largest_layer_params() + prefetch) * p_bytes
        if ds.offload_optimizer == "cpu":
            host.optimizer_states, dev.optimizer_states = dev.optimizer_states, 0
            # the host keeps an fp32 copy of the gradient partition for the CPU optimizer (measured)
            host.gradients, dev.gradients = dev.gradients + (Pt // N) * 4, 0
        if ds.offload_param == "cpu":
            host.parameters, dev.parameters = dev.parameters, 0
        assumptions.append(f"DeepSpeed ZeRO-{stage}: reduce bucket {bucket} elements, prefetch 0.9·hidden², "
                           "persistence threshold 10·hidden")
        opt_temp_unit = (Pt // N) * 4 if stage >= 1 else opt_temp_unit
    else:  # pragma: no cover - the spec enum has no other value
        raise ValueError(f"unknown strategy {strategy!r}")
    # what the offloading libraries allocate on the host beyond the states (service/memory/host.py)
    trainable_numels = _trainable_numels(spec, shape, targets)
    extra = host_memory.offload_terms(
        spec, world=N, on_gpu=on_gpu, trainable_numels=trainable_numels,
        all_numels=shape.parameter_numels() + (trainable_numels if not full else []),
        trainable_dtype=rg.trainable_dtype, grad_dtype=rg.grad_dtype)
    host.gradients += extra.gradients
    host.overhead += extra.overhead
    if extra.overhead:
        assumptions.append("host: pinned buffers rounded up to powers of two (torch's pinned allocator)")

    # --- activations and the peak ----------------------------------------------------------
    if stage_views:  # every stage is planned; the fullest decides
        options = [(v, v.act, v.saved_bytes if v.saved_bytes is not None else v.in_flight * v.act.saved(t.gradient_checkpointing))
                   for v in stage_views
                   if stage is None or v.index == stage]
    else:
        vocab_split = strategy == "tensor" and shape.vocab != model_shape.vocab
        act = activations(shape, b, s, ACTIVATION_SIZES[rg.name], targets, t.peft.r, t.attention,
                          zero3_linear=strategy == "deepspeed" and ds.zero_stage == 3, padded=padded,
                          loss_chunk_tokens=t.loss_chunk_tokens, nf4_base=qlora, on_gpu=on_gpu,
                          # prompt tuning's virtual tokens are trainable embeddings: the first block's input needs a gradient
                          input_grad=t.peft.method == PeftMethod.prompt_tuning or checkpointed_peft(spec),
                          loss_parallel=vocab_split,
                          embedding_leaf=embedding_leaf(spec, shape, vocab_split),
                          virtual_tokens=t.peft.num_virtual_tokens if t.peft.method == PeftMethod.prompt_tuning else 0,
                          **method_terms(spec, shape))
        options = [(None, act, act.saved(t.gradient_checkpointing))]
    # FSDP2's offloaded gradients exist only from each unit's reduce-scatter in backward (foreach_reduce copies the
    # new sharded gradient to the CPU: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) until
    # zero_grad(set_to_none=True), like the gradients of FSDP2 without offload; DeepSpeed's host gradient buffer is
    # allocated once and kept. On a CPU worker (one RAM) they follow the step's instants like device gradients.
    fsdp_host_grads = strategy == "fsdp" and t.fsdp.cpu_offload and not on_gpu
    fullest = None
    for view, act, A in options:
        if view is not None:
            dev.parameters, dev.gradients, dev.optimizer_states = view.parameters, view.gradients, view.optimizer_states
            opt_temp_unit = view.largest_trainable * 4
        state = ModelStatesPerRank(
            device=ModelStates(parameters=dev.parameters, gradients=dev.gradients, optimizer_states=dev.optimizer_states),
            host=ModelStates(parameters=host.parameters, gradients=host.gradients, optimizer_states=host.optimizer_states))
        dev_state = dev.parameters + dev.optimizer_states  # live on the device all step long
        host_state = host.parameters + (0 if fsdp_host_grads else host.gradients) + host.optimizer_states
        shared = 0 if on_gpu else host_state  # a CPU worker's "device" is the same RAM as its host
        g_all = host.gradients if fsdp_host_grads else dev.gradients
        # Gradients live in forward: earlier micro-batches' (accumulation), ZeRO-3's flat gradient
        # partition buffer, which DeepSpeed allocates once and keeps (measured), or a 1F1B stage's
        # earlier chunks' (it runs backwards between forwards once its warm-up is done).
        chunked = view is not None and t.pipeline.schedule in ("1f1b", "interleaved_1f1b") and (
            spec.resolved().pipeline_microbatches * local_stages(t.pipeline.schedule, t.pipeline.virtual_stages)
            > view.in_flight)  # interleaved: the rank's forwards over all its model stages
        g_fwd = g_all if (accum > 1 or (strategy == "deepspeed" and ds.zero_stage == 3) or chunked) else 0
        offloaded_step = ds.offload_optimizer == "cpu" and strategy == "deepspeed" or (strategy == "fsdp" and t.fsdp.cpu_offload)
        # DeepSpeed ZeRO ≥ 1: the fp32 master partition gets a flattened fp32 copy of its gradients for the step.
        master_grad = (Pt // N) * 4 if (strategy == "deepspeed" and ds.zero_stage >= 1) else 0
        step_temp = master_grad + 2 * opt_temp_unit
        # FSDP2's offloaded step is torch's AdamW on host tensors (its temporaries are host memory);
        # DeepSpeed's is DeepSpeedCPUAdam (deepspeed/ops/adam/cpu_adam.py: C++, in place on the fp32
        # partition, whose gradient buffer host.gradients already holds): no host temporaries
        host.temporary = step_temp if (offloaded_step and on_gpu and strategy != "deepspeed") else 0
        # workers/activation_offload.py: what the model's forward saves goes to pinned host memory as it is
        # saved and comes back for the backward op that reads it; the loss runs outside those hooks, so its
        # log-softmax stays. Tensors under 1 MiB (per-token statistics) stay too and are not counted.
        offload_act = t.activation_offload and on_gpu and view is None
        A_dev = act.loss_saved_bytes if offload_act else A
        host.activations = A - act.loss_saved_bytes if offload_act else 0
        # (gradients live, activations live, temporaries) at each candidate instant
        cands: dict[str, tuple[int, int, int]] = {
            "forward": (g_fwd, A_dev,
                        gathered + loss_gathered + act.logits_bytes + act.loss_copy_bytes),
            "backward": (g_fwd, A_dev, gathered + loss_gathered + act.loss_grad_bytes),
        }
        if view is not None and view.forward_block:
            cands["forward_block"] = (g_fwd, A_dev, view.forward_block)
        if view is not None and view.embedding_grad and (accum > 1 or spec.resolved().pipeline_microbatches > 1):
            # the first stage's embedding backward after its first chunk's (see pipeline_stages): every
            # gradient, the chunks still in flight, the dense gradient and the one it reads
            cands["backward_embedding"] = (g_all, view.embedding_saved, view.embedding_grad)
        if offload_act:  # one block's saved tensors back on the device at a time (or its recomputation)
            cands["backward_layer"] = (g_all, max(act.layer_bytes, default=0),
                                       gathered_layer + act.layer_backward_temp_bytes)
        elif t.gradient_checkpointing:
            cands["backward_recompute"] = (g_all, A - act.loss_saved_bytes + act.recompute_bytes,
                                           gathered_layer + act.layer_backward_temp_bytes)
            # the recomputation's own forward reaches the MLP's projection (Activations.forward_block_bytes) before
            # the block's backward temporaries exist; torch's non-reentrant checkpoint stops recomputing once the
            # last tensor backward needs is saved (the adapter's lora_A output), so lora_B's output and its scaled copy
            # are not made again, while the gradients backward brought to the block (its output's, the adapter's
            # scaled one) stand where they were, the same two tokens × hidden
            cands["backward_recompute_forward"] = (g_all, A - act.loss_saved_bytes + act.recompute_bytes,
                                                   gathered_layer + act.forward_block_bytes
                                                   + (view.held_sends if view is not None else 0))
        cands["backward_end"] = (g_all, 0, gathered_layer + comm + opt_temp_unit // 4)
        cands["optimizer"] = (g_all, 0, 0 if (offloaded_step and on_gpu) else step_temp)
        if root_reduce:  # FSDP2's last reduce-scatter, the root's: every gradient shard exists by then
            cands["root_reduce"] = (g_all, 0, root_reduce)
        if view is not None and view.recv_buffers:  # held at every instant, with the step's temporaries
            cands = {k: (g, a, tmp + view.recv_buffers) for k, (g, a, tmp) in cands.items()}
        phases = {k: dev_state + shared + sum(v) for k, v in cands.items()}
        if view is not None:
            blocks = " and ".join(f"{r.start}–{r.stop - 1}" for r in (view.local_blocks or [view.blocks]))
            assumptions.append(f"stage {view.index}: blocks {blocks}, "
                               f"{view.in_flight} chunk(s) in flight, peak {max(phases.values()) / MiB:.1f} MiB")
        if fullest is None or max(phases.values()) > max(fullest[-1].values()):
            fullest = (view, A, state, dev.model_copy(), host.model_copy(), cands, phases)
    _, A, state, dev, host, cands, phases = fullest
    peak_phase = max(phases, key=lambda k: phases[k])
    dev.gradients, dev.activations, dev.temporary = cands[peak_phase]
    if fsdp_host_grads:  # the gradients live at the peak instant are the offloaded (host) ones
        host.gradients, dev.gradients = dev.gradients, 0
    if on_gpu:
        dev.overhead = g.context_bytes + (g.nccl_bytes if N > 1 else 0)
        # The caching allocator rounds blocks and keeps freed ones: budget ~5% of the live peak.
        dev.overhead += int(0.05 * phases[peak_phase])
        assumptions.append(f"overhead: CUDA context {g.context_bytes // MiB} MiB"
                           + (f", NCCL {g.nccl_bytes // MiB} MiB" if N > 1 else "")
                           + ", allocator rounding/cache 5% of the live peak")
    runtime = 0 if on_gpu else CPU_RUNTIME_BYTES
    if on_gpu:
        capacity = g.capacity_bytes
    else:
        capacity = t.resources.host_memory_budget_bytes or DEFAULT_HOST_BYTES
    usable = int(capacity * (1 - safety_margin))
    # The planner's own measured error for this strategy (service/memory/accuracy.py) must fit too.
    accuracy, accuracy_source = accuracy_margin(spec)
    peak = dev.total + (0 if on_gpu else host.total)
    accuracy_bytes = math.ceil(peak * accuracy)
    need = dev.total + (0 if on_gpu else host.total + runtime) + accuracy_bytes
    fits = need <= usable
    if not on_gpu:
        assumptions.append("CPU worker: device and host are the same RAM; capacity is the host budget "
                           f"(or {DEFAULT_HOST_BYTES // 2**30} GiB), plus ~{CPU_RUNTIME_BYTES // MiB} MiB process runtime")
    assumptions.append(f"fits when the predicted peak ≤ capacity × (1 − {safety_margin:.2f})")
    if accuracy_bytes:
        assumptions.append(f"plus the planner's measured under-prediction for this strategy, {accuracy:.2%} of the "
                           f"peak ({accuracy_source})")
    if model_shape is not shape:  # tensor: the bytes are one rank's, the counts the whole model's
        shape, Pt, N = model_shape, trainable_parameters(spec, model_shape), N * tp
        P = shape.parameter_count() + (Pt if not full else 0)
        assumptions += assumptions_tp
    result = Plan(
        fits=fits, parameter_count=P, trainable_parameter_count=Pt, world_size=N, gpu=g.name if g else None,
        capacity_bytes=capacity, usable_bytes=usable, safety_margin=safety_margin,
        # on CPU workers offloaded state shares the RAM with the "device" and is added
        peak_bytes=dev.total + (0 if on_gpu else host.total), peak_phase=peak_phase,
        per_rank=PerRank(device=dev, host=host), phases=phases, runtime_bytes=runtime, model_states=state,
        activations_saved_bytes=A, assumptions=assumptions, margin_bytes=usable - need, need_bytes=need,
        memory_policy=t.memory_policy, accuracy_margin=accuracy, accuracy_margin_bytes=accuracy_bytes,
        accuracy_source=accuracy_source,
    )
    result.host_memory = host_memory.host_plan(
        spec, result, base_params=shape.parameter_count(), trainable=Pt if not full else 0,
        largest_numel=max(shape.parameter_numels(), default=0), runtime_bytes=CPU_RUNTIME_BYTES,
        nodes=nodes, safety_margin=safety_margin)
    if result.host_memory.fits is False:
        result.fits = False
    return result


def _trainable_numels(spec: JobSpec, shape: ModelShape, targets: set[str] | None) -> list[int]:
    """The trainable tensors' sizes in the order the optimizer gets them (``model.parameters()``)."""
    peft = spec.training.peft
    if peft.method == PeftMethod.none:
        return shape.parameter_numels()
    if peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        return shape.prompt_numels(peft.method.value, peft.num_virtual_tokens)
    feedforward = feedforward_targets(shape.family, peft.target_modules) if peft.method == PeftMethod.ia3 else []
    return shape.adapter_numels(peft.method.value, peft.r, targets or set(), feedforward)


def zero2_gradient_buffer_elements(numels: list[int], world: int) -> int:
    """ZeRO-2's gradient buffer on its fullest rank.

    DeepSpeed flattens the trainable tensors in order, pads the total to a multiple of 2·world and cuts
    it into equal partitions; each rank then allocates room for the *whole* of every tensor that
    overlaps its partition (``copy_grads_in_partition``), so a rank whose partition ends inside a
    tensor holds that tensor's full gradient (measured: up to 1.8% of the gradients at hidden 256).
    """
    alignment = 2 * world
    total = sum(numels)
    part = -(-total // alignment) * alignment // world
    fullest = 0
    for rank in range(world):
        lo, hi = rank * part, (rank + 1) * part
        held, start = 0, 0
        for n in numels:
            if start < hi and start + n > lo:
                held += n
            start += n
        fullest = max(fullest, held)
    return fullest


def _largest_trainable(spec: JobSpec, shape: ModelShape, targets: set[str] | None) -> int:
    """The largest unit the optimizer updates at once: a whole module's parameters for a full fine-tune
    (torch's for-each AdamW works tensor by tensor within it), else the largest adapter tensor."""
    if targets is None:
        return shape.largest_layer_params()
    return max(_trainable_numels(spec, shape, targets), default=1)


# --- suggestions ---------------------------------------------------------------------------------


@dataclass
class Change:
    """A change the planner tried: its name, what it does, its cost, the changed spec and its plan."""

    change: str
    description: str
    cost: int  # lower is cheaper: speed or quality given up
    plan: Plan
    spec: JobSpec


def _patched(spec: JobSpec, patch: dict[str, Any]) -> JobSpec:
    body = spec.model_dump(mode="json", exclude_unset=False)
    for dotted, value in patch.items():
        node = body
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return JobSpec.model_validate(body)


def _candidates(spec: JobSpec, gpu: str | None) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(name, description, cost, patch) for each single change worth trying."""
    t = spec.training
    on_gpu = bool(gpu or t.resources.gpu_type)
    out: list[tuple[str, str, int, dict[str, Any]]] = []
    if t.precision == Precision.fp32 and (not on_gpu or get_gpu(gpu or t.resources.gpu_type).bf16):
        out.append(("bf16", "train in bf16 mixed precision", 1, {"training.precision": "bf16"}))
    if not t.gradient_checkpointing:
        out.append(("gradient_checkpointing", "recompute activations in backward (~+30% compute)", 2,
                    {"training.gradient_checkpointing": True}))
    mb = t.hyperparameters.micro_batch_size
    r = spec.resolved()
    k = 2
    while mb // k >= 1 and k <= 64:
        new_mb = mb // k
        if mb % k == 0:
            patch: dict[str, Any] = {"training.hyperparameters.micro_batch_size": new_mb,
                                     "training.hyperparameters.gradient_accumulation_steps": r.gradient_accumulation_steps * k}
            if spec.openai_hyperparameters.batch_size != "auto":
                patch.pop("training.hyperparameters.gradient_accumulation_steps")
            out.append((f"micro_batch_{new_mb}", f"micro-batch {new_mb} with {r.gradient_accumulation_steps * k}× "
                        f"accumulation (global batch {r.global_batch_size} kept)", 2 + k // 2, patch))
        k *= 2
    if t.peft.method == PeftMethod.none and not t.qat.enabled:
        out.append(("lora", "train a LoRA adapter (r=16) instead of every weight", 4,
                    {"training.peft.method": "lora", "training.peft.r": 16}))
    n = t.resources.num_workers
    if t.strategy == StrategyName.ddp and n > 1 and not t.qat.enabled:
        out.append(("fsdp", "shard parameters, gradients and optimizer states with FSDP2", 3,
                    {"training.strategy": "fsdp"}))
        out.append(("zero3", "DeepSpeed ZeRO-3: shard parameters, gradients and optimizer states", 3,
                    {"training.strategy": "deepspeed", "training.deepspeed.zero_stage": 3}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.zero_stage < 3 and n > 1:
        out.append(("zero3", "DeepSpeed ZeRO-3", 3, {"training.deepspeed.zero_stage": 3}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_optimizer == "none" and t.deepspeed.zero_stage >= 1:
        out.append(("offload_optimizer", "offload optimizer states to host memory (slower steps)", 5,
                    {"training.deepspeed.offload_optimizer": "cpu"}))
    if t.strategy in (StrategyName.ddp,) and not t.qat.enabled:
        out.append(("zero3_offload", "DeepSpeed ZeRO-3 with optimizer and parameters offloaded to host memory", 6,
                    {"training.strategy": "deepspeed", "training.deepspeed.zero_stage": 3,
                     "training.deepspeed.offload_optimizer": "cpu", "training.deepspeed.offload_param": "cpu"}))
    if t.strategy == StrategyName.fsdp and not t.fsdp.cpu_offload:
        out.append(("fsdp_offload", "FSDP2 with CPU offload of the shards", 6, {"training.fsdp.cpu_offload": True}))
    # Host memory short (service/memory/host.py): bring offloaded state back to the GPU where it fits there.
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_param == "cpu":
        out.append(("no_offload_param", "keep the parameters on the GPU (less host memory)", 3,
                    {"training.deepspeed.offload_param": "none"}))
    if t.strategy == StrategyName.deepspeed and t.deepspeed.offload_optimizer == "cpu":
        out.append(("no_offload", "keep parameters and optimizer states on the GPU (less host memory)", 4,
                    {"training.deepspeed.offload_param": "none", "training.deepspeed.offload_optimizer": "none"}))
    if t.strategy == StrategyName.fsdp and t.fsdp.cpu_offload:
        out.append(("no_fsdp_offload", "keep the FSDP2 shards on the GPU (less host memory)", 4,
                    {"training.fsdp.cpu_offload": False}))
    if t.strategy in (StrategyName.fsdp, StrategyName.deepspeed) or n > 1:
        for extra in (2, 4):
            out.append((f"workers_{n * extra}", f"{n * extra} workers (more shards per rank)", 4 + extra,
                        {"training.resources.num_workers": n * extra}))
    elif t.strategy == StrategyName.ddp:
        out.append(("fsdp_2", "FSDP2 over 2 workers", 5, {"training.strategy": "fsdp", "training.resources.num_workers": 2}))
    return out


def _split_sizes(workers: int) -> list[int]:
    """The group sizes a model split over ``workers`` is offered at: all of them, then their largest
    other divisor (the rest data-parallel replicas)."""
    return [d for d in range(workers, 1, -1) if workers % d == 0][:2]


def _pipeline_candidates(spec: JobSpec, shape: ModelShape) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Pipeline parallelism over the job's workers: stages = num_workers, then its largest other divisor
    (the rest data parallel), where the job could run as a pipeline — a family whose blocks the workers
    split, enough blocks, and none of what the pipeline strategy refuses (fp16, prefix/prompt tuning,
    qlora, a chunked loss, activation offload, QAT). Its plan is the most loaded stage's. 1F1B when each
    micro-batch gives every stage a chunk, else GPipe."""
    t = spec.training
    n = t.resources.num_workers
    if (t.strategy == StrategyName.pipeline or n < 2 or t.precision == Precision.fp16 or t.loss_chunk_tokens
            or t.activation_offload or t.qat.enabled
            or t.peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning, PeftMethod.qlora)):
        return []
    micro = spec.resolved().micro_batch_size
    out = []
    for stages in _split_sizes(n):
        if pipeline_problem(shape.family, shape.num_layers, stages):
            continue
        schedule = "1f1b" if micro >= stages else "gpipe"
        replicas = f", {n // stages} data-parallel replicas" if n // stages > 1 else ""
        out.append((f"pipeline_{stages}", f"pipeline parallel: {stages} stages of the model's blocks ({schedule}{replicas})",
                    5, {"training.strategy": "pipeline", "training.pipeline.stages": stages,
                        "training.pipeline.schedule": schedule}))
    return out


def _tensor_candidates(spec: JobSpec, shape: ModelShape) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Tensor parallelism over the job's workers: size = num_workers, then its largest other divisor (the
    rest FSDP2 replicas), where the model's heads, key/value heads and MLP columns split evenly over that
    many ranks (tensor_problem); what else the tensor strategy refuses (fp16, PEFT other than LoRA, a
    chunked loss, activation offload) the spec rules refuse when the candidate is planned. Its plan is one
    rank's share (tensor_parallel.rank_shape). Dearer than a pipeline: two all-reduces of the hidden
    states per block, forward and backward, where the pipeline sends one per stage boundary."""
    t = spec.training
    n = t.resources.num_workers
    if t.strategy == StrategyName.tensor or n < 2:
        return []
    out = []
    for size in _split_sizes(n):
        if tensor_problem(shape.family, shape.num_heads, shape.num_kv_heads, shape.intermediate, size):
            continue
        replicas = f", {n // size} FSDP2 replicas" if n // size > 1 else ""
        out.append((f"tensor_{size}", f"tensor parallel: every block's heads and MLP columns over {size} ranks{replicas}",
                    6, {"training.strategy": "tensor", "training.tensor_parallel.size": size}))
    return out


def suggest(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, safety_margin: float = 0.10,
            limit: int = 8, seq_length: int | None = None, padded: bool = False, nodes=None) -> list[Change]:
    """Changes that would make ``spec`` fit, cheapest first, each with its predicted peak.

    Single changes first; when none fits alone, cumulative combinations in cost order (e.g. bf16,
    then + checkpointing, then + LoRA), so the list always ends in something that fits if anything does.
    """
    found: list[Change] = []
    singles = []
    for name, desc, cost, patch in [*_candidates(spec, gpu), *_pipeline_candidates(spec, shape),
                                    *_tensor_candidates(spec, shape)]:
        try:
            s2 = _patched(spec, patch)
            if check_rules(s2):  # a change the service would refuse with a 422 is no suggestion
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded, nodes=nodes)
        except Exception:  # noqa: BLE001 - a candidate the spec rules refuse is simply not offered
            continue
        singles.append((name, desc, cost, patch, p))
        if p.fits:
            found.append(Change(name, desc, cost, p, s2))
    # Combinations: add cheap changes one at a time (greedy by cost) on top of each other.
    ordered = sorted(singles, key=lambda x: (x[2], x[4].peak_bytes))
    combo_patch: dict[str, Any] = {}
    names: list[str] = []
    cost_sum = 0
    for name, desc, cost, patch, _ in ordered:
        if any(name.startswith(p) for p in ("micro_batch_", "workers_")) and any(
                n.startswith(name.split("_")[0]) for n in names):
            continue
        if "training.strategy" in patch and "training.strategy" in combo_patch:
            continue  # one strategy: a second would replace the first, not add to it
        trial = {**combo_patch, **patch}
        try:
            s2 = _patched(spec, trial)
            if check_rules(s2):
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded, nodes=nodes)
        except Exception:  # noqa: BLE001
            continue
        if len(names) >= 1 and p.peak_bytes >= plan(_patched(spec, combo_patch), shape, gpu,
                                                    seq_length=seq_length, padded=padded).peak_bytes:
            continue  # this change does not help on top of the others
        combo_patch, cost_sum = trial, cost_sum + cost
        names.append(name)
        if len(names) > 1 and p.fits:
            found.append(Change("+".join(names), " + ".join(names), cost_sum, p, s2))
            break
    found.sort(key=lambda s: (s.cost, s.plan.peak_bytes))
    unique: list[Change] = []
    seen = set()
    for s in found:
        if s.change not in seen:
            seen.add(s.change)
            unique.append(s)
    return unique[:limit]


def reductions(spec: JobSpec, shape: ModelShape, gpu: str | None = None, *, safety_margin: float = 0.10,
               limit: int = 6, seq_length: int | None = None, padded: bool = False) -> list[Change]:
    """Single changes that lower the predicted peak, lowest peak first (cheapest among equals) — what an
    out-of-memory post-mortem offers when the job's plan had no suggestions. Changes the spec's rules
    refuse are not offered."""
    base = plan(spec, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded)
    out = []
    for name, desc, cost, patch in _candidates(spec, gpu):
        try:
            s2 = _patched(spec, patch)
            if check_rules(s2):
                continue
            p = plan(s2, shape, gpu, safety_margin=safety_margin, seq_length=seq_length, padded=padded)
        except Exception:  # noqa: BLE001 - a change the spec rules refuse is not offered
            continue
        if p.peak_bytes < base.peak_bytes:
            out.append(Change(name, desc, cost, p, s2))
    out.sort(key=lambda x: (x.plan.peak_bytes, x.cost))
    return out[:limit]
