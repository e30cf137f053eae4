"""What a training row becomes in tokens: the one rule for the workers' loader (workers/data.py) and the
planner's view of the data (service/memory/data.py), torch-free.

Four formats, the format told by the keys of the first row (service/domain/datafmt.py):
- chat: ``{"messages": [{"role": "system|user|assistant|tool", "content": "..."}, ...], "tools"?: [...]}`` —
  rendered with the tokenizer's chat template (``tools``, or the legacy ``functions``, passed to it as
  transformers' ``apply_chat_template(tools=…)`` does); loss only on assistant turns (content, tool calls
  and end tag, not the header), except a turn with OpenAI's ``"weight": 0``, whose labels are all -100;
  an assistant turn with ``tool_calls`` trains on the calls (the legacy ``function_call`` is one call). A
  row with tools whose template renders it the same without them cannot show the model its tools:
  :class:`ToolsNotRendered`;
- prompt/completion: ``{"prompt": "...", "completion": "..."}`` — loss only on the completion;
- text: ``{"text": "..."}`` — loss on every token;
- preference (DPO): ``{"input": {"messages": [...]}, "preferred_output": [msg], "non_preferred_output": [msg]}``
  — two sequences (:func:`encode_preference`), the input's messages then each output, labels on the
  output's turn only (the input's assistant turns are context).

Labels are aligned with inputs (Hugging Face convention): the loss shifts them by one. -100 marks a
position that does not count. Each example is then cut to ``max_seq_length`` (:func:`truncate`) and,
with packing, concatenated into rows of ``max_seq_length`` tokens (:func:`pack`); :func:`row_lengths`
is the same two steps on lengths alone, which is all the planner needs. A packed row holds pieces of
several examples: :func:`pack_segments` says which (their lengths, in order), and
:func:`packed_position_ids` gives each piece positions that start again at 0, from which the model
builds a block-diagonal causal mask (attention never crosses from one example into another).

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
# It renders OpenAI's tools (a tools block first) and an assistant turn's tool calls (as JSON after its
# content); a row with neither renders as it always has.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ToolsNotRendered(ValueError):
    """The chat template renders a row the same with its tools as without them: a model trained on it
    would never see the tools it is meant to call."""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages, add_generation_prompt=False, tools=None) -> str:
    if not messages:
        return ""
    extra = {"tools": tools} if tools else {}  # only when there are some: a tokenizer-like may not take the keyword
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def row_tools(row: dict) -> list[dict] | None:
    """A chat row's tools as the template is given them: OpenAI's ``tools``, or its legacy ``functions``
    turned into tools (``{"type": "function", "function": f}``); None without either."""
    if row.get("tools"):
        return row["tools"]
    if row.get("functions"):
        return [{"type": "function", "function": f} for f in row["functions"]]
    return None


def _plain_messages(messages: list[dict]) -> list[dict]:
    """The messages without memfit's reading of them (``weight``), and a legacy ``function_call`` as the
    one tool call it is."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "weight"}
        if m.get("function_call") and not m.get("tool_calls"):
            call = m.pop("function_call")
            m["tool_calls"] = [{"type": "function", "function": call}]
        out.append(m)
    return out


def check_tools_rendered(tokenizer, messages: list[dict], tools: list[dict] | None) -> None:
    """Raise ToolsNotRendered when ``tools`` are given and the template renders the row without them."""
    if tools and _render(tokenizer, messages, tools=tools) == _render(tokenizer, messages):
        raise ToolsNotRendered(
            "the row has tools, but the model's chat template does not render them (it renders the row the same "
            "without them), so the model would never see the tools it is meant to call: use a model whose chat "
            "template takes `tools`, or leave the tools out")


def _delta(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("the chat template does not render prefixes consistently")
    return longer[len(shorter) :]


def _for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as the chat template is given them. An assistant turn may be tool calls with a null
    content (datafmt accepts OpenAI's form); a template that knows nothing of ``tool_calls`` (memfit's
    default) would render that null as "None", so it is given the calls as JSON text to learn instead."""
    messages = _plain_messages(messages)
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
    if fmt == "preference":
        raise ValueError("a preference row is two sequences: encode it with encode_preference")
    if fmt == "reinforcement":  # the prompt only: the policy writes the completion (workers/rl.py)
        ids = encode_prompt(tokenizer, row)
        return ids, [IGNORE] * len(ids)
    return _encode_chat(tokenizer, row["messages"], row_tools(row), bos, eos)


def _encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None, bos: list[int], eos: list[int],
                 ) -> tuple[list[int], list[int]]:
    ids, labels = list(bos), [IGNORE] * len(bos)
    msgs = _for_template(tokenizer, messages)
    check_tools_rendered(tokenizer, msgs, tools)
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            header = _delta(_render(tokenizer, msgs[:i], add_generation_prompt=True, tools=tools), done)
            full = _render(tokenizer, msgs[: i + 1], tools=tools)
            body = _delta(full, done + header)
            h, b = _ids(tokenizer, header), _ids(tokenizer, body)
            ids += h + b
            # OpenAI's per-message weight: 0 keeps the turn as context and trains nothing on it
            labels += [IGNORE] * len(h) + (b if messages[i].get("weight", 1) != 0 else [IGNORE] * len(b))
        else:
            full = _render(tokenizer, msgs[: i + 1], tools=tools)
            piece = _ids(tokenizer, _delta(full, done))
            ids += piece
            labels += [IGNORE] * len(piece)
        done = full
    ids += eos
    # the end of the row is not learnt after a last turn of weight 0
    untrained_end = messages[-1].get("role") == "assistant" and messages[-1].get("weight", 1) == 0
    labels += [IGNORE] * len(eos) if untrained_end else eos
    return ids, labels


def encode_prompt(tokenizer, row: dict) -> list[int]:
    """A reinforcement row's prompt: BOS, its messages (OpenAI's ``developer`` role read as ``system``) and the
    template's assistant header, which the policy's sample follows — as the serving engine renders a chat."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in row["messages"]]
    msgs = _for_template(tokenizer, messages)
    tools = row_tools(row)
    check_tools_rendered(tokenizer, msgs, tools)
    return bos + _ids(tokenizer, _render(tokenizer, msgs, add_generation_prompt=True, tools=tools))


def encode_preference(tokenizer, row: dict) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """A preference row's (chosen, rejected) sequences, each (input_ids, labels): the input's messages
    (its assistant turns as context, weight 0) then the output's assistant turn, the only one labelled.
    The two share the prompt's tokens; DPO sums each one's log-probabilities over its labels."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    inp = row["input"]
    context = [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in inp["messages"]]
    tools = row_tools(inp)
    return (_encode_chat(tokenizer, context + row["preferred_output"], tools, bos, eos),
            _encode_chat(tokenizer, context + row["non_preferred_output"], tools, bos, eos))


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


def pack_segments(example_lengths: list[int], max_seq_length: int) -> list[list[int]]:
    """The rows :func:`pack` makes from examples of these (truncated) lengths, each as the lengths of the
    pieces of examples it holds, in order: an example that does not fit in what is left of a row goes on
    in the next one (the same rows as pack's, whose lengths are ``row_lengths(..., packing=True)``)."""
    rows: list[list[int]] = [[]]
    room = max_seq_length
    for n in example_lengths:
        while n > 0:
            if room == 0:
                rows.append([])
                room = max_seq_length
            piece = min(n, room)
            rows[-1].append(piece)
            room -= piece
            n -= piece
    return [r for r in rows if r]


def packed_position_ids(segments: list[int]) -> list[int]:
    """A packed row's position ids: 0, 1, … again at the start of each piece. transformers reads a restart
    as the start of another sequence (masking_utils.find_packed_sequence_indices) and masks attention
    block-diagonally, so no token attends to another example's (workers/data.py collate)."""
    return [p for n in segments for p in range(n)]


def row_lengths(example_lengths: list[int], max_seq_length: int, packing: bool) -> list[int]:
    """The length of every training row, from the examples' encoded lengths: :func:`truncate`, then
    :func:`pack` when packing (full rows of max_seq_length and a shorter last one)."""
    cut = [min(n, max_seq_length) for n in example_lengths]
    if not packing:
        return cut
    total = sum(cut)
    full, rest = divmod(total, max_seq_length)
    return [max_seq_length] * full + ([rest] if rest else [])
