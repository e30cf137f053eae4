"""FSDP2 (workers/strategies/fsdp.py: ``fully_shard`` per decoder block, then the root): every parameter,
gradient and AdamW moment sharded over the data-parallel ranks; each unit gathered in the compute dtype while it
runs; optionally every shard offloaded to host memory (``CPUOffloadPolicy``).

Also the data-parallel half of strategy tensor with more than one replica (service/memory/strategies/tensor.py).
"""

from __future__ import annotations

from service.domain.spec import PeftMethod
from service.domain.training import dtype_bytes, feedforward_targets
from service.memory.job import PlannedJob
from service.memory.nf4 import constants_bytes, packed_bytes, quantised_numels
from service.memory.precision import StateBytes
from service.memory.shape import ModelShape
from service.memory.strategies.terms import StrategyTerms, optimizer_unit


def states(job: PlannedJob, sb: StateBytes, adam_steps: int) -> StrategyTerms:
    t, shape, rg, N, P, Pt = job.t, job.shape, job.regime, job.world, job.parameters, job.trainable
    terms = StrategyTerms(opt_temp_unit=optimizer_unit(job))
    dev = terms.dev
    grad_bytes = dtype_bytes(rg.grad_dtype)
    # FSDP2 shards what trains in the trained weights' dtype and a PEFT base in the frozen one (the regime holds it
    # in 16 bits: service/domain/training.py; QLoRA's packed codes: below)
    dev.parameters = sb.parameters // N
    dev.gradients = sb.gradients // N
    dev.optimizer_states = sb.optimizer // N + adam_steps  # every rank steps a shard of every parameter
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
    adapter_per_layer = 0 if job.full else Pt // max(shape.num_layers, 1)
    layer_unsharded = (shape.layer_params() + adapter_per_layer) * unit_bytes
    if job.qlora:
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
        terms.gathered_layer = 2 * layer_unsharded  # the running block and the prefetched next one
        if t.loss_chunk_tokens:  # a chunked loss runs inside the root's forward, and it is the root's
            terms.loss_gathered = root  # output, whose pre-backward hook re-gathers the root before the chunks' backward
    else:
        terms.gathered = shape.num_layers * layer_unsharded + root
        terms.gathered_layer = terms.gathered
    terms.comm = (shape.layer_params() * grad_bytes) if job.full else 0  # one unit's reduce-scatter input
    if job.full and N > 1:
        terms.root_reduce = root_reduce(shape, grad_bytes, unit_bytes, job.on_gpu)
    if t.fsdp.cpu_offload:
        terms.host.parameters, dev.parameters = dev.parameters, 0
        terms.host.gradients, dev.gradients = dev.gradients, 0
        terms.host.optimizer_states, dev.optimizer_states = dev.optimizer_states, 0
    if job.strategy == "fsdp" and t.fsdp.cpu_offload:
        # the step is torch's AdamW on the host shards (on a GPU worker its temporaries are host memory); the
        # offloaded gradients exist only from each unit's reduce-scatter in backward (foreach_reduce copies the new
        # sharded gradient to the CPU: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) until
        # zero_grad(set_to_none=True), like the gradients of FSDP2 without offload: on a CPU worker (one RAM) they
        # follow the step's instants like device gradients
        terms.offloaded_step = terms.host_step_temporaries = True
        terms.host_grads_per_instant = not job.on_gpu
    terms.assumptions.append("FSDP2: one unit per decoder block plus the root (embeddings, final norm, lm_head)")
    return terms


def root_reduce(shape: ModelShape, reduce_bytes: int, unit_bytes: int, on_gpu: bool) -> int:
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
