"""A rank whose job uses neither QLoRA nor QAT starts without importing bitsandbytes or torchao
(workers/peft_setup.leave_out_unused_backends), and peft still builds, trains and merges its adapter."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from workers.peft_setup import leave_out_unused_backends
marked = leave_out_unused_backends(sys.argv[1], sys.argv[2] == "qat", sys.argv[3])
import peft, torch
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=4, vocab_size=64))
model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
ids = torch.randint(0, 64, (2, 6))
model(input_ids=ids, labels=ids).loss.backward()
model.merge_and_unload()
print(json.dumps({"marked": marked, "imported": [m for m in ("bitsandbytes", "torchao") if sys.modules.get(m) is not None]}))
"""


def probe(method: str, qat: bool, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, method, "qat" if qat else "-", model], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_lora_job_imports_neither_backend_and_still_trains_and_merges(tmp_path):
    seen = probe("lora", False, str(tmp_path))
    assert seen == {"marked": ["bitsandbytes", "torchao"], "imported": []}


def test_qlora_qat_and_a_quantised_checkpoint_keep_the_backends(tmp_path):
    qlora = probe("qlora", False, str(tmp_path))
    assert qlora["marked"] == [] and "bitsandbytes" in qlora["imported"]
    assert probe("lora", True, str(tmp_path))["marked"] == []
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert probe("lora", False, str(tmp_path))["marked"] == []
