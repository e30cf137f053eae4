"""The activation model: the bytes autograd keeps for one micro-batch, block component by block component.

Autograd keeps a tensor exactly when some op's backward needs it, so the planner walks each family's real
block op by op and applies autograd's save rules (linears.py: linears and their adapters), one module per
component of the block: the norms (norms.py), the attention (attention.py), the MLP (mlp.py), the embedding
side (embedding.py) and the LM head with the loss (head.py). Four precision regimes differ
(service/memory/precision.py): fp32; bf16 autocast (DDP: fp32 weights and residual stream, a bf16 copy of each
linear input and weight); pure bf16 compute (FSDP2's MixedPrecisionPolicy, DeepSpeed bf16); and LoRA with bf16
under DDP (a bf16 frozen base, so a bf16 residual stream, with the fp32 adapter cast per matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.memory.activations import attention as attn
from service.memory.activations import embedding, head, mlp, norms
from service.memory.activations.linears import Linears
from service.memory.precision import ActivationSizes
from service.memory.shape import ModelShape


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


def activations(shape: ModelShape, b: int, s: int, regime: ActivationSizes, targets: set[str] | None, r: int,
                attention: str = "sdpa", zero3_linear: bool = False, input_grad: bool = False,
                padded: bool = False, loss_chunk_tokens: int | None = None,
                qat: tuple[int, bool] | None = None, ia3_feedforward: frozenset[str] | None = None,
                prefix_tokens: int = 0, nf4_base: bool = False, on_gpu: bool = True,
                lycoris: bool = False, lokr: bool = False, loss_parallel: bool = False,
                embedding_leaf: bool = False, virtual_tokens: int = 0) -> Activations:
    """Bytes autograd keeps for a micro-batch of ``b`` rows of ``s`` tokens, by block component.

    ``targets``: None for a full fine-tune, else the adapted modules (service/memory/peft.py). ``input_grad``: the
    first block's input needs a gradient whatever trains (a pipeline stage after the first receives its input from
    the stage before and sends its gradient back; prompt tuning; a frozen embedding under checkpointing). Under PEFT
    the frozen embedding's output needs no gradient otherwise, except under ZeRO-3 (``zero3_linear``), whose module
    hooks hand every block an input that requires one (measured: block 0 then saves as the others do). The other
    arguments are the components' (attention.py, mlp.py, head.py, embedding.py, linears.py), and
    service/memory/peft.py: method_terms derives the method's from a spec."""
    T = b * s
    ops = Linears(shape, T, regime, targets, r, ia3_feedforward, lycoris, nf4_base)
    # An fp32 LoRA adapter beside an fp32 base under autocast (pipeline, tensor: the "autocast" regime) recasts
    # o_proj's input as under lora16 (attention.py: recast_output)
    lora_autocast = regime.name == "autocast" and not (nf4_base or lycoris) and ia3_feedforward is None
    layer: list[int] = []
    recompute: list[int] = []
    for idx in range(shape.num_layers):
        in_grad = ops.full or idx > 0 or zero3_linear or input_grad
        n = norms.block(ops, in_grad)
        n += attn.block(ops, b, s, in_grad, attention=attention, padded=padded, prefix_tokens=prefix_tokens,
                        zero3_linear=zero3_linear, qat=qat, on_gpu=on_gpu, lokr=lokr, lora_autocast=lora_autocast)
        n += mlp.block(ops, in_grad, zero3_linear=zero3_linear, qat=qat)
        layer.append(n)
        recompute.append(n - norms.checkpoint_kept_input(ops, in_grad))
    loss = head.terms(ops, b, s, zero3_linear=zero3_linear, qat=qat, loss_chunk_tokens=loss_chunk_tokens,
                      loss_parallel=loss_parallel, virtual_tokens=virtual_tokens)
    final = norms.final(ops) + loss.kept_bytes + embedding.kept(ops, s, embedding_leaf=embedding_leaf)
    ckpt_layer = T * shape.hidden * regime.residual  # a checkpointed block keeps its input
    return Activations(layer, final, loss.loss_saved_bytes, loss.logits_bytes, loss.loss_copy_bytes,
                       loss.loss_grad_bytes, ckpt_layer, mlp.backward_bytes(ops), max(recompute),
                       mlp.forward_block_bytes(ops))
