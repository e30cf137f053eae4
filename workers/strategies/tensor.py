"""Tensor parallelism: every decoder block split over ``size`` ranks with DTensor's
``parallelize_module`` — q/k/v/gate/up column-wise (each rank computes its own query and key/value
heads and its share of the MLP's columns), o/down row-wise (each rank multiplies its share of the
input features and the partial outputs are all-reduced). The embeddings, the norms and the LM head
stay replicated: every rank holds them whole and computes them on the same input, so their gradients
agree without a reduction. With ``num_workers = dp × size`` the tensor-parallel model is replicated
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
GPT-2 is not split: its projections are transformers' Conv1D, which ColwiseParallel/RowwiseParallel
do not partition (service/domain/training.py: TENSOR_FAMILIES).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from service.domain.training import TENSOR_COLWISE, TENSOR_ROWWISE, tensor_problem
from workers import checkpoint as ckpt
from workers.args import TrainArgs
from workers.data import step_batches
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


def tensor_plan(model) -> dict[str, object]:
    """The ``parallelize_module`` plan of every decoder block, keyed by module path under the model:
    the base layer and the LoRA factor that shares its split (module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = lm.config
    problem = tensor_problem(cfg.model_type, cfg.num_attention_heads,
                             getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                             cfg.intermediate_size, 1)
    if problem:
        raise ValueError(problem)
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, object] = {}
    for layer in lm.model.layers:
        for part in (layer.self_attn, layer.mlp):
            for short, style, lora in [*((c, ColwiseParallel, "lora_B") for c in TENSOR_COLWISE),
                                       *((r, RowwiseParallel, "lora_A") for r in TENSOR_ROWWISE)]:
                m = getattr(part, short, None)
                if m is None:
                    continue
                path = names[id(m)]
                if hasattr(m, "base_layer"):  # a peft LoRA layer: its base and one of its factors split
                    plan[f"{path}.base_layer"] = style()
                    for key in getattr(m, lora):
                        plan[f"{path}.{lora}.{key}"] = style()
                else:
                    plan[path] = style()
    return plan


def parallelize(model, tp: TPMesh, device: torch.device, amp: bool):
    """The model split over the tp sub-mesh, then (dp > 1) FSDP2 over the dp sub-mesh per decoder
    layer and at the root. Returns the model (the same object)."""
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    size = tp.size
    problem = tensor_problem(cfg.model_type, cfg.num_attention_heads,
                             getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                             cfg.intermediate_size, size)
    if problem:
        raise ValueError(problem)
    model = model.to(device)
    parallelize_module(model, tp.tp_mesh, tensor_plan(model))
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
    model = build_model(args, s.model_dir)
    amp_dtype = autocast_dtype(training_regime(args))
    model = parallelize(model, tp, env.device, amp_dtype is not None)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, s.total_steps)
    progress = Progress(args, env, s.total_steps, s.sampler.epoch_at, events=s.notices if env.rank == 0 else [])
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
                    eval_fn=lambda: evaluate(model, s.val, args, replica_env, amp_dtype))
    artifacts = export_tensor(args, env, model, s.model_dir, s.tokenizer)
    barrier()
    report_result(args, env, progress, artifacts, s.total_steps)
    return artifacts


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


def export_tensor(args: TrainArgs, env: WorkerEnv, model, model_dir: str, tokenizer) -> dict:
    """One ordinary Hugging Face folder, as FSDP2 writes it: the small adapter gathered whole and exported
    (and merged) by rank 0 from the rebuilt base; a full fine-tune gathered one tensor at a time and
    streamed to safetensors files by rank 0 (checkpoint.export_model_streamed), never the whole model."""
    if args.is_peft:
        state = adapter_state(model, env.rank)
        return ckpt.export_artifacts(args, state, model_dir, tokenizer) if env.rank == 0 else {}
    return ckpt.export_model_streamed(args, model, model_dir, tokenizer, env.rank)
