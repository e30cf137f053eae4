"""QAT honours training.qat: the scheme travels from a JobSpec through workers/args.py to the worker,
which fake-quantises with that scheme's torchao modules, and the export holds the quantised weights.
The training run itself (loss, first-step loss through the fake quantizers, the exported checkpoint
on the int4 grid) is tests/test_workers_train.py::test_qat_trains_…."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from service.domain.spec import JobSpec, RunRequest  # noqa: E402
from workers.args import train_args  # noqa: E402

DYN, WEIGHT_ONLY = "int8-dynamic-act-int4-weight", "int4-weight-only"


def qat_args(tmp_path, scheme: str | None, group_size: int = 16, model: str = "preset:tiny-llama"):
    qat = {"enabled": True, "group_size": group_size, **({"scheme": scheme} if scheme else {})}
    spec = JobSpec.model_validate({"model": model, "training_file": "file-1", "training": {"qat": qat}})
    return train_args(RunRequest(job_id="ftjob-qat", spec=spec, training_path=str(tmp_path / "train.jsonl"),
                                 output_dir=str(tmp_path / "out")))


def prepared_model(args):
    from workers.models import resolve_model_dir
    from workers.strategies import build_model

    return build_model(args, resolve_model_dir(args.model, args.model_path))


@pytest.mark.parametrize("scheme", [DYN, WEIGHT_ONLY, None], ids=["int8-dyn-act", "weight-only", "default"])
def test_the_spec_scheme_reaches_the_worker_and_picks_its_fake_quantizers(tmp_path, scheme):
    """JobSpec → train_args → build_model: every linear of the model is torchao's FakeQuantizedLinear
    with an int4, per-group, symmetric weight quantizer; the int8 per-token asymmetric activation
    quantizer is there for the dynamic-activation scheme (the default) and absent for weight-only."""
    from torchao.quantization.granularity import PerGroup, PerToken
    from torchao.quantization.qat import FakeQuantizedLinear, IntxFakeQuantizer

    args = qat_args(tmp_path, scheme)
    assert args.qat_enabled and args.qat_scheme == (scheme or DYN) and args.qat_group_size == 16
    model = prepared_model(args)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    for name, m in linears.items():
        assert type(m) is FakeQuantizedLinear, name
        w = m.weight_fake_quantizer
        assert type(w) is IntxFakeQuantizer
        assert (w.config.dtype, w.config.granularity, w.config.is_symmetric) == (torch.int4, PerGroup(16), True)
        if (scheme or DYN) == DYN:
            a = m.activation_fake_quantizer
            assert type(a) is IntxFakeQuantizer, name
            assert (a.config.dtype, a.config.granularity, a.config.is_symmetric) == (torch.int8, PerToken(), False)
        else:
            assert m.activation_fake_quantizer is None, name


@pytest.mark.parametrize("scheme", [DYN, WEIGHT_ONLY])
def test_export_holds_the_weights_the_fake_quantised_forward_used(tmp_path, scheme):
    """qat_export leaves plain nn.Linear layers whose weights are exactly the fake-quantised weights
    of the trained model (not its float shadow weights), each group of 16 being scale × int in [-8, 7]."""
    from workers.strategies import qat_export

    args = qat_args(tmp_path, scheme)
    model = prepared_model(args)
    with torch.no_grad():  # stand-in for training: weights no rounding would leave on the grid
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    fake = {n: m.weight_fake_quantizer(m.weight).detach().clone() for n, m in model.named_modules()
            if hasattr(m, "weight_fake_quantizer")}
    shadow = {n: model.get_submodule(n).weight.detach().clone() for n in fake}
    qat_export(model, args.qat_scheme, args.qat_group_size)
    assert len(fake) == 2 * 7 + 1
    for name, want in fake.items():
        m = model.get_submodule(name)
        assert type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter, name
        assert torch.equal(m.weight.detach(), want), name
        assert not torch.equal(m.weight.detach(), shadow[name]), name
        assert_on_int4_grid(name, m.weight.detach(), 16)


def assert_on_int4_grid(name: str, weight, group_size: int) -> None:
    """Each group of ``group_size`` input weights is s × q with q integer in [-8, 7] (symmetric, zero
    point 0). The group's largest magnitude is s × 8 or s × 7 (the extreme rounds to -8 or 7), so
    one of those two gives s."""
    groups = weight.double().reshape(weight.shape[0], -1, group_size)
    absmax = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    on_grid = torch.zeros(groups.shape[:2], dtype=torch.bool)
    for extreme in (7, 8):
        q = groups * extreme / absmax
        on_grid |= ((q - q.round()).abs() < 1e-3).all(-1) & (q.round() >= -8).all(-1) & (q.round() <= 7).all(-1)
    off = (~on_grid).sum().item()
    assert off == 0, f"{name}: {off} of {on_grid.numel()} groups of {group_size} weights are not scale × int4"


def test_a_linear_tied_to_the_embedding_stays_float(tmp_path):
    """tiny-qwen2 ties lm_head to the input embedding: lm_head is left out (one tensor cannot be both
    the int4 lm_head and the float embedding), the tie survives, every other linear is quantised."""
    from torchao.quantization.qat import FakeQuantizedLinear

    from workers.strategies import qat_export

    model = prepared_model(qat_args(tmp_path, WEIGHT_ONLY, model="preset:tiny-qwen2"))
    embedding = model.get_input_embeddings().weight
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is embedding
    quantised = [n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)]
    assert len(quantised) == 2 * 7
    before = embedding.detach().clone()
    qat_export(model, WEIGHT_ONLY, 16)
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert torch.equal(model.lm_head.weight, before)


def test_qat_refuses_a_model_it_cannot_quantise_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"training\.qat\.group_size=32 .*mlp\.down_proj \(176\)"):
        prepared_model(qat_args(tmp_path, DYN, group_size=32))  # tiny-llama's MLP is 176 wide
    with pytest.raises(ValueError, match=r"training\.qat\.enabled: .*no torch\.nn\.Linear"):
        prepared_model(qat_args(tmp_path, DYN, model="preset:tiny-gpt2"))  # Conv1D blocks, tied lm_head


# --- the planner's QAT terms ------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [DYN, WEIGHT_ONLY], ids=["int8-dyn-act", "weight-only"])
def test_the_planner_counts_what_a_fake_quantised_linear_keeps_for_backward(scheme):
    """service/memory/planner.py: qat_linear_bytes against the tensors a real FakeQuantizedLinear saves
    (saved-tensor hooks, unique storages), less the plain input a torch.nn.Linear would keep."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    from service.memory.planner import qat_linear_bytes
    from workers.strategies.qat import qat_base_config

    T, din, dout, group = 96, 64, 48, 16
    model = torch.nn.Sequential(torch.nn.Linear(din, dout, bias=False))
    quantize_(model, QATConfig(qat_base_config(scheme, group), step="prepare"))
    x = torch.randn(T, din, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    plain_input = saved.pop(x.untyped_storage().data_ptr(), 0)  # weight-only keeps x itself, as nn.Linear does
    assert (plain_input == T * din * 4) == (scheme == WEIGHT_ONLY)
    assert sum(saved.values()) == qat_linear_bytes(T, din, dout, group, act=scheme == DYN)


def test_the_planner_refuses_a_group_size_the_model_cannot_take_naming_the_field():
    from service.domain.errors import SpecInvalid
    from service.memory.planner import plan
    from service.memory.shape import shape_from_config

    llama = shape_from_config({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 8000, "tie_word_embeddings": False})
    gpt2 = shape_from_config({"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 8000})

    def spec(group_size: int) -> JobSpec:
        return JobSpec.model_validate({"model": "m", "training_file": "file-1",
                                       "training": {"qat": {"enabled": True, "group_size": group_size}}})

    assert plan(spec(16), llama).fits is not None  # 688 = 43 × 16
    with pytest.raises(SpecInvalid) as exc:
        plan(spec(32), llama)
    assert exc.value.param == "training.qat.group_size" and "down_proj (688)" in str(exc.value)
    with pytest.raises(SpecInvalid) as exc:
        plan(spec(16), gpt2)
    assert exc.value.param == "training.qat.enabled" and "Conv1D" in str(exc.value)
