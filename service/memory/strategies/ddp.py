"""DDP (workers/strategies/ddp.py): every rank holds the whole model, its gradients and AdamW's moments.

Communication: DDP's reducer keeps gradient buckets, one more copy of every trainable gradient in the
gradient dtype, allocated when the model is wrapped and kept all along: torch/nn/parallel/distributed.py builds
``dist.Reducer`` in ``_ddp_init_helper`` (the wrap), whose buckets are flat tensors of their parameters' total
size (rebuilt once, in the second step's forward: "It may allocate new buckets before deallocating old buckets");
with ``gradient_as_bucket_view`` off (torch's default, Ray Train's ``prepare_model`` and memfit's) each ``.grad``
is its own tensor and the bucket a separate copy ("the saved memory size [with it on] will be equal to the total
gradients size", the argument's docstring). Planned at every instant of the step, as the telemetry counts it
(workers/strategies/ddp.py: reducer_bucket_bytes). Before 2026-12 the planner put it at the end of backward only
and the telemetry did not see it (it is allocated before any traced window and reachable from no parameter):
jobs over 2 ranks were measured low by the buckets and planned at a backward_end no measured step reached.
"""

from __future__ import annotations

from service.memory.job import PlannedJob
from service.memory.precision import StateBytes
from service.memory.strategies.terms import StrategyTerms, optimizer_unit, replicated


def states(job: PlannedJob, sb: StateBytes, adam_steps: int) -> StrategyTerms:
    terms = StrategyTerms(dev=replicated(job, sb, adam_steps), opt_temp_unit=optimizer_unit(job))
    if job.world > 1 and job.strategy == "ddp":
        terms.held = sb.gradients  # DDP's gradient buckets: a second copy of every trainable gradient, all step
        terms.assumptions.append("DDP keeps gradient buckets (one copy of the trainable gradients, allocated when the "
                                 "model is wrapped and held all step)")
    return terms
