"""Quantization-aware training: the model transform ``build_model`` applies before training and the
export of the quantised weights after it (ddp only; the spec refuses QAT with other strategies).

With torchao's QATConfig, "prepare" swaps each quantised nn.Linear for
a FakeQuantizedLinear, whose forward rounds its weight (and, for the dynamic-activation scheme, its
input) to the target integer grid and back, so training learns weights that survive quantisation;
gradients pass the rounding straight through to the float "shadow" weights the optimizer updates.

What the export holds (``qat_export``): after training, torchao's "convert" step quantises each of
those linears for real — int4 values q in [-8, 7] per group of ``group_size`` input weights, one
scale s per group, symmetric (zero point 0) — and the exported ``model/`` holds, in every quantised
linear, the dequantised weight s × q: exactly the weight the fake-quantised forward computed with,
not the float shadow. It is a stock transformers checkpoint (from_pretrained, no torchao needed);
activations are quantised at run time, so the int8-dynamic-act scheme stores nothing more.
A linear whose weight is the input embedding (tie_word_embeddings) stays float: one tensor cannot
be both an int4 lm_head and the float embedding the model reads its inputs with.
"""

from __future__ import annotations

import torch

QAT_SCHEMES = ("int8-dynamic-act-int4-weight", "int4-weight-only")


def qat_base_config(scheme: str, group_size: int):
    """The torchao post-training config the scheme trains for (QATConfig derives its fake quantizers
    in "prepare" and applies it in "convert").

    - ``int8-dynamic-act-int4-weight``: Int8DynamicActivationIntxWeightConfig — int8 activations per
      token, asymmetric, quantised at run time; int4 weights per group, symmetric.
    - ``int4-weight-only``: IntxWeightOnlyConfig at int4 per group, symmetric; activations stay float.
      Not Int4WeightOnlyConfig: its packed layouts only convert with kernels not on PyPI for CPU,
      while this unpacked layout converts on any device.
    """
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerGroup,
    )

    if scheme == "int8-dynamic-act-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int4-weight-only":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    raise ValueError(f"training.qat.scheme: unknown scheme {scheme!r}; known: {', '.join(QAT_SCHEMES)}")


def qat_targets(model) -> dict[str, torch.nn.Linear]:
    """The linears QAT quantises: every nn.Linear except one sharing its weight with an embedding."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in embedded}


def qat_prepare(model, scheme: str, group_size: int) -> int:
    """Fake-quantise the model's linears for ``scheme`` (see above). Returns how many."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    targets = qat_targets(model)
    if not targets:
        raise ValueError(f"training.qat.enabled: {type(model).__name__} has no torch.nn.Linear layers to quantise "
                         "(GPT-2's blocks are Conv1D)")
    uneven = [f"{name} ({m.in_features})" for name, m in targets.items() if m.in_features % group_size]
    if uneven:
        raise ValueError(f"training.qat.group_size={group_size} must divide the input width of every quantised "
                         f"linear; it does not divide {', '.join(uneven[:4])}" + (" …" if len(uneven) > 4 else ""))
    quantize_(model, QATConfig(qat_base_config(scheme, group_size), step="prepare"),
              filter_fn=lambda m, fqn: fqn in targets)
    return len(targets)


def qat_export(model, scheme: str, group_size: int) -> None:
    """After training: torchao's convert step quantises the fake-quantised linears for real, then each
    quantised weight is replaced by its dequantised values (s × q per group), so the model is plain
    nn.Linear again, holding the quantised weights (see above), and exports with stock transformers."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.utils import TorchAOBaseTensor

    quantize_(model, QATConfig(qat_base_config(scheme, group_size), step="convert"))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and isinstance(m.weight, TorchAOBaseTensor):
            m.weight = torch.nn.Parameter(m.weight.dequantize(), requires_grad=False)
