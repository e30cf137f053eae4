"""A job's model on the workers: a built-in preset built and cached, a local Hugging Face directory or a hub
id checked and loaded. Which of the three a ``model`` names is service/domain/model_ref.py's rule.

Presets are random-init models built from the config dicts in service/domain/presets.py, with a byte-level
BPE tokenizer trained in-process to exactly ``vocab_size`` tokens (service/domain/presets.py: preset_tokenizer,
torch-free, so that the service tokenizes a training file with the very tokenizer the workers build). A built preset is cached on disk
(``MEMFIT_PRESET_CACHE`` or ~/.cache/memfit/presets) so every rank and every later run loads the
same weights; the build is seeded and published atomically (workers/published.py), so concurrent
ranks, jobs and nodes agree and a crashed build never leaves a folder that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from service.domain.encoding import DEFAULT_CHAT_TEMPLATE
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.presets import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    preset_config,
    preset_name,
    preset_tokenizer,
)
from workers.published import publish_once

# Bumped whenever _write_preset changes what it writes, so that old cache entries are not reused.
PRESET_BUILD_VERSION = 3  # 3: the default chat template renders tools and tool calls


class ModelSourceError(RuntimeError):
    """The model could not be found or loaded; the message says which source and why."""


def preset_cache_dir() -> Path:
    return Path(os.environ.get("MEMFIT_PRESET_CACHE", Path.home() / ".cache" / "memfit" / "presets"))


def train_tokenizer(vocab_size: int, max_length: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens, as a transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=preset_tokenizer(vocab_size),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=max_length,
    )
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    return fast


def preset_key(cfg: dict) -> str:
    """The cache key of a preset: its config, and the version of the build that turns it into files."""
    blob = json.dumps({"config": cfg, "build": PRESET_BUILD_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def build_preset(model: str, cache_dir: Path | None = None) -> Path:
    """The directory of a preset model with its tokenizer, built on first use.

    Any number of ranks, jobs and nodes may ask at once: the build is published atomically (see
    workers/published.py) and a half-built or foreign folder at the target is replaced, so a crash
    or a stray write never poisons the cache. The build is seeded, so every builder writes the same
    weights and tokenizer."""
    cfg = preset_config(model)
    target = Path(cache_dir or preset_cache_dir()) / f"{preset_name(model)}-{preset_key(cfg)}"
    return publish_once(target, preset_key(cfg), lambda tmp: _write_preset(cfg, tmp))


def _write_preset(cfg: dict, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    max_len = int(cfg.get("max_position_embeddings", cfg.get("n_positions", 1024)))
    tokenizer = train_tokenizer(int(cfg["vocab_size"]), max_len)
    config = AutoConfig.for_model(**cfg)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    # Seeded, and on a forked RNG: the process that builds the preset (a job's rank, a test) draws its own random
    # numbers afterwards (a LoRA's initial A, dropout) exactly as a process that found it built does.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(config)
    # transformers 5's save_pretrained writes nothing but the folder on a process whose
    # torch.distributed rank is not 0 (PreTrainedModel.should_save_on_this_rank), and a Ray Train
    # worker has its process group up before it builds the preset: the rank that won the build would
    # publish a folder holding only the tokenizer's files. This build is not a distributed
    # checkpoint — whichever rank builds it must write all of it.
    net.should_save_on_this_rank = lambda is_main_process: True
    net.save_pretrained(out)
    tokenizer.save_pretrained(out)
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (out / name).is_file()]
    if missing:  # never seal (and so publish) an incomplete build
        raise ModelSourceError(f"building {out.name} wrote no {', '.join(missing)}")


def resolve_model_dir(model: str, model_path: str | None = None) -> str:
    """A local directory or hub id that ``from_pretrained`` can load, building presets as needed.

    Which of the three ``model`` is, is service/domain/model_ref.py's rule. A worker has no
    MEMFIT_MODEL_DIRS: the scheduler resolved a local model to ``model_path`` (the run request's), so
    here a local path is only allowed as ``model_path``. What is left here is what needs the workers'
    libraries: building a preset, and finding a hub id in the local cache when HF_HUB_OFFLINE is set."""
    try:
        ref = resolve_model(model, (), model_path=model_path)
    except ModelRefError as exc:
        raise ModelSourceError(exc.message) from None
    if ref.kind == "local":
        return ref.local_dir
    if ref.kind == "preset":
        return str(build_preset(model))
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        # Offline: the hub id may still be in the local cache; from_pretrained will tell.
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(ref.hub_id, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached, or a cache huggingface_hub cannot read
            raise ModelSourceError(
                f"model {model!r} is a hub id but HF_HUB_OFFLINE is set and it is not in the local cache; "
                "download it on a machine with network access or give a local directory"
            ) from None
    return ref.hub_id


def local_model_dir(model_dir: str) -> str:
    """A local directory for what ``resolve_model_dir`` gave: itself, or a hub id's snapshot in the Hugging
    Face cache, downloaded once per node (the workers read the weights files themselves: workers/weights.py)."""
    if Path(model_dir).is_dir():
        return model_dir
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_dir, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.tiktoken", "*.py"])
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing …
        raise ModelSourceError(f"model {model_dir!r}: its files could not be fetched from the Hugging Face Hub: "
                               f"{_why(exc)}") from None


def has_safetensors(model_dir: str) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()


def check_model(model: str, model_path: str | None = None) -> str:
    """What the Ray job's driver checks before any worker starts (workers/run.py: validate), so that
    a model that cannot be loaded fails the job once instead of in every worker group Ray Train starts.

    A preset is built. A directory (given, a preset's, or a hub id's snapshot in the local cache)
    needs a config transformers reads, a tokenizer that loads and its weight files. A hub id must be
    in the local cache when HF_HUB_OFFLINE is set; online, the Hub must answer one HEAD request for
    its config.json (no retries, 10 s at most) — downloading it is the workers' job. Returns what
    ``from_pretrained`` will be given; raises ModelSourceError naming the model and why."""
    model_dir = resolve_model_dir(model, model_path)
    if not Path(model_dir).is_dir():  # an online hub id
        _hub_check(model)
        return model_dir
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - bad JSON, a model_type this transformers does not know …
        raise ModelSourceError(f"model {model!r}: its config.json cannot be read: {_why(exc)}") from None
    try:
        load_tokenizer(model_dir)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for a missing or broken tokenizer
        raise ModelSourceError(f"model {model!r}: no tokenizer loads from {model_dir}: {_why(exc)}") from None
    missing = _missing_weights(Path(model_dir))
    if missing:
        raise ModelSourceError(f"model {model!r}: {model_dir} {missing}")
    return model_dir


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _missing_weights(model_dir: Path) -> str | None:
    """None when the weight files are there (one file, or every shard an index names), else what is missing."""
    for name in WEIGHT_FILES:
        if (model_dir / name).is_file():
            return None
        index = model_dir / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                return f"has an unreadable {index.name}: {_why(exc)}"
            absent = [s for s in shards if not (model_dir / s).is_file()]
            if absent:
                return f"lacks {len(absent)} of the {len(shards)} weight shards {index.name} names, e.g. {absent[0]}"
            return None
    return f"has no weights ({' or '.join(WEIGHT_FILES)}, or a sharded index of them)"


def _hub_check(model: str) -> None:
    """One HEAD request for the hub id's config.json; ModelSourceError says why it is not there."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
    )

    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=10)
        return
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        why = "is gated on the Hugging Face Hub and HF_TOKEN gives no access (accept its licence on huggingface.co)"
    except RepositoryNotFoundError:
        why = "is not on the Hugging Face Hub (or is private and HF_TOKEN gives no access)"
    except EntryNotFoundError:
        why = "has no config.json on the Hugging Face Hub: not a transformers model"
    except HFValidationError as exc:
        why = f"is neither a preset, a local directory nor a valid hub id ({exc})"
    except Exception as exc:  # noqa: BLE001 - no connection, a timeout, a proxy, a 5xx …
        why = (f"cannot be checked: the Hugging Face Hub did not answer ({_why(exc)}); put the model in the "
               "local cache and set HF_HUB_OFFLINE=1, or give a local directory")
    raise ModelSourceError(f"model {model!r} {why}")


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def empty_model(model_dir: str, attention: str = "sdpa", dtype=None, *, zero3_config: dict | None = None):
    """The model of ``model_dir``'s config, without its weights: its parameters on the meta device (no memory,
    nothing initialised) in ``dtype`` (default fp32), its buffers real (what the model computes when it is
    built: rotary frequencies); or, with ``zero3_config`` (a DeepSpeed config), built under
    ``deepspeed.zero.Init``, each parameter partitioned over the ranks as it is made and left uninitialised.
    workers/weights.py then reads the weights each rank holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot load model {model_dir!r}: {exc}") from None
    dtype = dtype or torch.float32
    if zero3_config is not None:
        import deepspeed

        # the config's bf16/fp16 mode gives zero.Init its dtype (an explicit dtype= is ignored on a CPU accelerator:
        # partition_parameters.py _set_dtype takes bf16 there whatever it is given)
        with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=zero3_config):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    else:
        from accelerate import init_empty_weights

        with no_init_weights(), init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    # no_init_weights skips PreTrainedModel.init_weights, which is where a model ties its LM head to its
    # embedding: tie them, one Parameter as from_pretrained's model has
    model.tie_weights()
    return model


def load_model(model_dir: str, attention: str = "sdpa", dtype=None):
    """The model in fp32 (mixed precision is autocast, not a weight dtype) unless ``dtype`` says."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation=attention, dtype=dtype or torch.float32
        )
    except (OSError, SafetensorError) as exc:  # missing, unreadable or corrupt weight files
        raise ModelSourceError(f"cannot load model {model_dir!r}: {exc}") from None


def hidden_size(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "hidden_size", None) or cfg.n_embd)


def config_hidden_size(model_dir: str) -> int:
    """The hidden width from the model's config.json, before the model exists."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    return int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
