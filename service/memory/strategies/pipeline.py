"""Pipeline parallelism (workers/strategies/pipeline.py, torch.distributed.pipelining): each rank holds its stage's
blocks whole, with their gradients and AdamW's moments, and the activations of the chunks in flight at the
schedule's peak (service/domain/training.py: in_flight_microbatches, interleaved_in_flight); torch's stage keeps a
receive buffer per chunk and direction, and the schedule holds some sends past their chunk's backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from service.domain.plan import Breakdown
from service.domain.spec import JobSpec
from service.domain.training import (
    dtype_bytes,
    in_flight_microbatches,
    interleaved_in_flight,
    local_stages,
    pipeline_problem,
    stage_layers,
)
from service.memory.activations import Activations, activations
from service.memory.job import PlannedJob
from service.memory.peft import checkpointed_peft, embedding_leaf, method_terms, trainable_numels
from service.memory.precision import ACTIVATION_SIZES, StateBytes
from service.memory.shape import ModelShape
from service.memory.strategies.terms import StrategyTerms, optimizer_unit


def states(job: PlannedJob, sb: StateBytes, adam_steps: int) -> StrategyTerms:
    """Every stage planned (the plan is the fullest's, or the one asked for); the states are each stage's own."""
    t, shape = job.t, job.shape
    problem = pipeline_problem(shape.family, shape.num_layers,
                               t.pipeline.stages * local_stages(t.pipeline.schedule, t.pipeline.virtual_stages))
    if problem:
        from service.domain.errors import SpecInvalid

        raise SpecInvalid([{"param": "training.pipeline.stages", "message": problem, "code": "invalid_value"}])
    terms = StrategyTerms(dev=Breakdown(), opt_temp_unit=optimizer_unit(job))
    terms.stage_views = pipeline_stages(job.spec, shape, job.regime, job.targets, job.trainable, job.micro_batch, job.seq)
    terms.assumptions.append(
        f"pipeline: {t.pipeline.stages} stages × {job.world // t.pipeline.stages} data-parallel "
        f"replica(s), {t.pipeline.schedule}"
        + (f" ({local_stages(t.pipeline.schedule, t.pipeline.virtual_stages)} model stages per rank)"
           if t.pipeline.schedule == "interleaved_1f1b" else "")
        + f", {job.spec.resolved().pipeline_microbatches} chunk(s) per "
        "micro-batch; the fullest stage is shown")
    return terms


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
    adapter_numels = [] if full else trainable_numels(spec, shape, targets)
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
