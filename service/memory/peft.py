"""The training method as the planner reads it: which linears a PEFT method adapts, which tensors train,
and what the method changes in the activations. The workers build the same adapters from the same rules
(service/domain/training.py: lora_targets, feedforward_targets; workers/peft_setup.py).
"""

from __future__ import annotations

from service.domain.spec import JobSpec, PeftMethod
from service.domain.training import feedforward_targets, lora_targets
from service.memory.shape import ModelShape


def adapted_modules(spec: JobSpec, shape: ModelShape) -> set[str] | None:
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


def trainable_numels(spec: JobSpec, shape: ModelShape, targets: set[str] | None) -> list[int]:
    """The trainable tensors' sizes in the order the optimizer gets them (``model.parameters()``)."""
    peft = spec.training.peft
    if peft.method == PeftMethod.none:
        return shape.parameter_numels()
    if peft.method in (PeftMethod.prefix_tuning, PeftMethod.prompt_tuning):
        return shape.prompt_numels(peft.method.value, peft.num_virtual_tokens)
    feedforward = feedforward_targets(shape.family, peft.target_modules) if peft.method == PeftMethod.ia3 else []
    return shape.adapter_numels(peft.method.value, peft.r, targets or set(), feedforward)


def trainable_parameters(spec: JobSpec, shape: ModelShape) -> int:
    """What peft's ``get_nb_trainable_parameters`` reports (a test builds every method on the meta
    device for every family and compares), or every parameter for a full fine-tune."""
    return sum(trainable_numels(spec, shape, adapted_modules(spec, shape)))


def largest_trainable(spec: JobSpec, shape: ModelShape, targets: set[str] | None) -> int:
    """The largest unit the optimizer updates at once: a whole module's parameters for a full fine-tune
    (torch's for-each AdamW works tensor by tensor within it), else the largest adapter tensor."""
    if targets is None:
        return shape.largest_layer_params()
    return max(trainable_numels(spec, shape, targets), default=1)


def method_terms(spec: JobSpec, shape: ModelShape) -> dict:
    """The spec's training method as :func:`service.memory.activations.activations` takes it: QAT's (group size,
    fake-quantised activations), IA3's feed-forward targets (workers/peft_setup.py; None when the method is not
    IA3), prefix tuning's virtual tokens, and whether the adapter is LoHa/LoKr. One place for every caller (a whole
    model, a pipeline stage)."""
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


def checkpointed_peft(spec: JobSpec) -> bool:
    """A frozen embedding under gradient checkpointing: transformers' ``enable_input_require_grads`` hook makes the
    lookup's output require a gradient (see service/memory/activations/embedding.py), so the first block's input needs
    one as every later block's does, and its recomputation keeps what theirs keep (measured: a one-block pipeline
    stage's recomputation, GPT-2 LoRA bf16, with c_attn's frozen weight cast kept)."""
    return spec.training.gradient_checkpointing and spec.training.peft.method != PeftMethod.none


def embedding_leaf(spec: JobSpec, shape: ModelShape, vocab_split: bool = False) -> bool:
    """Whether the embedding's output is kept as a leaf all step (service/memory/activations/embedding.py)."""
    t = spec.training
    peft = t.peft.method
    return (t.gradient_checkpointing and peft != PeftMethod.none and peft != PeftMethod.prompt_tuning
            and (vocab_split or shape.family == "gpt2"))
