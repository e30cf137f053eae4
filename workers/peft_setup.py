"""Parameter-efficient fine-tuning through the ``peft`` library: adapter configs, the QLoRA base,
saving and merging adapters. Flat arguments, no JobSpec; which modules "auto" adapts and which
methods merge are service/domain/training.py's rules, the planner's."""

from __future__ import annotations

import logging
from pathlib import Path

from service.domain.training import feedforward_targets, lora_targets

log = logging.getLogger(__name__)


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


def load_qlora_base(model_dir: str, attention: str):
    """A 4-bit NF4 base for QLoRA. GPU only in memfit (the spec refuses qlora on CPU workers)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not torch.cuda.is_available():
        raise RuntimeError("qlora needs a CUDA device; use lora on CPU workers")
    from peft import prepare_model_for_kbit_training

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quant, attn_implementation=attention,
        device_map={"": torch.cuda.current_device()},
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def apply_peft(model, method: str, *, r=8, alpha=16.0, dropout=0.0, targets="auto", num_virtual_tokens=16):
    """Wrap ``model`` with a fresh adapter; only adapter parameters stay trainable."""
    import peft

    cfg = peft_config(method, model.config.model_type, r=r, alpha=alpha, dropout=dropout,
                      targets=targets, num_virtual_tokens=num_virtual_tokens)
    return peft.get_peft_model(model, cfg)


def merge_adapter(base_dir: str, adapter_dir: str | Path, out_dir: str | Path, attention: str = "sdpa") -> Path:
    """Reload the base in fp32, apply the saved adapter, fold it into the weights and save a full model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation=attention, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    return Path(out_dir)
