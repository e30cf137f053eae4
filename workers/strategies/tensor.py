"""Tensor parallelism: every decoder block split over ``size`` ranks with DTensor's
``parallelize_module`` — q/k/v/gate/up column-wise (each rank computes its own query and key/value
heads and its share of the MLP's columns), o/down row-wise (each rank multiplies its share of the
input features and the partial outputs are all-reduced). Where the vocabulary divides by ``size``
(``vocab_parallel``) the token embedding and the LM head are split over it too and the loss runs on the
vocabulary-sharded logits under ``loss_parallel`` (``vocab_plan``); otherwise they stay replicated. The
norms (and GPT-2's position embedding) stay replicated: every rank holds them whole and computes them on
the same input, so their gradients agree without a reduction. With ``num_workers = dp × size`` the tensor-parallel model is replicated
``dp`` times and FSDP2 shards each rank's share over the replicas (torchtitan's composition: a 2-D
DeviceMesh ("dp", "tp"), ``parallelize_module`` on the tp sub-mesh, then ``fully_shard`` on dp).

Why the attention needs no change: transformers' Llama-like attention reshapes its projections with
``view(*input_shape, -1, head_dim)`` and hands the attention kernel ``num_key_value_groups`` (heads per
key/value head, the same ratio on every rank), so with ``use_local_output=True`` (plain local tensors
between the parallel layers) each rank runs attention over its own heads.

LoRA is applied first and split with its base layer: on a column-wise layer lora_A (r × in) stays
whole and lora_B is column-wise like the base (so the adapter's output has the base output's local
columns); on a row-wise layer lora_A is row-wise (its partial r-wide outputs all-reduced) and lora_B
whole. Qwen3's q_norm/k_norm (one weight over head_dim, shared by every head) see only the rank's
heads, so their gradients are summed over the tp group.

How a step is computed: the same loss scaling as DDP (workers/steps.py) with the world's label tokens,
which counts each replica's tokens ``size`` times; the gradient of a replica is therefore 1/dp of its
share, and FSDP2's reduce (a mean over dp) or nothing (dp = 1) gives the global batch's gradient.
GPT-2's blocks are transformers' Conv1D ([in, out] weights, x @ W + b), which torch's styles do not
take: ``Conv1DColwise``/``Conv1DRowwise`` shard them on the same features (weight dim 1 and the bias for
column-wise, weight dim 0 for row-wise, its bias replicated). Its c_attn is q, k and v fused in one
[q | k | v] output that the attention splits at ``split_size``: the columns are regrouped before the split
(``fused_qkv_order``) so that rank r's contiguous share is [q_r | k_r | v_r], its own heads', and each
attention's ``split_size`` becomes the rank's width. The regrouped order is what the checkpoints hold (a
job resumes at the tensor-parallel size it ran with); the export restores the model's own order.

Dropout inside the split attention (GPT-2's attn_pdrop, a Llama's attention_dropout): every rank's
generator is in the same state and its heads' tensor has the same shape, so without care rank r's heads
would get exactly the masks of every other rank's heads. ``sync_dropout`` gives the heads a stream of
each rank's own and puts the shared state back before the output projection, so the replicated residual
stream's dropout still draws the same numbers on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial

import torch
import torch.distributed as dist

from service.domain.training import TENSOR_LAYERS, tensor_problem, vocab_parallel
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import step_batches
from workers.peft_setup import language_model
from workers.steps import (
    OOM_ERRORS,
    Progress,
    WorkerEnv,
    accumulate_gradients,
    make_optimizer,
    make_telemetry,
    warmup_cosine,
    write_failure,
)
from workers.strategies.common import (
    autocast_dtype,
    barrier,
    build_model,
    evaluate,
    finish_step,
    load_phase,
    load_report,
    materialize,
    prepare,
    report_result,
    training_regime,
)
from workers.strategies.fsdp import decoder_layers

PARTIAL_GRADS = ("q_norm", "k_norm")  # per-head norms: each rank's gradient covers its own heads only


@dataclasses.dataclass
class TPMesh:
    """dp × tp over the world: rank = dp_index × size + tp_index."""

    size: int
    dp: int
    dp_index: int
    mesh: object  # the 2-D DeviceMesh ("dp", "tp")

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def dp_mesh(self):
        return self.mesh["dp"]


def make_mesh(world: int, rank: int, size: int | None, device: torch.device) -> TPMesh:
    from torch.distributed.device_mesh import init_device_mesh

    size = size or world
    if world % size:
        raise ValueError(f"{world} workers cannot run tensor-parallel groups of {size}")
    mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("dp", "tp"))
    return TPMesh(size, world // size, rank // size, mesh)


def split_dims(cfg) -> tuple[int, int, int]:
    """(attention heads, key/value heads, MLP columns) of a transformers config."""
    heads = cfg.num_attention_heads
    if cfg.model_type == "gpt2":
        return heads, heads, cfg.n_inner or 4 * cfg.n_embd
    return heads, getattr(cfg, "num_key_value_heads", None) or heads, cfg.intermediate_size


def check_split(cfg, size: int) -> None:
    problem = tensor_problem(cfg.model_type, *split_dims(cfg), size)
    if problem:
        raise ValueError(problem)


def _blocks(lm) -> list:
    return list(lm.transformer.h) if lm.config.model_type == "gpt2" else list(lm.model.layers)


def _layers(lm):
    """(block, dotted name under the block, module, "colwise" | "rowwise") of every split layer."""
    table = TENSOR_LAYERS[lm.config.model_type]
    for block in _blocks(lm):
        for name, style in table.items():
            yield block, name, block.get_submodule(name), style


def _conv1d_styles():
    """Column- and row-wise styles for transformers' Conv1D, whose weight is [in, out] (torch's styles
    take nn.Linear's [out, in]): the same features split, the same input and output layouts."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def partition(placements: dict[str, object]):
        def fn(name, module, mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, mesh, [placements[pname]]), requires_grad=param.requires_grad))
        return fn

    class Conv1DColwise(ColwiseParallel):
        def _apply(self, module, device_mesh):
            return distribute_module(
                module, device_mesh, partition({"weight": Shard(1), "bias": Shard(0)}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class Conv1DRowwise(RowwiseParallel):
        def _apply(self, module, device_mesh):
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh, partition({"weight": Shard(0), "bias": Replicate()}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return Conv1DColwise, Conv1DRowwise


def tensor_plan(model) -> dict[str, object]:
    """The ``parallelize_module`` plan of every decoder block, keyed by module path under the model:
    the base layer and the LoRA factor that shares its split (module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers.pytorch_utils import Conv1D

    lm = language_model(model)
    check_split(lm.config, 1)
    conv_col, conv_row = _conv1d_styles()
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, object] = {}
    for _, _, m, style in _layers(lm):
        linear, conv = (ColwiseParallel, conv_col) if style == "colwise" else (RowwiseParallel, conv_row)
        path = names[id(m)]
        base = m.base_layer if hasattr(m, "base_layer") else m
        split = conv if isinstance(base, Conv1D) else linear
        if hasattr(m, "base_layer"):  # a peft LoRA layer: its base and one of its factors (nn.Linear) split
            plan[f"{path}.base_layer"] = split()
            factor = "lora_B" if style == "colwise" else "lora_A"
            for key in getattr(m, factor):
                plan[f"{path}.{factor}.{key}"] = linear()
        else:
            plan[path] = split()
    return plan


def fused_qkv_order(width: int, size: int) -> torch.Tensor:
    """The column order of a fused [q | k | v] output (each ``width`` wide) whose contiguous 1/size
    shares are [q_r | k_r | v_r]: rank r's own heads of each."""
    part = width // size
    return torch.cat([torch.arange(p * width + r * part, p * width + (r + 1) * part)
                      for r in range(size) for p in range(3)])


def _fused_attention(lm) -> list:
    """The attentions whose q, k and v are one fused layer (GPT-2's c_attn)."""
    return [b.attn for b in _blocks(lm)] if lm.config.model_type == "gpt2" else []


@torch.no_grad()
def regroup_fused_qkv(model, size: int) -> None:
    """GPT-2: every c_attn's output columns (the Conv1D weight's dim 1, its bias, a LoRA B's rows) put in
    ``fused_qkv_order``, and the attention's split at the rank's width, before the model is split."""
    lm = language_model(model)
    for attn in _fused_attention(lm):
        order = fused_qkv_order(attn.split_size, size)
        m = attn.c_attn
        base = m.base_layer if hasattr(m, "base_layer") else m
        base.weight.copy_(base.weight[:, order])
        base.bias.copy_(base.bias[order])
        for b in getattr(m, "lora_B", {}).values():
            b.weight.copy_(b.weight[order])
            if b.bias is not None:
                b.bias.copy_(b.bias[order])
        attn.split_size //= size


def restore_order(model, size: int):
    """The inverse of ``regroup_fused_qkv`` for the export: (name, full tensor) -> the tensor in the
    model's own column order. None where nothing was regrouped."""
    lm = language_model(model)
    if not _fused_attention(lm):
        return None
    order = fused_qkv_order(lm.config.n_embd, size)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))

    def restore(name: str, t: torch.Tensor) -> torch.Tensor:
        if ".c_attn." not in name:
            return t
        if ".lora_B." in name or name.endswith("c_attn.bias") or name.endswith("c_attn.base_layer.bias"):
            return t[inverse]
        if name.endswith("c_attn.weight") or name.endswith("c_attn.base_layer.weight"):
            return t[:, inverse]
        return t  # lora_A: its input features are the hidden width, not regrouped

    return restore


def _attention_dropout(cfg) -> float:
    return float(getattr(cfg, "attn_pdrop", None) or getattr(cfg, "attention_dropout", None) or 0.0)


def sync_dropout(lm, tp_rank: int, device: torch.device) -> None:
    """Where the split attention drops out (p > 0): on entering each attention the generator's state is
    kept and the heads get a stream of this rank's own (a seed drawn from the shared stream, plus the tp
    rank); before the row-wise output projection the kept state is put back, so the residual stream's
    dropout after it draws the same numbers on every rank. Under checkpointing the recomputation
    replays the same states (torch.utils.checkpoint restores the generator before it)."""
    if not _attention_dropout(lm.config):
        return
    rng = torch.cuda if device.type == "cuda" else torch
    kept: list = []

    def enter(_module, _args):
        seed = int(torch.randint(0, 2**62, (1,), device=device))  # the same on every rank of the group
        kept.append(rng.get_rng_state())
        rng.manual_seed(seed + tp_rank)

    def leave(_module, _args):
        rng.set_rng_state(kept.pop())

    for block, name, m, style in _layers(lm):
        parent = name.rpartition(".")[0]
        if style == "rowwise" and "attn" in parent:  # the attention's output projection
            block.get_submodule(parent).register_forward_pre_hook(enter)
            m.register_forward_pre_hook(leave)


def splits_vocab(model, size: int) -> bool:
    """Whether the embedding, the LM head and the loss are split over the vocabulary (``vocab_parallel``)."""
    lm = language_model(model)
    return vocab_parallel(lm.get_input_embeddings().num_embeddings, size)


def vocab_plan(model, size: int) -> dict[str, object]:
    """The token embedding and the LM head split over the vocabulary, torchtitan's ``apply_tp``: the
    embedding row-wise (weight Shard(0): each rank looks up the tokens in its rows, zeros elsewhere, and
    the partial outputs are all-reduced into the replicated residual stream), the head column-wise (weight
    Shard(0) too) with its logits left a DTensor sharded on the vocabulary, which cross-entropy reads
    under ``loss_parallel`` without gathering them. GPT-2's position embedding stays replicated. Empty
    where the vocabulary does not divide evenly: both stay whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not splits_vocab(model, size):
        return {}
    lm = language_model(model)
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(lm.get_input_embeddings())]: RowwiseParallel(input_layouts=Replicate()),
            names[id(lm.get_output_embeddings())]: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def loss_context(model, size: int):
    """Where the logits are sharded on the vocabulary, the context cross-entropy and its backward run in
    (torch.distributed.tensor.parallel.loss_parallel: the log-softmax's max and sum of exponentials and the
    target's logit are all-reduced over the group); otherwise none."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if splits_vocab(model, size) else contextlib.nullcontext()


def fused_qkv_transforms(model, size: int) -> dict:
    """For a model built on the meta device: each fused c_attn base weight and bias, read whole from the
    checkpoint, put in ``fused_qkv_order`` before its share is taken (what ``regroup_fused_qkv`` does to
    weights in place). Keyed by the model's names (workers/weights.py load_model_weights)."""
    lm = language_model(model)
    names = {id(t): n for n, t in model.named_parameters()}
    out = {}
    for attn in _fused_attention(lm):
        order = fused_qkv_order(attn.split_size * size, size)  # split_size is already the rank's width
        m = attn.c_attn
        base = m.base_layer if hasattr(m, "base_layer") else m
        out[names[id(base.weight)]] = lambda t, order=order: t[:, order]
        out[names[id(base.bias)]] = lambda t, order=order: t[order]
    return out


def parallelize(model, tp: TPMesh, device: torch.device, amp: bool):
    """The model split over the tp sub-mesh, then (dp > 1) FSDP2 over the dp sub-mesh per decoder
    layer and at the root. Returns the model (the same object). A model built on the meta device stays
    there (workers/strategies/common.py materialize gives each rank its share afterwards); its fresh
    adapter, regrouped here, is kept again for that."""
    from torch.distributed.tensor.parallel import parallelize_module

    from workers.weights import is_meta, snapshot_real

    lm = language_model(model)
    check_split(lm.config, tp.size)
    regroup_fused_qkv(model, tp.size)
    if any(is_meta(p) for p in model.parameters()):
        if hasattr(model, "_memfit_snapshot"):
            model._memfit_snapshot = snapshot_real(model)  # the adapter's lora_B rows regrouped with the base
    else:
        model = model.to(device)
    head = lm.get_output_embeddings()
    tied = head is not None and head.weight is lm.get_input_embeddings().weight
    parallelize_module(model, tp.tp_mesh, {**tensor_plan(model), **vocab_plan(model, tp.size)})
    if tied and head.weight is not lm.get_input_embeddings().weight:
        # each style distributed its own copy of the shared weight (both Shard(0) over the vocabulary):
        # one parameter again, whose gradient sums the lookup's and the head's, as the whole model's does
        head.weight = lm.get_input_embeddings().weight
    sync_dropout(lm, tp.tp_mesh.get_local_rank(), device)
    if tp.dp > 1:
        from torch.distributed.fsdp import fully_shard

        # reshard_after_forward=True on the root too (fully_shard's default keeps the root gathered after
        # forward), as workers/strategies/fsdp.py does and the planner's FSDP2 terms assume
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=tp.dp_mesh, reshard_after_forward=True)
        fully_shard(model, mesh=tp.dp_mesh, reshard_after_forward=True)
    return model


# --- the step's gradient reductions, norm and clipping ---------------------------------------------


def reduce_partial_grads(model, tp: TPMesh) -> None:
    """Sum over the tp group the gradients each rank computed from its own heads only (Qwen3's q/k norms)."""
    group = tp.tp_mesh.get_group()
    for n, p in model.named_parameters():
        if p.grad is not None and n.rsplit(".", 2)[-2] in PARTIAL_GRADS:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=group)


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients: a DTensor's local squares summed over the process group of
    every mesh dimension it is sharded on, a replicated gradient's counted once. Squares are bucketed
    by those groups' ranks (the same keys, in the same order, on every rank: mesh objects are not)."""
    buckets: dict[tuple, torch.Tensor] = {}
    groups: dict[tuple, list] = {}
    for p in params:
        g = p.grad
        if hasattr(g, "to_local"):
            # FSDP2 over a tp-sharded dim places _StridedShard, whose is_shard() is False: "not replicated"
            pgs = [g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate()]
            key = tuple(tuple(dist.get_process_group_ranks(pg)) for pg in pgs)
            groups[key] = pgs
            local = g.to_local()
        else:
            key, local = (), g
        sq = torch.linalg.vector_norm(local.float()).double() ** 2
        buckets[key] = buckets.get(key, torch.zeros((), dtype=torch.float64, device=local.device)) + sq
    total = torch.zeros((), dtype=torch.float64)
    for key in sorted(buckets):
        sq = buckets[key]
        for pg in groups.get(key, []):
            dist.all_reduce(sq, group=pg)
        total = total + sq.cpu()
    return total.sqrt().float()


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float | None) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm(params)
    if max_grad_norm:
        coef = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in params:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


# --- the loop -----------------------------------------------------------------------------------------


def train_tensor(args: TrainArgs, env: WorkerEnv) -> dict:
    if args.precision == "fp16":  # the spec refuses it: GradScaler's inf checks would have to span the group
        raise ValueError("training.strategy 'tensor' runs in fp32 or bf16")
    tp = make_mesh(env.world_size, env.rank, args.tensor_parallel_size, env.device)
    s = prepare(args, env, data_parallel=(tp.dp, tp.dp_index))
    amp_dtype = autocast_dtype(training_regime(args))
    meter = load_phase(env)
    with meter.measure("load", 0) as info:
        # Read whole, in its dtype and straight into place (workers/weights.py), then split. Splitting a model built
        # on the meta device and reading only each rank's slices (what parallelize and materialize support, and what
        # loads exactly: fused_qkv_transforms included) drifted from DDP's losses in training
        # (tests/test_tensor_parallel.py's LoRA, resume and export tests; not understood yet): not used until it is.
        model = build_model(args, s.model_dir)
        model = parallelize(model, tp, env.device, amp_dtype is not None)
        materialize(model, s.model_dir, env.device, transforms=fused_qkv_transforms(model, tp.size))
        load_report(info, model)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [],
                        phases=meter)
    # A replica's ranks read the same rows: evaluation strides over the replicas, not the world.
    replica_env = dataclasses.replace(env, rank=tp.dp_index, world_size=tp.dp)
    start = 0
    with env.latest_checkpoint() as d:
        if d is not None:
            meta = ckpt.load_torch_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
            start = meta["step"]
            progress.resumed(start, meta.get("trained_tokens", 0))

    def save_state(d: str, step: int) -> None:  # DTensor shards through torch.distributed.checkpoint
        ckpt.save_sharded_state(d, model, optimizer, scheduler, rank=env.rank, trainable_only=args.is_peft)
        ckpt.save_rng(d, env.rank)
        ckpt.write_meta(d, step, "tensor", progress.trained_tokens, env.rank)

    tel = make_telemetry(args, env, model, optimizer, "tensor", {"optimizer": "none", "param": "none"})
    model.train()
    for step in range(start + 1, s.total_steps + 1):
        batches = step_batches(s.train, s.sampler, step - 1, tp.dp_index)
        where = {"phase": "forward"}
        t0 = time.perf_counter()
        try:
            tel.begin_step(step)
            with loss_context(model, tp.size):  # the forward's cross-entropy and the backward through it
                loss, _, input_tokens = accumulate_gradients(
                    model, batches, device=env.device, world_size=env.world_size, amp_dtype=amp_dtype, tel=tel,
                    where=where)
            where["phase"] = "optimizer"
            reduce_partial_grads(model, tp)
            lr = optimizer.param_groups[0]["lr"]
            grad_norm_ = clip_and_step(model, optimizer, scheduler, args.max_grad_norm)
            tel.mark("optimizer")
        except OOM_ERRORS as exc:
            write_failure(args, env, exc, step, where["phase"], tel)
            raise
        step_time_s = time.perf_counter() - t0
        memory = tel.end_step(step)
        # a replica's input tokens once (its first tp rank), so the job's trained_tokens sum is the data's
        finish_step(progress, step, loss=loss, lr=lr, grad_norm=grad_norm_, step_time_s=step_time_s,
                    input_tokens=input_tokens if env.rank % tp.size == 0 else 0, memory=memory,
                    save_state=lambda d, step=step: save_state(d, step),
                    eval_fn=lambda: evaluate_split(model, s.val, args, replica_env, amp_dtype, tp.size))
    with meter.measure("export", s.total_steps):
        artifacts = export_tensor(args, env, model, s.model_dir, s.tokenizer, tp.size)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts


def evaluate_split(model, val, args: TrainArgs, env: WorkerEnv, amp_dtype, size: int) -> float | None:
    with loss_context(model, size):
        return evaluate(model, val, args, env, amp_dtype)


def adapter_state(model, rank: int) -> dict[str, torch.Tensor]:
    """The trained (adapter) tensors on rank 0 (on CPU), each sharded one gathered in turn: a
    collective, every rank walks the same names in the same order."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name not in trainable:
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if rank == 0:
            out[name] = full.detach().cpu().clone()
    return out


def export_tensor(args: TrainArgs, env: WorkerEnv, model, model_dir: str, tokenizer, tp_size: int) -> dict:
    """One ordinary Hugging Face folder, as FSDP2 writes it: the small adapter gathered whole and exported
    (and merged) by rank 0 from the rebuilt base; a full fine-tune gathered one tensor at a time and
    streamed to safetensors files by rank 0 (checkpoint.export_model_streamed), never the whole model;
    GPT-2's regrouped c_attn put back in its own order (``restore_order``)."""
    restore = restore_order(model, tp_size)
    if args.is_peft:
        state = adapter_state(model, env.rank)
        if restore:
            state = {name: restore(name, t) for name, t in state.items()}
        return ckpt.export_artifacts(args, state, model_dir, tokenizer) if env.rank == 0 else {}
    return ckpt.export_model_streamed(args, model, model_dir, tokenizer, env.rank, restore=restore)
