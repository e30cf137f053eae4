"""The instants of one optimizer step at which a rank's memory can peak, and what is live at each.

Each candidate instant is (gradients live, activations live, temporaries) on top of the states live all step
(parameters and optimizer states): the loss in forward; the start of backward (the log-softmax plus two
vocabulary-sized gradients); a checkpointed block's recomputation (its backward and its own forward); the end of
backward (every gradient, the strategy's communication buckets); the optimizer step; and the strategy's own
(FSDP2's root reduce-scatter, a pipeline stage's block forward and embedding backward). The peak is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.domain.plan import Breakdown, ModelStates, ModelStatesPerRank
from service.domain.training import local_stages
from service.memory.activations import Activations
from service.memory.job import PlannedJob
from service.memory.strategies.terms import StrategyTerms


@dataclass
class Step:
    view: Any  # the pipeline stage (strategies/pipeline.py: StageView), or None
    activations_saved: int  # what forward keeps, at its end
    state: ModelStatesPerRank  # the model states at their full size
    dev: Breakdown
    host: Breakdown
    cands: dict[str, tuple[int, int, int]]  # instant → (gradients, activations, temporaries) live
    phases: dict[str, int]  # instant → live bytes

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def step(job: PlannedJob, terms: StrategyTerms, view, act: Activations, A: int) -> Step:
    """The instants of a step of the rank (or pipeline stage ``view``) whose forward keeps ``A`` bytes."""
    t = job.t
    dev, host = terms.dev.model_copy(), terms.host.model_copy()
    opt_temp_unit = terms.opt_temp_unit
    if view is not None:
        dev.parameters, dev.gradients, dev.optimizer_states = view.parameters, view.gradients, view.optimizer_states
        opt_temp_unit = view.largest_trainable * 4
    state = ModelStatesPerRank(
        device=ModelStates(parameters=dev.parameters, gradients=dev.gradients, optimizer_states=dev.optimizer_states),
        host=ModelStates(parameters=host.parameters, gradients=host.gradients, optimizer_states=host.optimizer_states))
    dev_state = dev.parameters + dev.optimizer_states  # live on the device all step long
    host_grads = terms.host_grads_per_instant
    host_state = host.parameters + (0 if host_grads else host.gradients) + host.optimizer_states
    shared = 0 if job.on_gpu else host_state  # a CPU worker's "device" is the same RAM as its host
    g_all = host.gradients if host_grads else dev.gradients
    # Gradients live in forward: earlier micro-batches' of the step (accumulation), a buffer the strategy keeps (ZeRO-3), or a
    # 1F1B stage's earlier chunks' (it runs backwards between forwards once its warm-up is done; interleaved: the
    # rank's forwards over all its model stages).
    chunked = view is not None and t.pipeline.schedule in ("1f1b", "interleaved_1f1b") and (
        job.spec.resolved().pipeline_microbatches * local_stages(t.pipeline.schedule, t.pipeline.virtual_stages)
        > view.in_flight)
    accumulated = job.accumulation > 1 and not job.first_micro_batch
    g_fwd = g_all if (accumulated or terms.grads_in_forward or chunked) else 0
    step_temp = terms.master_grad + 2 * opt_temp_unit
    host.temporary = step_temp if (terms.host_step_temporaries and job.on_gpu) else 0
    # workers/activation_offload.py: what the model's forward saves goes to pinned host memory as it is saved and
    # comes back for the backward op that reads it; the loss runs outside those hooks, so its log-softmax stays.
    # Tensors under 1 MiB (per-token statistics) stay too and are not counted.
    offload_act = t.activation_offload and job.on_gpu and view is None
    A_dev = act.loss_saved_bytes if offload_act else A
    host.activations = A - act.loss_saved_bytes if offload_act else 0
    gathered = terms.gathered + terms.loss_gathered
    cands: dict[str, tuple[int, int, int]] = {
        "forward": (g_fwd, A_dev, gathered + act.logits_bytes + act.loss_copy_bytes),
        "backward": (g_fwd, A_dev, gathered + act.loss_grad_bytes),
    }
    if view is not None and view.forward_block:
        cands["forward_block"] = (g_fwd, A_dev, view.forward_block)
    if view is not None and view.embedding_grad and (job.accumulation > 1 or job.spec.resolved().pipeline_microbatches > 1):
        # the first stage's embedding backward after its first chunk's (strategies/pipeline.py): every gradient, the
        # chunks still in flight, the dense gradient and the one it reads
        cands["backward_embedding"] = (g_all, view.embedding_saved, view.embedding_grad)
    if offload_act:  # one block's saved tensors back on the device at a time (or its recomputation)
        cands["backward_layer"] = (g_all, max(act.layer_bytes, default=0),
                                   terms.gathered_layer + act.layer_backward_temp_bytes)
    elif t.gradient_checkpointing:
        recomputing = A - act.loss_saved_bytes + act.recompute_bytes
        cands["backward_recompute"] = (g_all, recomputing, terms.gathered_layer + act.layer_backward_temp_bytes)
        # the recomputation's own forward reaches the MLP's projection (Activations.forward_block_bytes) before the
        # block's backward temporaries exist; torch's non-reentrant checkpoint stops recomputing once the last tensor
        # backward needs is saved (the adapter's lora_A output), so lora_B's output and its scaled copy are not made
        # again, while the gradients backward brought to the block (its output's, the adapter's scaled one) stand
        # where they were, the same two tokens × hidden
        cands["backward_recompute_forward"] = (g_all, recomputing, terms.gathered_layer + act.forward_block_bytes
                                               + (view.held_sends if view is not None else 0))
    cands["backward_end"] = (g_all, 0, terms.gathered_layer + terms.comm + opt_temp_unit // 4)
    cands["optimizer"] = (0 if terms.grads_freed_before_step else g_all, 0,
                          0 if (terms.offloaded_step and job.on_gpu) else step_temp)
    if terms.root_reduce:  # FSDP2's last reduce-scatter, the root's: every gradient shard exists by then
        cands["root_reduce"] = (g_all, 0, terms.root_reduce)
    if view is not None and view.recv_buffers:  # held at every instant, with the step's temporaries
        cands = {k: (g, a, tmp + view.recv_buffers) for k, (g, a, tmp) in cands.items()}
    if terms.held:  # the strategy's kept buffers (DDP's buckets), likewise
        cands = {k: (g, a, tmp + terms.held) for k, (g, a, tmp) in cands.items()}
    phases = {k: dev_state + shared + sum(v) for k, v in cands.items()}
    return Step(view, A, state, dev, host, cands, phases)
