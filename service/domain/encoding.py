"""What a training row becomes in tokens: the one rule for the workers' loader (workers/data.py) and the
planner's view of the data (service/memory/data.py), torch-free.

Three formats, the format told by the keys of the first row (service/domain/datafmt.py):
- chat: ``{"messages": [{"role": "system|user|assistant|tool", "content": "..."}, ...]}`` — rendered with
  the tokenizer's chat template; loss only on assistant turns (content and end tag, not the header);
  an assistant turn that is only ``tool_calls`` trains on the calls;
- prompt/completion: ``{"prompt": "...", "completion": "..."}`` — loss only on the completion;
- text: ``{"text": "..."}`` — loss on every token.

Labels are aligned with inputs (Hugging Face convention): the loss shifts them by one. -100 marks a
position that does not count. Each example is then cut to ``max_seq_length`` (:func:`truncate`) and,
with packing, concatenated into rows of ``max_seq_length`` tokens (:func:`pack`); :func:`row_lengths`
is the same two steps on lengths alone, which is all the planner needs.

``tokenizer`` is anything with the slice of a transformers tokenizer used here: ``tokenizer(text,
add_special_tokens=False)["input_ids"]``, ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=…)``, ``bos_token_id``, ``eos_token_id`` and ``chat_template`` — the workers pass
the transformers tokenizer itself, the service a ``tokenizers``-based one that renders templates the
way transformers does (service/memory/data.py: JsonTokenizer).
"""

from __future__ import annotations

import json

IGNORE = -100
# The chat template a tokenizer that ships none is given (workers/models.py: load_tokenizer; the presets'
# too): role tag, newline, content, end tag.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _delta(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("the chat template does not render prefixes consistently")
    return longer[len(shorter) :]


def _for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as the chat template is given them. An assistant turn may be tool calls with a null
    content (datafmt accepts OpenAI's form); a template that knows nothing of ``tool_calls`` (memfit's
    default) would render that null as "None", so it is given the calls as JSON text to learn instead."""
    if "tool_calls" in (getattr(tokenizer, "chat_template", None) or ""):
        return messages
    return [{**m, "content": json.dumps(m["tool_calls"])} if m.get("content") is None and m.get("tool_calls")
            else m for m in messages]


def encode_example(tokenizer, row: dict, fmt: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one row. Each rendered piece is tokenized on its own so that the mask
    boundary is exact: the template's role tags are special tokens, so pieces never merge across."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        ids = bos + _ids(tokenizer, row["text"]) + eos
        return ids, list(ids)
    if fmt == "prompt_completion":
        prompt = bos + _ids(tokenizer, row["prompt"])
        completion = _ids(tokenizer, row["completion"]) + eos
        return prompt + completion, [IGNORE] * len(prompt) + completion
    ids, labels = list(bos), [IGNORE] * len(bos)
    msgs = _for_template(tokenizer, row["messages"])
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            header = _delta(_render(tokenizer, msgs[:i], add_generation_prompt=True), done)
            full = _render(tokenizer, msgs[: i + 1])
            body = _delta(full, done + header)
            h, b = _ids(tokenizer, header), _ids(tokenizer, body)
            ids += h + b
            labels += [IGNORE] * len(h) + b
        else:
            full = _render(tokenizer, msgs[: i + 1])
            piece = _ids(tokenizer, _delta(full, done))
            ids += piece
            labels += [IGNORE] * len(piece)
        done = full
    ids += eos
    labels += eos
    return ids, labels


def truncate(examples, max_seq_length: int):
    """Each example cut to its first ``max_seq_length`` tokens (inputs and labels alike)."""
    return [(i[:max_seq_length], l[:max_seq_length]) for i, l in examples]


def pack(examples, max_seq_length: int):
    """Concatenate examples into rows of max_seq_length tokens. The first token of each example gets
    label -100 so that no position learns to predict across a document boundary."""
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    for ids, labels in examples:
        flat_ids += ids
        flat_labels += [IGNORE] + labels[1:]
    rows = []
    for start in range(0, len(flat_ids), max_seq_length):
        rows.append((flat_ids[start : start + max_seq_length], flat_labels[start : start + max_seq_length]))
    return rows


def row_lengths(example_lengths: list[int], max_seq_length: int, packing: bool) -> list[int]:
    """The length of every training row, from the examples' encoded lengths: :func:`truncate`, then
    :func:`pack` when packing (full rows of max_seq_length and a shorter last one)."""
    cut = [min(n, max_seq_length) for n in example_lengths]
    if not packing:
        return cut
    total = sum(cut)
    full, rest = divmod(total, max_seq_length)
    return [max_seq_length] * full + ([rest] if rest else [])
