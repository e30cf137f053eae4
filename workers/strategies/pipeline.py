"""Pipeline parallelism: the model's decoder blocks split into ``stages`` consecutive stages, one per
worker, run by ``torch.distributed.pipelining`` (GPipe, 1F1B, or interleaved 1F1B, where each worker
holds ``virtual_stages`` non-adjacent model stages: RankStages); with ``num_workers = dp × stages``
the same pipeline is replicated ``dp`` times over a 2-D mesh (rank = dp index × stages + stage).

How one optimizer step is computed (the same update as DDP over the same global batch, see
workers/steps.py): each of the step's ``accumulation`` micro-batches is one schedule run, which
splits its rows into ``pipeline.microbatches`` chunks; the last stage's loss function returns each
chunk's summed token loss × 1/T, with T the label tokens of the whole step across the data-parallel
replicas, and the schedule's own 1/n_microbatches scaling is off. Gradients then need three
reductions DDP does not: a weight that the embedding and the LM head share (GPT-2, Qwen2) lives on
the first and the last stage, so its two gradients are summed between them; the dp replicas of a
stage sum theirs; and the clipping norm is the square root of the sum over stages of each stage's
squared norm.

Every row of a step is padded to one fixed width, the longest training row (the stage's receive
buffers are sized from the first chunk and reused; a causal mask without the padding mask gives the
real tokens the same attention, since right padding only follows them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from service.domain.training import pipeline_problem, stage_layers
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import TokenizedData, eval_batches, step_batches
from workers.peft_setup import language_model
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    autocast,
    label_tokens,
    make_optimizer,
    make_telemetry,
    token_loss_sum,
    warmup_cosine,
    write_failure,
)
from workers.strategies.common import (
    autocast_dtype,
    barrier,
    build_model,
    finish_step,
    load_phase,
    load_report,
    materialize,
    prepare,
    report_result,
    training_regime,
)
from workers.weights import tied_aliases, tied_duplicates

STAGE_DIR = "pipeline"


# --- the stage module ---------------------------------------------------------------------------


class PipelineStageModule(torch.nn.Module):
    """Stage ``index`` of ``stages``: (embeddings) → its decoder blocks → (final norm, LM head).
    Input: token ids on the first stage, the residual stream (rows × width × hidden) elsewhere;
    output: the residual stream, or the logits on the last stage. ``owned`` are the full model's
    module names this stage holds (its checkpoint and export keys start with them)."""

    def __init__(self, model, index: int, stages: int, amp_dtype=None):
        super().__init__()
        lm = language_model(model)
        family = lm.config.model_type
        problem = pipeline_problem(family, lm.config.num_hidden_layers, stages)  # the planner's rule, for models it could not read
        if problem:
            raise ValueError(problem)
        self.config, self.family, self.amp_dtype = lm.config, family, amp_dtype
        self.index, self.stages = index, stages
        self.first, self.last = index == 0, index == stages - 1
        names = {id(m): n for n, m in model.named_modules()}
        body = lm.transformer if family == "gpt2" else lm.model
        blocks = body.h if family == "gpt2" else body.layers
        self.block_ids = stage_layers(len(blocks), stages)[index]
        self.blocks = torch.nn.ModuleList(blocks[i] for i in self.block_ids)
        owned = list(self.blocks)
        if family == "gpt2":
            self.wte, self.wpe, self.drop = (body.wte, body.wpe, body.drop) if self.first else (None, None, None)
            self.norm = body.ln_f if self.last else None
            owned += [m for m in (self.wte, self.wpe) if m is not None]
        else:
            self.embed = body.embed_tokens if self.first else None
            self.rotary = body.rotary_emb
            self.norm = body.norm if self.last else None
            owned += [m for m in (self.embed, self.rotary if self.first else None) if m is not None]
        self.head = lm.lm_head if self.last else None
        owned += [m for m in (self.norm, self.head) if m is not None]
        self.owned = tuple(names[id(m)] for m in owned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        with autocast(x.device, self.amp_dtype):
            if self.family == "gpt2":
                return self._gpt2(x, create_causal_mask)
            h = self.embed(x) if self.first else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                      position_ids=pos)
            rope = self.rotary(h, position_ids=pos)
            for block in self.blocks:
                h = block(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            return self.head(self.norm(h)) if self.last else h

    def _gpt2(self, x: torch.Tensor, create_causal_mask) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            h = self.drop(self.wte(x) + self.wpe(pos))
        else:
            h = x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=pos)
        for block in self.blocks:
            h = block(h, None, mask, position_ids=pos)
        return self.head(self.norm(h)) if self.last else h


class RankStages(torch.nn.Module):
    """interleaved_1f1b: the model stages one rank holds (rank r of ``stages`` ranks: model stages r,
    r + stages, …), each a PipelineStageModule the schedule runs on its own; seen from the loop, the
    checkpoints and the export as one stage whose ``owned`` modules are all of theirs."""

    def __init__(self, parts: list[PipelineStageModule]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.config, self.family = parts[0].config, parts[0].family
        self.first, self.last = parts[0].first, parts[-1].last
        self.block_ids = [i for p in parts for i in p.block_ids]
        self.owned = tuple(o for p in parts for o in p.owned)


def split_model(model, index: int, stages: int, amp_dtype=None, local: int = 1) -> PipelineStageModule | RankStages:
    """This rank's stage (``local`` > 1: its ``local`` model stages of ``stages × local``, as RankStages).
    The modules of the other stages are replaced in ``model`` by empty ones so their weights are freed;
    ``model`` keeps naming what this stage holds (checkpoints, export)."""
    lm = language_model(model)
    tied = _tied(lm)
    if local > 1:
        stage = RankStages([PipelineStageModule(model, index + k * stages, stages * local, amp_dtype)
                            for k in range(local)])
    else:
        stage = PipelineStageModule(model, index, stages, amp_dtype)
    body = lm.transformer if stage.family == "gpt2" else lm.model
    blocks = body.h if stage.family == "gpt2" else body.layers
    for i in range(len(blocks)):
        if i not in stage.block_ids:
            blocks[i] = torch.nn.Identity()
    if not stage.first:
        for name in ("wte", "wpe") if stage.family == "gpt2" else ("embed_tokens",):
            setattr(body, name, torch.nn.Identity())
    if not stage.last:
        setattr(body, "ln_f" if stage.family == "gpt2" else "norm", torch.nn.Identity())
        lm.lm_head = torch.nn.Identity()
    # A weight the embedding and the LM head share sits on both ends; its gradients are summed there.
    ends = tied and (stage.first or stage.last)
    stage.tied = [stage_weight(stage)] if ends and stage_weight(stage).requires_grad else []
    return stage


def stage_weight(stage: PipelineStageModule | RankStages) -> torch.nn.Parameter:
    """The embedding (first stage) or LM head (last stage) weight."""
    if isinstance(stage, RankStages):
        return stage_weight(stage.parts[0] if stage.first else stage.parts[-1])
    if stage.first:
        return (stage.wte if stage.family == "gpt2" else stage.embed).weight
    return stage.head.weight


def _tied(lm) -> bool:
    out = lm.get_output_embeddings()
    return out is not None and out.weight is lm.get_input_embeddings().weight


def stage_state(model, stage: PipelineStageModule, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The stage's part of the full model's state dict, under the full model's names."""
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()
            if k.startswith(tuple(f"{o}." for o in stage.owned)) and (not trainable_only or k in trainable)}


# --- the mesh -----------------------------------------------------------------------------------


class Mesh:
    """dp × pp over the world: rank = dp_index × stages + stage. Groups are made by every rank in
    the same order (``new_group`` is a collective over the world)."""

    def __init__(self, world: int, rank: int, stages: int):
        if world % stages:
            raise ValueError(f"{world} workers cannot run {stages} pipeline stages evenly")
        self.stages, self.dp = stages, world // stages
        self.dp_index, self.stage = divmod(rank, stages)
        self.pp_group = self.dp_group = self.tied_group = None
        for d in range(self.dp):
            ranks = list(range(d * stages, (d + 1) * stages))
            g, t = dist.new_group(ranks), dist.new_group([ranks[0], ranks[-1]])
            if d == self.dp_index:
                self.pp_group, self.tied_group = g, t
        for s in range(stages):
            g = dist.new_group([d * stages + s for d in range(self.dp)])
            if s == self.stage:
                self.dp_group = g


# --- one optimizer step -------------------------------------------------------------------------


def _fixed_width(batch: dict, width: int, pad_id: int) -> dict:
    n = width - batch["input_ids"].shape[1]
    if n <= 0:
        return batch
    pad = torch.nn.functional.pad
    return {"input_ids": pad(batch["input_ids"], (0, n), value=pad_id),
            "attention_mask": pad(batch["attention_mask"], (0, n), value=0),
            "labels": pad(batch["labels"], (0, n), value=-100)}


def _sum_over(group, t: torch.Tensor) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def clip_grad_norm(stage: PipelineStageModule, mesh: Mesh, max_norm: float | None, tied: list,
                   device: torch.device) -> torch.Tensor:
    """The global gradient norm over every stage (a tied weight counted once, on the first stage),
    and every stage's gradients scaled by the same clip factor. torch's own norm and clip, per tensor:
    no fp64 or squared copy of a gradient (an embedding's would be the step's largest temporary).
    Every tensor a collective reduces is on ``device``, the process group's (NCCL refuses host tensors)."""
    params = [p for p in stage.parameters() if p.grad is not None]
    tied_ids = {id(p) for p in tied} if stage.last and not stage.first else set()
    own = [p.grad for p in params if id(p) not in tied_ids]
    local = torch.nn.utils.get_total_norm(own) if own else torch.zeros((), device=device)
    norm = _sum_over(mesh.pp_group, local.double().pow(2)).sqrt().float()
    if max_norm and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# --- the loop -----------------------------------------------------------------------------------


@dataclass
class Pipeline:
    """A stage and its schedule; ``loss_scale`` is 1/T of the running step, read by the loss function."""

    stage: PipelineStageModule
    mesh: Mesh
    schedule: object
    loss_scale: list[float]


def make_pipeline(stage: PipelineStageModule, mesh: Mesh, schedule: str, chunks: int, device: torch.device) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    loss_scale = [1.0]

    def chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) * loss_scale[0]

    if isinstance(stage, RankStages):  # interleaved_1f1b: one PipelineStage per model stage this rank holds
        pipes = [PipelineStage(p, p.index, p.stages, device, group=mesh.pp_group) for p in stage.parts]
        return Pipeline(stage, mesh, ScheduleInterleaved1F1B(pipes, chunks, loss_fn=chunk_loss, scale_grads=False),
                        loss_scale)
    pipe = PipelineStage(stage, mesh.stage, mesh.stages, device, group=mesh.pp_group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    # scale_grads=False: the loss carries the whole step's 1/T already (not 1/n_microbatches per run)
    return Pipeline(stage, mesh, cls(pipe, chunks, loss_fn=chunk_loss, scale_grads=False), loss_scale)


def recv_buffers(pp: Pipeline) -> list[torch.Tensor]:
    """The receive buffers of this rank's pipeline stages: torch.distributed.pipelining allocates one per chunk
    for each activation a stage after the first receives and each gradient a stage before the last receives
    (stage.py: _create_act_recv_info, _create_grad_recv_info), when the schedule first runs, and keeps them.
    A received activation is that buffer itself (``_retrieve_recv_activations`` hands it to the stage's forward),
    so a chunk in flight keeps no copy of its input; the telemetry counts the buffers as held memory."""
    stages = getattr(pp.schedule, "_stages", None) or [pp.schedule._stage]
    out = []
    for st in stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            out += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return out


def pipeline_step(pp: Pipeline, batches: list[dict], optimizer, scheduler, max_grad_norm: float | None, device,
                  tel=None, where: dict | None = None) -> tuple[float | None, float, torch.Tensor]:
    """One optimizer step over ``batches`` (this replica's micro-batches, fixed width): a schedule run
    per micro-batch, the three gradient reductions of the module docstring, clip, step. Returns
    (mean loss over the global batch, the learning rate used, the gradient norm). A collective."""
    stage, mesh = pp.stage, pp.mesh
    where = where if where is not None else {}
    # Every tensor reduced here is on ``device``: the process group's (NCCL's is the GPU, and refuses host tensors).
    if tel is not None:
        tel.note_batches(batches)
    global_tokens = float(_sum_over(mesh.dp_group, torch.tensor(
        float(sum(label_tokens(b) for b in batches)), dtype=torch.float64, device=device)))
    pp.loss_scale[0] = 1.0 / max(global_tokens, 1.0)
    losses: list[torch.Tensor] = []  # the last stage's chunk losses (× 1/T) of the whole step
    for b in batches:
        ids, run = b["input_ids"].to(device), []  # step() empties the list it is given
        if stage.first:
            pp.schedule.step(ids, target=b["labels"], losses=run, return_outputs=False) if stage.last \
                else pp.schedule.step(ids, return_outputs=False)
        elif stage.last:  # return_outputs=False: the schedule would keep every chunk's logits to merge them
            pp.schedule.step(target=b["labels"], losses=run, return_outputs=False)
        else:
            pp.schedule.step(return_outputs=False)
        losses += run
    if tel is not None:
        tel.mark("backward")
    where["phase"] = "optimizer"
    for p in stage.tied:  # the embedding's and the LM head's gradients of one shared weight
        _sum_over(mesh.tied_group, p.grad)
    for p in stage.parameters():
        if p.grad is not None:
            _sum_over(mesh.dp_group, p.grad)
    grad_norm = clip_grad_norm(stage, mesh, max_grad_norm, stage.tied, device)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if tel is not None:
        tel.mark("optimizer")
    # The step's loss: the last stages' chunk losses (× 1/T) summed over the replicas, once over the
    # world (every other rank adds 0).
    loss_sum = (torch.stack([x.detach().double() for x in losses]).sum() if losses
                else torch.zeros((), dtype=torch.float64, device=device))
    dist.all_reduce(loss_sum)
    return (float(loss_sum) if global_tokens > 0 else None), lr, grad_norm


def train_pipeline(args: TrainArgs, env: WorkerEnv) -> dict:
    if args.precision == "fp16":  # the spec refuses it: GradScaler's inf checks would have to span stages
        raise ValueError("training.strategy 'pipeline' runs in fp32 or bf16")
    mesh = Mesh(env.world_size, env.rank, args.pipeline_stages)
    s = prepare(args, env, data_parallel=(mesh.dp, mesh.dp_index))
    # Built on the meta device; each stage then reads only its own blocks and ends (workers/weights.py). A tied
    # LM head is read under the embedding's name, which the last stage no longer holds.
    meter = load_phase(env)
    with meter.measure("load", 0) as info:
        model = build_model(args, s.model_dir, on_meta=True)
        aliases, tied_names = tied_aliases(model), tied_duplicates(model)
        stage = split_model(model, mesh.stage, mesh.stages, autocast_dtype(training_regime(args)),
                            local=args.pipeline_local_stages)
        materialize(model, s.model_dir, env.device, aliases=aliases)
        stage = stage.to(env.device)
        load_report(info, model)
    stage.tied = [stage_weight(stage)] if stage.tied else []  # the Parameter materialize made, not the meta one
    stage.export_skip = tied_names
    width = max(len(ids) for ids, _ in s.train.examples)
    optimizer = make_optimizer(stage, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [],
                        phases=meter)
    pp = make_pipeline(stage, mesh, args.pipeline_schedule, args.pipeline_microbatches, env.device)

    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = load_stage_state(d, model, stage, optimizer, scheduler, rank=env.rank,
                                    trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:
        save_stage_state(d, model, stage, optimizer, scheduler, mesh, step=step, rank=env.rank,
                         trained_tokens=progress.trained_tokens, trainable_only=args.is_peft)

    tel = make_telemetry(args, env, stage, optimizer, "pipeline", {"optimizer": "none", "param": "none"})
    tel.held_buffers = lambda: recv_buffers(pp)
    stage.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = [_fixed_width(b, width, s.train.pad_id) for b in step_batches(s.train, s.sampler, step - 1, mesh.dp_index)]
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            loss, lr, grad_norm = pipeline_step(pp, batches, optimizer, scheduler, args.max_grad_norm, env.device,
                                                tel, where)
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step)
        input_tokens = sum(int(b["attention_mask"].sum()) for b in batches) if stage.first else 0
        finish_step(progress, step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                    input_tokens=input_tokens, memory=memory,
                    save_state=lambda d, step=step: save_state(d, step),
                    eval_fn=lambda: evaluate_pipeline(stage, s.val, args, env, mesh))
    with meter.measure("export", s.total_steps):
        artifacts = export_pipeline(args, env, model, stage, mesh, s.model_dir, s.tokenizer)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts


@torch.no_grad()
def evaluate_pipeline(stage: PipelineStageModule, val: TokenizedData | None, args: TrainArgs, env: WorkerEnv,
                      mesh: Mesh) -> float | None:
    """Validation loss, forward only: each stage receives the residual stream from the one before,
    runs its blocks and sends the result on; the last stage sums the token losses."""
    if val is None:
        return None
    stage.eval()
    width = max(len(ids) for ids, _ in val.examples)
    ranks = dist.get_process_group_ranks(mesh.pp_group)
    parts = list(stage.parts) if isinstance(stage, RankStages) else [stage]
    loss_sum, tokens = 0.0, 0
    for batch in eval_batches(val, args.micro_batch_size, mesh.dp_index, mesh.dp):
        batch = _fixed_width(batch, width, val.pad_id)
        for part in parts:  # model stage i runs on rank i mod stages: receive from i - 1, send to i + 1
            i = getattr(part, "index", mesh.stage)
            if part.first:
                x = batch["input_ids"].to(env.device)
            else:
                x = torch.empty(batch["input_ids"].shape[0], width, stage.config.hidden_size, device=env.device)
                dist.recv(x, src=ranks[(i - 1) % mesh.stages], group=mesh.pp_group)
            out = part(x)
            if part.last:
                loss_sum += float(token_loss_sum(out, batch["labels"]))
                tokens += label_tokens(batch)
            else:
                dist.send(out.float().contiguous(), dst=ranks[(i + 1) % mesh.stages], group=mesh.pp_group)
    stage.train()
    totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)  # only the last stages add anything
    return float(totals[0]) / max(float(totals[1]), 1.0)


# --- checkpoints and export ---------------------------------------------------------------------


def save_stage_state(d: str, model, stage: PipelineStageModule, optimizer, scheduler, mesh: Mesh, *, step: int,
                     rank: int, trained_tokens: int, trainable_only: bool) -> None:
    """``pipeline/stage-<k>.pt`` per stage, written by its first replica: the stage's weights and its
    optimizer states, both keyed by the full model's parameter names, so a resume under another
    split (more or fewer stages) finds each weight's state by name."""
    from pathlib import Path

    if mesh.dp_index == 0:
        names = _param_names(model, stage)
        osd = optimizer.state_dict()
        per_name = {names[i]: st for i, st in osd["state"].items()}
        group = {k: v for k, v in osd["param_groups"][0].items() if k != "params"}
        out = Path(d, STAGE_DIR)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": stage_state(model, stage, trainable_only), "optimizer": per_name, "group": group},
                   out / f"stage-{mesh.stage}.pt")
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), "stages": mesh.stages}, Path(d, "scheduler.pt"))
    ckpt.save_rng(d, rank)
    ckpt.write_meta(d, step, "pipeline", trained_tokens, rank)


def load_stage_state(d: str, model, stage: PipelineStageModule, optimizer, scheduler, *, rank: int,
                     trainable_only: bool) -> dict:
    """Every stage file is read in turn and this stage keeps the weights and states it owns."""
    from pathlib import Path

    names = _param_names(model, stage)
    index = {n: i for i, n in enumerate(names)}
    mine = set(stage_state(model, stage, trainable_only))
    weights, states, group = {}, {}, None
    for f in sorted(Path(d, STAGE_DIR).glob("stage-*.pt")):
        part = ckpt.safe_load(f)
        weights.update({k: v for k, v in part["model"].items() if k in mine})
        states.update({index[n]: st for n, st in part["optimizer"].items() if n in index})
        group = group or part["group"]
    missing = mine - set(weights)
    if missing:
        raise RuntimeError(f"the pipeline checkpoint lacks weights of this stage: {sorted(missing)[:5]}")
    model.load_state_dict(weights, strict=False)
    osd = optimizer.state_dict()
    osd["state"] = states
    osd["param_groups"] = [{**group, "params": osd["param_groups"][0]["params"]}]
    optimizer.load_state_dict(osd)
    scheduler.load_state_dict(ckpt.safe_load(Path(d, "scheduler.pt"))["scheduler"])
    ckpt.load_rng(d, rank)
    return ckpt.read_meta(d)


def _param_names(model, stage: PipelineStageModule) -> list[str]:
    """The full model's name of each parameter the optimizer holds, in the optimizer's order."""
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n.startswith(tuple(f"{o}." for o in stage.owned)):
            by_id.setdefault(id(p), n)
    return [by_id[id(p)] for p in stage.parameters() if p.requires_grad]


def export_pipeline(args: TrainArgs, env: WorkerEnv, model, stage: PipelineStageModule, mesh: Mesh,
                    model_dir: str, tokenizer) -> dict:
    """One ordinary Hugging Face folder, written by rank 0 (workers/export.py), no rank holding the model.
    PEFT: each stage's adapter tensors (small) gathered to rank 0, which writes the adapter and streams the
    merge from the base's files. A full fine-tune: the first replica's stages send their tensors to rank 0 one
    at a time (on the pipeline group, in the model's order), and rank 0 writes each as it arrives."""
    from workers.export import TensorSpec, checkpoint_dtypes, write_folder

    if args.is_peft:
        mine = stage_state(model, stage, True) if mesh.dp_index == 0 else {}
        parts = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if env.rank != 0:
            return {}
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        return ckpt.export_artifacts(args, state, model_dir, tokenizer)
    if mesh.dp_index != 0:
        return {}
    own = _owned_tensors(model, stage)
    ranks = dist.get_process_group_ranks(mesh.pp_group)
    metas = [(k, name, tuple(t.shape), t.dtype) for k, name, t in own]
    gathered = [None] * mesh.stages if mesh.stage == 0 else None
    dist.gather_object(metas, gathered, dst=ranks[0], group=mesh.pp_group)
    if mesh.stage != 0:
        for _, _, t in own:  # in the order rank 0 receives them: model stage, then the stage's own order
            dist.send(t.detach().contiguous(), dst=ranks[0], group=mesh.pp_group)
        return {}
    entries = sorted((k, i, owner, name, shape, dtype) for owner, ms in enumerate(gathered)
                     for i, (k, name, shape, dtype) in enumerate(ms))
    held = {name: t for _, name, t in own}
    dtypes = checkpoint_dtypes(model_dir)
    specs = [TensorSpec(name, dtypes.get(name, dtype), shape) for _, _, _, name, shape, dtype in entries]

    def tensors():
        for _, _, owner, name, shape, dtype in entries:
            if owner == 0:
                yield name, held[name]
            else:
                buf = torch.empty(shape, dtype=dtype, device=env.device)
                dist.recv(buf, src=ranks[owner], group=mesh.pp_group)
                yield name, buf

    return write_folder(Path(args.output_dir), "model", specs, tensors(), model_dir, tokenizer, dtypes, rank=0)


def _owned_tensors(model, stage) -> list[tuple[int, str, torch.Tensor]]:
    """(model stage index, base name, tensor) of every tensor this rank's stages hold and the export keeps, in
    the model's order; a tied LM head's second name left out (``stage.export_skip``), as save_pretrained does."""
    from workers.weights import checkpoint_name

    parts = list(stage.parts) if isinstance(stage, RankStages) else [stage]
    skip = getattr(stage, "export_skip", set())
    state = model.state_dict(keep_vars=True)
    seen: set[int] = set()
    out = []
    for part in parts:
        prefixes = tuple(f"{o}." for o in part.owned)
        for name, t in state.items():
            if id(t) in seen or not name.startswith(prefixes):
                continue
            seen.add(id(t))
            if checkpoint_name(name) not in skip:
                out.append((part.index, checkpoint_name(name), t))
    return out
