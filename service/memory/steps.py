"""The run, step by step, before it runs: which rows every rank's micro-batches hold at every step, each step's
peak per rank, and the run's peak with its step and rows.

The workers' sampler and the planner share one order (service/domain/sampling.py: StepOrder), so the planner
knows every micro-batch: its rows, their lengths (service/memory/data.py), its padded width (collate pads to the
longest row) and whether it is padded. A step's peak is the largest of its micro-batches' plans (the first of an
accumulated step without the step's gradients in its forward: ``plan(first_micro_batch=True)``); a pipeline pads
every micro-batch to the data's longest row (workers/strategies/pipeline.py: _fixed_width), so its steps are all
alike, stage by stage.

Within one kind of micro-batch (padded or not, first or not) a plan only grows with the width, so the run's
peak is one of at most four plans — each kind's widest micro-batch — and the steps at it are those holding a
micro-batch of that kind at least as wide as the narrowest width that reaches it (found by bisection). A run
longer than ``MAX_POSITIONS`` rows dealt is not enumerated: its plan is the data's worst micro-batch, as
before, and says so.

Which rows a worker rank reads: data-parallel ranks each their own (DDP, FSDP2, DeepSpeed); a tensor-parallel
group's ranks its replica's (rank // size); a pipeline's stages their replica's (rank // stages), each stage
planned as its own (rank % stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.domain.plan import Plan, RankRunPeak, StepPeak, StepsPlan
from service.domain.sampling import StepOrder
from service.domain.spec import JobSpec, auto_epochs, tensor_parallel_size
from service.memory.planner import plan
from service.memory.shape import ModelShape

MAX_POSITIONS = 1_000_000  # rows dealt over the run beyond which the steps are not enumerated (~2 s)


@dataclass(frozen=True)
class Kind:
    """What a micro-batch's plan depends on besides its width."""

    padded: bool
    first: bool  # the first micro-batch of an accumulated step


def live_bytes(p: Plan) -> int:
    """A plan's peak as the telemetry measures it: without the GPU overhead (service/memory/compare.py)."""
    return p.peak_bytes - (p.per_rank.device.overhead if p.gpu else 0)


@dataclass
class StepPlanner:
    """Plans of ``spec``'s micro-batches by (width, kind, stage), each computed once."""

    spec: JobSpec
    shape: ModelShape
    gpu: str | None
    safety_margin: float = 0.10
    nodes: object = None
    longest_row: int | None = None  # the data's longest row: a pipeline's fixed width (when known)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def pipeline(self) -> bool:
        return self.spec.training.strategy.value == "pipeline"

    def replica(self, rank: int) -> tuple[int, int | None]:
        """(the data replica whose rows ``rank`` reads, its pipeline stage or None)."""
        t = self.spec.training
        if self.pipeline:
            replica, stage = divmod(rank, t.pipeline.stages)
            return replica, stage
        if t.strategy.value == "tensor":
            return rank // tensor_parallel_size(t), None
        return rank, None

    def replicas(self) -> int:
        t = self.spec.training
        n = t.resources.num_workers
        if self.pipeline:
            return n // t.pipeline.stages
        return n // tensor_parallel_size(t) if t.strategy.value == "tensor" else n

    def plan_of(self, width: int, kind: Kind, stage: int | None = None) -> Plan:
        first = kind.first and self.spec.resolved().gradient_accumulation_steps > 1
        key = (width, kind.padded, first, stage)
        if key not in self._plans:
            self._plans[key] = plan(self.spec, self.shape, self.gpu, safety_margin=self.safety_margin, seq_length=width,
                                    padded=kind.padded, nodes=self.nodes, stage=stage, first_micro_batch=first)
        return self._plans[key]

    def micro_batch_live(self, tokens: list[int], m: int, stage: int | None = None) -> int:
        """The predicted live peak of a micro-batch of rows of ``tokens``, the ``m``-th of its step."""
        width = max(tokens)
        return live_bytes(self.plan_of(width, Kind(min(tokens) < width, m == 0), stage))

    def step_live(self, micro_batches: list[list[int]], stage: int | None = None) -> int:
        """A step's predicted live peak from its micro-batches' row lengths (as a worker reports them)."""
        return max(self.micro_batch_live(tokens, m, stage) for m, tokens in enumerate(micro_batches))

    def order(self, n_rows: int) -> StepOrder:
        r = self.spec.resolved()
        return StepOrder(n_rows, r.micro_batch_size, r.gradient_accumulation_steps, self.replicas(), r.seed)

    def total_steps(self, n_rows: int, n_examples: int | None = None) -> int:
        oh = self.spec.openai_hyperparameters
        epochs = auto_epochs(n_examples or n_rows) if oh.n_epochs == "auto" else int(oh.n_epochs)
        return self.order(n_rows).total_steps(epochs, self.spec.training.hyperparameters.max_steps)


def _peak_of(sp: StepPlanner, order: StepOrder, rows: list[int], step0: int, rank: int, m: int,
             masked: bool = False) -> StepPeak:
    replica, stage = sp.replica(rank)
    idx = order.micro_batches(step0, replica)[m]
    tokens = [rows[i] for i in idx]
    width, padded = max(tokens), masked or min(tokens) < max(tokens)
    if sp.pipeline:  # every micro-batch padded to the longest row, attention unmasked (see the module docstring)
        width, padded = max(rows), False
    p = sp.plan_of(width, Kind(padded, m == 0 and not sp.pipeline), stage)
    return StepPeak(step=step0 + 1, rank=rank, micro_batch=m, rows=list(idx), row_tokens=tokens, width=width,
                    padded=padded, predicted_peak_bytes=p.peak_bytes, predicted_live_bytes=live_bytes(p))


def predict_run(sp: StepPlanner, rows: list[int], n_examples: int | None = None,
                masked: bool = False) -> tuple[StepsPlan, Plan | None]:
    """(the run's steps plan, the plan of its worst micro-batch, or None where the steps were not enumerated).
    ``rows``: every training row's tokens (service/memory/data.py); ``masked``: every micro-batch runs attention
    with a mask (packed rows of several examples, service/memory/data.py: DataShape.padded)."""
    t = sp.spec.training
    world = t.resources.num_workers
    order = sp.order(len(rows))
    total = sp.total_steps(len(rows), n_examples)
    if total * order.global_batch > MAX_POSITIONS:
        return StepsPlan(planned=False, total_steps=total, ranks=world,
                         reason=f"{total} steps deal {total * order.global_batch:,} rows, more than the "
                                f"{MAX_POSITIONS:,} the planner enumerates: the plan is the data's worst micro-batch"), None
    if sp.pipeline:
        stages = [sp.plan_of(max(rows), Kind(False, False), k) for k in range(t.pipeline.stages)]
        worst = max(range(len(stages)), key=lambda k: live_bytes(stages[k]))
        steady = min(2, total - 1)  # every step alike: name the first steady one (step 3)
        per_rank = [RankRunPeak(rank=r, step=steady + 1, predicted_live_bytes=live_bytes(stages[r % len(stages)]))
                    for r in range(world)]
        return StepsPlan(planned=True, total_steps=total, ranks=world, peak=_peak_of(sp, order, rows, steady, worst, 0),
                         steps_at_peak=total * sum(1 for r in per_rank if r.predicted_live_bytes == per_rank[worst].predicted_live_bytes),
                         per_rank=per_rank,
                         reason="a pipeline pads every micro-batch to the longest row: every step is planned alike, "
                                "each stage its own"), stages[worst]
    # pass 1: per replica and kind, the distinct widths and the first of the widest micro-batches
    widths: dict[tuple[int, Kind], set[int]] = {}
    widest: dict[tuple[int, Kind], tuple[int, int, int]] = {}  # (width, step0, m)
    for step0, replica, m, width, kind in _micro_batches(order, rows, total, masked):
        widths.setdefault((replica, kind), set()).add(width)
        known = widest.get((replica, kind))
        if known is None or width > known[0] or (width == known[0] and known[1] < 2 <= step0):
            widest[replica, kind] = (width, step0, m)  # the first widest, a steady one (step ≥ 3) where there is one
    # each replica's worst: the largest plan of its kinds' widest micro-batches (the earliest step on a tie)
    best: dict[int, tuple[int, tuple[int, int, int], Kind]] = {}
    # (a tie goes to the first steady step, from step 3: the plan is a steady step's, and the first two are not one)
    def rank_key(live: int, step0: int) -> tuple:
        return live, step0 + 1 >= 3, -step0

    for (replica, kind), where in widest.items():
        live = live_bytes(sp.plan_of(where[0], kind))
        if replica not in best or rank_key(live, where[1]) > rank_key(best[replica][0], best[replica][1][1]):
            best[replica] = (live, where, kind)
    peak_replica = max(best, key=lambda r: (*rank_key(best[r][0], best[r][1][1]), -r))
    peak_live, (width, step0, m), kind = best[peak_replica]
    # pass 2: the (step, replica) pairs at the peak, a micro-batch of a kind at least as wide as the narrowest
    # width that reaches it
    reach = {}
    for key, ws in widths.items():
        ordered = sorted(ws)
        i = _first_reaching(sp, ordered, key[1], peak_live)
        if i < len(ordered):
            reach[key] = ordered[i]
    at_peak = {(s, replica) for s, replica, _, w, k in _micro_batches(order, rows, total, masked)
               if (replica, k) in reach and w >= reach[replica, k]}
    per_rank = [RankRunPeak(rank=r, step=best[sp.replica(r)[0]][1][1] + 1,
                            predicted_live_bytes=best[sp.replica(r)[0]][0]) for r in range(world)]
    rank = min(r for r in range(world) if sp.replica(r)[0] == peak_replica)
    peak = _peak_of(sp, order, rows, step0, rank, m, masked)
    ranks_per_replica = world // order.world_size  # tensor parallel: a group's ranks read one replica's rows
    return StepsPlan(planned=True, total_steps=total, ranks=world, peak=peak,
                     steps_at_peak=len(at_peak) * ranks_per_replica, per_rank=per_rank,
                     reason=f"{total} steps × {world} ranks enumerated from the shared order "
                            "(service/domain/sampling.py)"), sp.plan_of(width, kind)


def _micro_batches(order: StepOrder, rows: list[int], total: int, masked: bool):
    """(step0, replica, m, width, kind) of every micro-batch of the run, in order."""
    for step0 in range(total):
        for replica in range(order.world_size):
            for m, idx in enumerate(order.micro_batches(step0, replica)):
                tokens = [rows[i] for i in idx]
                width = max(tokens)
                yield step0, replica, m, width, Kind(masked or min(tokens) < width, m == 0)


def _first_reaching(sp: StepPlanner, widths: list[int], kind: Kind, target: int) -> int:
    """The index of the narrowest width whose plan reaches ``target`` (plans grow with the width), by bisection."""
    lo, hi = 0, len(widths)
    while lo < hi:
        mid = (lo + hi) // 2
        if live_bytes(sp.plan_of(widths[mid], kind)) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
