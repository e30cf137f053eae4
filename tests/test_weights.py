"""workers/weights.py without processes: a safetensors checkpoint read a part at a time — rows, columns, a ZeRO-3
flat partition with its padding, a cast on the way — equals what the safetensors library reads whole; a sharded
index is one checkpoint; a corrupt file is the job's model_unavailable; the model's names map to the checkpoint's
(PEFT's wrapper and base layers, a base prefix the file lacks); and a model built empty reads its weights in the
dtype it holds them in, tied and with its computed buffers, exactly as transformers loads them."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from workers.weights import Checkpoint, WeightsError, checkpoint_name, find_name  # noqa: E402


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("ckpt")
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 11, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g).to(torch.bfloat16),
               "c": torch.randn(4, 3, 6, generator=g), "scalar": torch.tensor(3.5), "ids": torch.arange(10)}
    save_file(tensors, str(d / "model.safetensors"))
    return d, tensors


def test_parts_of_a_tensor_are_the_bytes_the_library_reads_whole(bf16_file):
    d, ref = bf16_file
    with Checkpoint(d) as ckpt:
        assert set(ckpt.entries) == set(ref) and ckpt.entries["a"].dtype == torch.bfloat16
        rows = torch.empty(9, 11, dtype=torch.bfloat16)
        ckpt.read_box("a", (20, 0), rows)  # whole rows: one contiguous read, straight into place
        assert torch.equal(rows, ref["a"][20:29])
        cols = torch.empty(37, 4, dtype=torch.float32)  # a column slice, cast to fp32 on the way
        ckpt.read_box("a", (0, 7), cols)
        assert torch.equal(cols, ref["a"][:, 7:11].float())
        box = torch.empty(2, 3, 2)
        ckpt.read_box("c", (1, 0, 3), box)
        assert torch.equal(box, ref["c"][1:3, :, 3:5])
        part = torch.full((8,), 7.0, dtype=torch.bfloat16)  # a ZeRO-3 partition past the end: zero-padded
        ckpt.read_flat("b", 2, part)
        assert torch.equal(part[:3], ref["b"][2:]) and not part[3:].any()
        assert ckpt.read("scalar").item() == 3.5 and torch.equal(ckpt.read("ids"), ref["ids"])
        assert torch.equal(ckpt.read("a", torch.float32), ref["a"].float())
        with pytest.raises(WeightsError, match="outside"):
            ckpt.read_box("a", (30, 0), torch.empty(9, 11, dtype=torch.bfloat16))
        with pytest.raises(WeightsError, match="no tensor 'zz'"):
            ckpt.entry("zz")
        assert ckpt.bytes_read > 0


def test_a_sharded_index_is_one_checkpoint(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.ones(3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.zeros(2, 2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    with Checkpoint(tmp_path) as ckpt:
        assert ckpt.total_bytes == 12 + 16 and torch.equal(ckpt.read("y"), torch.zeros(2, 2))


def test_a_corrupt_or_missing_file_is_model_unavailable(tmp_path):
    from workers.models import ModelSourceError

    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="is not a safetensors file"):
        Checkpoint(tmp_path)
    with pytest.raises(ModelSourceError, match="has no model.safetensors"):
        Checkpoint(tmp_path / "nowhere")


def test_model_names_map_to_the_checkpoints(bf16_file):
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    d, _ = bf16_file
    with Checkpoint(d) as ckpt:
        assert find_name(ckpt, "transformer.a", "transformer") == "a"  # an older GPT-2 file without the prefix
        assert find_name(ckpt, "base_model.model.a", None) == "a"
        assert find_name(ckpt, "lora_A.weight", None) is None


@pytest.mark.parametrize("model", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_a_model_built_empty_reads_its_weights_as_transformers_loads_them(tmp_path, model):
    """The checkpoint saved in bf16: a full fine-tune holds fp32 weights (cast as they are read), LoRA + bf16 its
    frozen base in bf16 (read as bf16, never fp32 first) and a fresh fp32 adapter; a tied LM head stays one
    Parameter with the embedding; the rotary frequencies the model computed are there."""
    from transformers import AutoModelForCausalLM

    from workers.args import TrainArgs
    from workers.models import resolve_model_dir
    from workers.strategies.common import build_model

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=torch.bfloat16).save_pretrained(bf16)
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    for kw, frozen in ((dict(), None), (dict(peft_method="lora", precision="bf16"), torch.bfloat16)):
        args = TrainArgs(job_id="ftjob-w", output_dir=str(tmp_path), training_path="-", model=model, **kw)
        built = build_model(args, str(bf16))
        lm = built.get_base_model() if hasattr(built, "get_base_model") else built
        held = {checkpoint_name(n): t for n, t in (*built.named_parameters(remove_duplicate=False),
                                                    *built.named_buffers())}
        for name, want in ref.state_dict().items():
            got = held[name]
            assert got.dtype == (frozen or torch.float32), name
            assert torch.equal(got.float(), want), name
        assert {p.dtype for p in built.parameters() if p.requires_grad} == {torch.float32}
        if lm.config.tie_word_embeddings:
            assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
        for name, buf in ref.named_buffers():
            assert torch.equal(dict(lm.named_buffers())[name].float(), buf.float()), name
        assert not any(p.is_meta for p in built.parameters())
