"""The vLLM engine behind the same serving requests and events (workers/serving_engine.py: VLLMEngine,
``enable_lora``): a base preset with two LoRA adapters, one request each, in this process. Runs where CUDA
and vLLM are there (a GPU node; bench/gpu_check.py's machine); elsewhere it skips, saying so."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.gpu]


def _usable() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs CUDA (torch is not installed)"
    if not torch.cuda.is_available():
        return "needs CUDA: the vLLM serving engine runs on GPU nodes only"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "needs CUDA and vLLM installed (pip install vllm on the GPU node)"
    return None


def test_vllm_engine_serves_the_base_and_adapters_with_the_same_events(tmp_path):
    why = _usable()
    if why:
        pytest.skip(why)
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from workers.models import build_preset
    from workers.serving_engine import make_engine

    base = str(build_preset("preset:small-llama"))
    torch.manual_seed(1)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "a1")
    engine = make_engine("vllm", base, max_batch=8, max_context=512, max_adapters=4)
    engine.load_adapter("a1", str(tmp_path / "a1"))
    body = {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 1,
            "sampling": {"max_tokens": 8, "temperature": 0}}

    async def collect(adapter):
        return [e async for e in engine.generate(body, adapter)]

    for adapter in (None, "a1"):
        events = asyncio.run(collect(adapter))
        assert events[0]["event"] == "start" and events[-1]["event"] == "end"
        assert events[-1]["completion_tokens"] >= 1
