"""The training data as the planner sees it: how long every row is once the workers have tokenized and
truncated (or packed) it, and so how wide the widest micro-batch the sampler can form is.

Why the width is all that matters. ``workers/data.py: collate`` pads each micro-batch to its longest
row, and every tensor of a step — activations, logits, the loss's temporaries — is sized by that padded
width, padded positions included; the other rows' lengths change nothing. The sampler
(workers/data.py: StepSampler) deals every example once per epoch in a seeded permutation, so the widest
micro-batch it *can* form is ``micro_batch_size`` rows padded to the longest row of the data, and any run
that sees that row once forms it. (Which micro-batch it *will* form at step s is ``torch.randperm``'s,
which the service cannot reproduce without torch; planning the longest row is exact for every run that
covers that row and an upper bound for a shorter one.) With packing every row is ``max_seq_length``
tokens but the last.

How the rows are measured: the rows of the file (service/domain/datafmt.py), each encoded by the workers'
own rule (service/domain/encoding.py: chat template, prompt/completion, text; bos/eos), cut to
``max_seq_length`` or packed (``row_lengths``), with a tokenizer the service can build without torch:

- a preset: the very BPE tokenizer the workers build (service/domain/presets.py: preset_tokenizer);
- a local model directory: its ``tokenizer.json`` read by the ``tokenizers`` package, its special tokens
  and chat template from ``tokenizer_config.json`` / ``chat_template.jinja``, the template rendered the
  way transformers 5 renders it (:class:`JsonTokenizer`: the same jinja2 sandbox, globals and filters);
- a hub id: not read here (the service does not download) — the plan says so and uses the bound.

Where the data or a tokenizer is not available the plan says why (``DataShape.reason``) and plans every
row at ``max_seq_length``. The examples' encoded lengths are cached per file and tokenizer, so a file
is tokenized once per process, not at every admission and validation.
"""

from __future__ import annotations

import json
import os
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.domain.encoding import DEFAULT_CHAT_TEMPLATE, encode_example, encode_preference, pack_segments, row_lengths
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.plan import DataShape
from service.domain.spec import JobSpec, PeftMethod

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerUnavailable(Exception):
    """The service cannot build the job's tokenizer; the message says why."""


# --- a tokenizer without torch ---------------------------------------------------------------------


def _compile_template(source: str):
    """A chat template compiled as transformers 5 compiles it (transformers/utils/chat_template_utils.py:
    _cached_compile_jinja_template): jinja2's immutable sandbox with trim_blocks and lstrip_blocks, loop
    controls, a ``{% generation %}`` block that renders its body, ``tojson`` without HTML escaping, and
    the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``."""
    from datetime import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=dict, namespace=jinja2.utils.Namespace)
    return env.from_string(source)


@dataclass
class JsonTokenizer:
    """The slice of a transformers tokenizer that service/domain/encoding.py uses, over a
    ``tokenizers.Tokenizer``: ``tokenizer(text, add_special_tokens=False)["input_ids"]`` is the Rust
    tokenizer's ``encode`` (what transformers' TokenizersBackend calls), ``apply_chat_template(…,
    tokenize=False)`` renders the template with the messages (keys whose value is None dropped, as
    transformers does) and the named special tokens."""

    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, … → their text (transformers' special_tokens_map)
    chat_template: str
    key: str  # what identifies it, for the length cache

    def __post_init__(self):
        self._template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def _id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            tools: list[dict] | None = None) -> str:
        assert not tokenize, "the planner renders text and tokenizes it itself"
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(messages=chat, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_dir(model_dir: str) -> JsonTokenizer:
    """A local model directory's tokenizer, as workers/models.py: load_tokenizer loads it (pad falls back
    to eos; no template → memfit's default). Raises TokenizerUnavailable without a tokenizer.json."""
    from tokenizers import Tokenizer

    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise TokenizerUnavailable(f"{model_dir} has no tokenizer.json (the service reads only fast tokenizers)")
    try:
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        special_map = json.loads((d / "special_tokens_map.json").read_text()) \
            if (d / "special_tokens_map.json").is_file() else {}
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - OSError, bad JSON, or the tokenizers package's own Exception
        raise TokenizerUnavailable(f"{model_dir}: its tokenizer cannot be read: {exc}") from None
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name)) or _token_text(special_map.get(name))
        if text is not None:
            special[name] = text
    if "pad_token" not in special and "eos_token" in special:
        special["pad_token"] = special["eos_token"]
    template = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() else config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    stat = path.stat()
    return JsonTokenizer(tok, special, template or DEFAULT_CHAT_TEMPLATE,
                         key=f"dir:{d.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")


def tokenizer_for(spec: JobSpec, model_dirs, model_path: str | None = None) -> tuple[JsonTokenizer, str]:
    """The job's tokenizer and where it came from; raises TokenizerUnavailable saying why not."""
    from service.domain.presets import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, preset_config, preset_tokenizer

    try:
        ref = resolve_model(spec.model, model_dirs, model_path=model_path)
    except ModelRefError as exc:
        raise TokenizerUnavailable(exc.message) from None
    if ref.kind == "preset":
        vocab = int(preset_config(spec.model)["vocab_size"])
        special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        return (JsonTokenizer(preset_tokenizer(vocab), special, DEFAULT_CHAT_TEMPLATE, key=f"preset:{vocab}"),
                f"{spec.model}'s tokenizer")
    if ref.kind == "local":
        return tokenizer_from_dir(ref.local_dir), f"the tokenizer.json of {ref.local_dir}"
    raise TokenizerUnavailable(f"{spec.model!r} is a hub model: the service does not download its tokenizer")


# --- the rows' lengths -----------------------------------------------------------------------------

_CACHE: OrderedDict[tuple, array] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_FILES = 32


def example_lengths(path: str, tokenizer: JsonTokenizer) -> array:
    """Every example's encoded length (before truncation), cached by file (path, size, mtime) and tokenizer."""
    from service.domain.datafmt import read_jsonl

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, tokenizer.key)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    fmt, rows = read_jsonl(path)
    if fmt == "preference":  # DPO: the chosen and the rejected sequence share a micro-batch; the longer counts
        lengths = array("I", (max(len(c), len(r)) for (c, _), (r, _) in (encode_preference(tokenizer, row) for row in rows)))
    else:
        lengths = array("I", (len(encode_example(tokenizer, r, fmt)[0]) for r in rows))
    with _CACHE_LOCK:
        _CACHE[key] = lengths
        while len(_CACHE) > _CACHE_FILES:
            _CACHE.popitem(last=False)
    return lengths


def training_rows(spec: JobSpec, training_path: str, model_dirs=(), model_path: str | None = None) -> tuple[list[int], int]:
    """(every training row's tokens, in the order the workers hold them, and the examples' count): the rows the
    shared order (service/domain/sampling.py) deals, for the step-by-step plan (service/memory/steps.py). Raises
    as the tokenizer or the file does; :func:`data_shape` says why first."""
    hp = spec.training.hyperparameters
    tokenizer, _ = tokenizer_for(spec, model_dirs, model_path)
    lengths = example_lengths(training_path, tokenizer)
    return row_lengths(list(lengths), hp.max_seq_length, hp.packing), len(lengths)


def data_shape(spec: JobSpec, training_path: str | None, model_dirs=(), model_path: str | None = None) -> DataShape:
    """The training data's rows as the planner plans them (see the module docstring). Never raises: a file
    or tokenizer that cannot be read gives ``measured=False`` with the reason, and the bound."""
    hp = spec.training.hyperparameters
    bound = DataShape(measured=False, reason="", training_file=spec.training_file, max_seq_length=hp.max_seq_length,
                      planned_seq_length=hp.max_seq_length, packing=hp.packing,
                      padded=hp.packing)  # packed rows of several examples are masked block-diagonally
    if not training_path:
        return bound.model_copy(update={"training_file": None, "reason": "no training file given: every row is planned "
                                        f"padded to max_seq_length={hp.max_seq_length}"})
    try:
        tokenizer, source = tokenizer_for(spec, model_dirs, model_path)
        lengths = example_lengths(training_path, tokenizer)
    except TokenizerUnavailable as exc:
        return bound.model_copy(update={"reason": f"{exc}; every row is planned padded to max_seq_length="
                                        f"{hp.max_seq_length}"})
    except Exception as exc:  # noqa: BLE001 - a template that fails, an unreadable file: the bound still holds
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return bound.model_copy(update={"reason": f"the training file could not be tokenized here ({why}); every "
                                        f"row is planned padded to max_seq_length={hp.max_seq_length}"})
    rows = row_lengths(list(lengths), hp.max_seq_length, hp.packing)
    if not rows:
        return bound.model_copy(update={"reason": "the training file holds no rows"})
    longest = max(rows)
    # collate pads the shorter rows of a micro-batch: the widest one can hold the longest row beside a shorter one
    padded = spec.resolved().micro_batch_size > 1 and min(rows) < longest
    if hp.packing and any(len(r) > 1 for r in pack_segments([min(n, hp.max_seq_length) for n in lengths], hp.max_seq_length)):
        # a row packed with several examples is attended block-diagonally: the model is given a mask, as for padding
        padded = True
    truncated = sum(1 for n in lengths if n > hp.max_seq_length)
    how = "packed into rows of max_seq_length" if hp.packing else "cut to max_seq_length"
    reason = (f"{len(lengths)} examples tokenized with {source}, {how}: the longest of {len(rows)} rows is "
              f"{longest} tokens, so the widest micro-batch is {spec.resolved().micro_batch_size} × {longest}")
    if spec.training.peft.method == PeftMethod.prompt_tuning:
        reason += f" (+{spec.training.peft.num_virtual_tokens} virtual tokens)"
    return DataShape(measured=True, reason=reason, training_file=spec.training_file, examples=len(lengths),
                     rows=len(rows), longest_row_tokens=longest, mean_row_tokens=round(sum(rows) / len(rows), 2),
                     truncated_examples=truncated, max_seq_length=hp.max_seq_length, planned_seq_length=longest,
                     packing=hp.packing, padded=padded)


# --- what the model's chat template makes of the rows (job creation) -------------------------------


def check_tools_rendered(spec: JobSpec, path: str, model_dirs=(), model_path: str | None = None) -> None:
    """Every row of the file at ``path`` with tools (``tools``, the legacy ``functions``, or a preference
    row's ``input.tools``) renders them through the job's chat template; raises DataError naming the first
    line whose template renders it the same without them (service/domain/encoding.py: ToolsNotRendered).
    Where the service cannot build the tokenizer (a hub model) the workers check when they tokenize."""
    from service.domain.datafmt import CHAT, PREFERENCE, DataError, read_jsonl_numbered
    from service.domain.encoding import ToolsNotRendered, _for_template, check_tools_rendered as check, row_tools

    with open(path, "rb") as fh:  # most files name no tools: not parsed again for nothing
        tail = b""
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            window = tail + chunk
            if b'"tools"' in window or b'"functions"' in window:
                break
            tail = chunk[-16:]  # a key split across two reads
        else:
            return
    fmt, rows = read_jsonl_numbered(path)
    if fmt not in (CHAT, PREFERENCE) or not any(row_tools(r if fmt == CHAT else r["input"]) for _, r in rows):
        return
    try:
        tokenizer, _ = tokenizer_for(spec, model_dirs, model_path)
    except TokenizerUnavailable:
        return
    for line, row in rows:
        chat = row if fmt == CHAT else {**row["input"], "messages": row["input"]["messages"] + row["preferred_output"]}
        tools = row_tools(chat)
        if tools:
            try:
                check(tokenizer, _for_template(tokenizer, chat["messages"]), tools)
            except ToolsNotRendered as exc:
                raise DataError(line, str(exc)) from None
