"""What a block's linears keep for backward: autograd's, autocast's and the adapters' rules, shared by the
attention and the MLP (service/memory/activations/attention.py, mlp.py).

- autograd saves a matmul's input only for its weight's gradient: a linear keeps its input only if its
  weight is trainable (LoRA: the frozen base does not, the adapter's A does);
- autocast (``casts``) gives each linear its own 16-bit copy of an fp32 input, and caches the 16-bit copy
  of a weight that requires a gradient for the whole forward (aten/src/ATen/autocast_mode.cpp: cached_cast);
  a frozen weight's cast is made per call and kept only where autograd saves it, for the input's gradient;
- LoRA: lora_B keeps lora_A's output (T × r); LoHa/LoKr (``lycoris``): peft builds each target's whole
  delta weight and runs ``F.linear(x, delta_weight)`` (``_get_delta_activations``), which keeps the out × in
  delta weight beside the input, and no low-rank activation;
- IA3 (``ia3_feedforward`` not None): peft's IA3 layer (peft/tuners/ia3/layer.py: Linear.forward) multiplies a
  frozen linear's output by its vector, or, for a feed-forward target, its input after casting it to the
  vector's dtype (fp32); the multiplication keeps that output (in the compute dtype) or that fp32 input for the
  vector's gradient, and the frozen linear itself keeps nothing;
- QAT: every quantised linear is torchao's FakeQuantizedLinear (:func:`qat_linear_bytes`);
- QLoRA (``nf4_base``): the base linears are bitsandbytes' Linear4bit (service/memory/nf4.py), whose matmul
  saves only the packed weight, resident anyway, so autocast caches no 16-bit copy of the base, only of
  the fp32 adapter, as for ``lora16``.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.memory.precision import ActivationSizes
from service.memory.shape import ModelShape


@dataclass(frozen=True)
class Linears:
    """One micro-batch of ``T`` tokens through a block's linears, with the training method's adapters."""

    shape: ModelShape
    T: int
    regime: ActivationSizes
    targets: set[str] | None  # None: a full fine-tune; else the adapted module names
    r: int
    ia3_feedforward: frozenset[str] | None = None
    lycoris: bool = False
    nf4_base: bool = False

    @property
    def full(self) -> bool:
        return self.targets is None

    def trainable(self, name: str) -> bool:
        return self.full or name in (self.targets or ())

    def adapted(self, name: str) -> bool:
        return not self.full and name in (self.targets or ())

    def linear_input(self, in_dtype_bytes: int, consumers: list[str], width: int) -> int:
        """Bytes saved for the input shared by ``consumers`` (linears reading the same tensor)."""
        if self.ia3_feedforward is not None:
            return 0  # IA3's linears are frozen; see ia3_saved
        savers = [c for c in consumers if self.trainable(c)]
        if not savers:
            return 0
        if self.regime.casts and in_dtype_bytes == 4:
            return len(savers) * self.T * width * 2  # each autocast linear casts its own bf16 copy
        return self.T * width * (in_dtype_bytes if not self.regime.casts else 2)

    def weight_casts(self, names: list[str], frozen_input: tuple[str, ...] = ()) -> int:
        """The 16-bit weight copies the matmuls of ``names`` keep under autocast. ``frozen_input``: linears whose
        input needs no gradient (the first block's q/k/v under PEFT)."""
        if not self.regime.casts:
            return 0
        shapes = self.shape.linear_shapes()
        if self.regime.name == "lora16" or self.nf4_base:  # no fp32 base weight to cast: bf16 copies of A and B
            return sum(2 * self.r * (shapes[n][0] + shapes[n][1]) for n in names
                       if self.adapted(n) or self.adapted(n.split(".")[-1]))
        return sum(2 * shapes[n][0] * shapes[n][1] for n in names if self.full or n not in frozen_input)

    def adapter_saved(self, names: list[str]) -> int:
        """What the adapters of ``names`` keep: lora_A's output, or LoHa's/LoKr's delta weight."""
        if self.ia3_feedforward is not None:
            return 0
        if self.lycoris:  # each target's delta weight, kept by F.linear
            shapes = self.shape.linear_shapes()
            return sum(din * dout * self.regime.act for din, dout in (shapes[n] for n in names
                                                                      if n in shapes and self.adapted(n)))
        return sum(self.T * self.r * self.regime.act for n in names if self.adapted(n))  # lora_A output, kept by lora_B

    def ia3_saved(self, names: list[str]) -> int:
        """What the IA3 multiplications of ``names`` keep: a target's output, a feed-forward target's fp32 input."""
        if self.ia3_feedforward is None:
            return 0
        n = 0
        shapes = self.shape.linear_shapes()
        for name in names:
            din, dout = shapes[name]
            short = name.split(".")[-1]
            if name in self.ia3_feedforward or short in self.ia3_feedforward:
                n += self.T * din * 4
            elif self.adapted(name) or self.adapted(short):
                n += self.T * dout * self.regime.act
        return n

    def qat_saved(self, names: list[str], qat: tuple[int, bool] | None) -> int:
        """QAT: what the FakeQuantizedLinear of each of ``names`` keeps (:func:`qat_linear_bytes`)."""
        if not qat:
            return 0
        shapes = self.shape.linear_shapes()
        return sum(qat_linear_bytes(self.T, *shapes[n], *qat) for n in names)


def qat_linear_bytes(T: int, din: int, dout: int, group: int, act: bool) -> int:
    """What one of torchao's FakeQuantizedLinear (torchao/quantization/qat/linear.py: forward) keeps for
    backward, fp32, with memfit's scheme (int8 per-token asymmetric activations, int4 per-group weights;
    workers/strategies/qat.py). The activation fake-quantiser (qat/fake_quantizer.py: _per_token_forward,
    quant_primitives' _fake_quantize_affine through its straight-through rounding) keeps the per-token
    scale and zero point and one T × in intermediate, and F.linear keeps the fake-quantised input: 2·T·in
    plus 2·T. The weight fake-quantiser (per group) keeps the weight regrouped as out × in/g × g and
    F.linear the fake-quantised weight: 2·out·in plus a scale and zero point per group (tests/test_qat.py
    holds these to the saved-tensor hooks of a real FakeQuantizedLinear, both schemes). ``act``: the
    activations are fake-quantised (the int8 scheme; weight-only keeps the plain input, counted by the
    caller as without QAT); the plain input the linear would have kept is then the caller's to leave out."""
    return 4 * ((2 * T * din + 2 * T if act else 0) + 2 * dout * din + 2 * dout * (din // group))
