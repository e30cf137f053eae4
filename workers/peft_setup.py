"""Parameter-efficient fine-tuning through the ``peft`` library. Flat arguments, no JobSpec."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The attention projections per model family: what "auto" adapts.
# Every family the planner reads (service/memory/shape.py) has one here.
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
AUTO_TARGETS = {**{f: ["q_proj", "k_proj", "v_proj", "o_proj"] for f in _LLAMA_LIKE}, "gpt2": ["c_attn", "c_proj"]}
# IA3 also scales the MLP's down projection, which it then treats as a feed-forward module.
AUTO_FEEDFORWARD = {**{f: ["down_proj"] for f in _LLAMA_LIKE}, "gpt2": ["c_fc"]}
MERGEABLE = {"lora", "qlora", "ia3", "loha", "lokr"}


def target_modules_for(family: str, targets: list[str] | str) -> list[str]:
    if targets != "auto":
        return list(targets)
    if family not in AUTO_TARGETS:
        raise ValueError(
            f"no automatic target_modules for model family {family!r}; set training.peft.target_modules"
        )
    return list(AUTO_TARGETS[family])


def peft_config(method: str, family: str, *, r: int, alpha: float, dropout: float, targets, num_virtual_tokens: int):
    import peft

    task = peft.TaskType.CAUSAL_LM
    if method in ("lora", "qlora"):
        return peft.LoraConfig(
            task_type=task, r=r, lora_alpha=alpha, lora_dropout=dropout,
            target_modules=target_modules_for(family, targets),
        )
    if method == "ia3":
        modules = target_modules_for(family, targets)
        ff = [m for m in AUTO_FEEDFORWARD.get(family, [])] if targets == "auto" else []
        return peft.IA3Config(task_type=task, target_modules=modules + ff, feedforward_modules=ff)
    if method == "loha":
        return peft.LoHaConfig(task_type=task, r=r, alpha=alpha, module_dropout=dropout,
                               target_modules=target_modules_for(family, targets))
    if method == "lokr":
        return peft.LoKrConfig(task_type=task, r=r, alpha=alpha, module_dropout=dropout,
                               target_modules=target_modules_for(family, targets))
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


def save_adapter(peft_model, out_dir: str | Path, state_dict=None) -> Path:
    """Adapter weights and config; ``state_dict`` is the gathered full state dict under FSDP/ZeRO-3."""
    out = Path(out_dir)
    peft_model.save_pretrained(out, state_dict=state_dict) if state_dict is not None else peft_model.save_pretrained(out)
    return out


def merge_adapter(base_dir: str, adapter_dir: str | Path, out_dir: str | Path, attention: str = "sdpa") -> Path:
    """Reload the base in fp32, apply the saved adapter, fold it into the weights and save a full model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation=attention, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    return Path(out_dir)
