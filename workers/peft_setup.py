"""Parameter-efficient fine-tuning through the ``peft`` library: adapter configs, the QLoRA base,
saving and merging adapters. Flat arguments, no JobSpec; which modules "auto" adapts and which
methods merge are service/domain/training.py's rules, the planner's."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from service.domain.training import feedforward_targets, lora_targets

log = logging.getLogger(__name__)


QUANTIZATION_BACKENDS = ("bitsandbytes", "torchao")


def leave_out_unused_backends(peft_method: str, qat_enabled: bool, model: str) -> list[str]:
    """Mark bitsandbytes and torchao as not installed in this process when the job uses neither.

    peft and transformers import each of them whenever it is installed (peft's ``is_bnb_available`` and
    ``is_torchao_available`` look the package up with ``importlib.util.find_spec``), which costs a rank about
    1.4 CPU-seconds of start-up for nothing unless the job is QLoRA (bitsandbytes' 4-bit base), QAT (torchao)
    or a model whose config was saved quantised. ``sys.modules[name] = None`` is Python's own way of saying
    "not importable": find_spec returns None and an import raises ImportError. Call it before the first
    import of peft; a backend already imported is left alone. Returns the names marked."""
    import sys

    if peft_method == "qlora" or qat_enabled:
        return []
    config = Path(model, "config.json")
    with contextlib.suppress(OSError):
        if "quantization_config" in config.read_text(errors="replace"):
            return []
    marked = [name for name in QUANTIZATION_BACKENDS if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None
    return marked


def language_model(model):
    """The transformers model under a peft wrapper (``get_base_model()``), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def peft_config(method: str, family: str, *, r: int, alpha: float, dropout: float, targets, num_virtual_tokens: int):
    import peft

    task = peft.TaskType.CAUSAL_LM
    if method in ("lora", "qlora"):
        return peft.LoraConfig(
            task_type=task, r=r, lora_alpha=alpha, lora_dropout=dropout,
            target_modules=lora_targets(family, targets),
        )
    if method == "ia3":
        ff = feedforward_targets(family, targets)  # IA3 also scales the MLP, as a feed-forward module
        return peft.IA3Config(task_type=task, target_modules=lora_targets(family, targets) + ff, feedforward_modules=ff)
    if method == "loha":
        return peft.LoHaConfig(task_type=task, r=r, alpha=alpha, module_dropout=dropout,
                               target_modules=lora_targets(family, targets))
    if method == "lokr":
        return peft.LoKrConfig(task_type=task, r=r, alpha=alpha, module_dropout=dropout,
                               target_modules=lora_targets(family, targets))
    if method == "prefix_tuning":
        return peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=num_virtual_tokens)
    if method == "prompt_tuning":
        return peft.PromptTuningConfig(task_type=task, num_virtual_tokens=num_virtual_tokens)
    raise ValueError(f"unknown peft method {method!r}")


def qlora_quantization(compute_dtype, quant_storage=None):
    """QLoRA's base as bitsandbytes stores it: NF4 with double quantisation (the absmax of each block of 64
    weights itself quantised to 8 bits), matmuls in the regime's compute dtype (fp32 or bf16). The packed
    codes live in a uint8 tensor, or in ``quant_storage`` (the same bytes viewed as that dtype): FSDP2 shards
    and gathers a unit in one dtype, so under FSDP2 the codes are stored in the dtype it gathers in."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage or torch.uint8,
    )


def load_quantized(model_dir: str, attention: str, compute_dtype, quant_storage=None):
    """The base loaded in 4 bits on this worker's device (the current GPU, else the CPU)."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=qlora_quantization(compute_dtype, quant_storage), attn_implementation=attention,
        device_map=device_map, dtype=compute_dtype,  # weights quantised from the compute dtype, dequantised to it
    )
    for m in model.modules():
        # On CPUs with AVX512-BF16, Linear4bit repacks its weight for inference the first time it runs in eval
        # mode without grad (bitsandbytes/nn/modules.py Linear4bit.forward), which asserts out_features % 32 == 0
        # and rewrites the storage mid-training: keep the training layout for evaluation too.
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def load_qlora_base(model_dir: str, attention: str, compute_dtype, quant_storage=None):
    """A 4-bit NF4 base for QLoRA, on GPU or CPU (bitsandbytes >= 0.49 has a CPU backend).
    ``prepare_model_for_kbit_training`` upcasts every parameter that is not 4-bit (embeddings, norms,
    lm_head) to fp32, as the planner counts them."""
    from peft import prepare_model_for_kbit_training

    model = load_quantized(model_dir, attention, compute_dtype, quant_storage)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def apply_peft(model, method: str, *, r=8, alpha=16.0, dropout=0.0, targets="auto", num_virtual_tokens=16):
    """Wrap ``model`` with a fresh adapter; only adapter parameters stay trainable. The adapter is made on
    the host in fp32, with its initial values, whatever the base is (``_adapter_as_made``); a prompt
    encoder PEFT put on the meta device with a meta base is made again on the host."""
    import peft

    cfg = peft_config(method, model.config.model_type, r=r, alpha=alpha, dropout=dropout,
                      targets=targets, num_virtual_tokens=num_virtual_tokens)
    with _adapter_as_made():
        wrapped = peft.get_peft_model(model, cfg)
    init_adapters(wrapped)
    return wrapped


@torch.no_grad()
def init_adapters(model) -> int:
    """Give every adapter tensor (and a prompt encoder) its initial values again, on the host in fp32, in module
    order: peft puts a new adapter where its base layer is (``_replace_module``), which for a base built on the
    meta device (workers/models.py empty_model) is the meta device, where its values are lost. Done whatever the
    base, so that every strategy draws the same initial adapter from the same seed. Returns the layers reset."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    n = 0
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        config = model.peft_config[module.active_adapters[0]] if hasattr(model, "peft_config") else None
        for adapter in module.active_adapters:
            for attr in module.adapter_layer_names:
                layer = getattr(module, attr, None)
                if layer is None or adapter not in layer:
                    continue
                item = layer[adapter]
                if isinstance(item, torch.nn.Parameter):
                    if item.is_meta or item.dtype != torch.float32:
                        layer[adapter] = torch.nn.Parameter(torch.empty_like(item, device="cpu", dtype=torch.float32),
                                                            requires_grad=item.requires_grad)
                elif any(p.is_meta or p.dtype != torch.float32 for p in item.parameters()):
                    item.to_empty(device="cpu")
                    item.float()
            if hasattr(module, "reset_lora_parameters"):
                module.reset_lora_parameters(adapter, getattr(config, "init_lora_weights", True))
            elif hasattr(module, "reset_ia3_parameters"):
                module.reset_ia3_parameters(adapter)
            elif hasattr(module, "reset_adapter_parameters"):
                module.reset_adapter_parameters(adapter)
            else:  # pragma: no cover - every method memfit offers has one of the three
                raise ValueError(f"cannot initialise the adapter of {type(module).__name__}")
            n += 1
    encoder = getattr(model, "prompt_encoder", None)
    if encoder is not None:  # prefix and prompt tuning: embeddings (and linears) of their own
        for m in encoder.modules():
            if list(m.parameters(recurse=False)):
                if any(p.is_meta for p in m.parameters(recurse=False)):
                    m.to_empty(device="cpu", recurse=False)
                m.float()
                m.reset_parameters()
                n += 1
    return n


@contextlib.contextmanager
def _adapter_as_made():
    """peft moves each new adapter to its base layer's device and dtype (tuners_utils.py
    ``_move_adapter_to_device_of_base_layer``): onto the meta device for a base built empty (the adapter's
    initial values lost), or rounded to bf16 for a bf16 base before peft casts it back to fp32. A base on the
    host or the meta device keeps the adapter where peft made it, in fp32 with its values; a base on a GPU
    (QLoRA's, loaded there) gets it moved as before."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def move(self, adapter_name, device=None):
        weight = getattr(self.get_base_layer(), "weight", None)
        if device is None and weight is not None and weight.device.type in ("cpu", "meta"):
            return None
        return original(self, adapter_name, device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original


def merge_adapter(base_dir: str, adapter_dir: str | Path, out_dir: str | Path, attention: str = "sdpa",
                  quantized_from=None) -> Path:
    """Reload the base in fp32, apply the saved adapter, fold it into the weights and save a full model.

    ``quantized_from`` (QLoRA: the torch dtype training loaded the base in before quantising it): the adapter
    was trained against the NF4 base, so it is folded into that base dequantised, not into the original
    weights: the merged model computes what the trained adapter model computed (the original weights
    would differ from it by the 4-bit rounding)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if quantized_from is not None:
        base = load_quantized(base_dir, attention, quantized_from).dequantize().to("cpu", torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation=attention, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    return Path(out_dir)
