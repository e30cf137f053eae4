"""Writes the small, repetitive (hence quickly learnable) example datasets beside this file.

    python examples/data/make_data.py

Four formats: chat.jsonl (messages), completion.jsonl (prompt/completion), text.jsonl (text), and
preference.jsonl (DPO: input, preferred_output, non_preferred_output — the answer preferred over "I do
not know."). Deterministic: the same files every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = ["apple", "leaf", "sky", "sun", "night", "snow", "carrot", "plum"]


def rows(n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        i = rng.randrange(len(THINGS))
        yield THINGS[i], COLOURS[i]


def main() -> None:
    with open(HERE / "chat.jsonl", "w") as f:
        for thing, colour in rows():
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "You name colours."},
                {"role": "user", "content": f"What colour is the {thing}?"},
                {"role": "assistant", "content": f"The {thing} is {colour}."},
            ]}) + "\n")
    with open(HERE / "completion.jsonl", "w") as f:
        for thing, colour in rows(seed=1):
            f.write(json.dumps({"prompt": f"Colour of the {thing}:", "completion": f" {colour}."}) + "\n")
    with open(HERE / "text.jsonl", "w") as f:
        for thing, colour in rows(seed=2):
            f.write(json.dumps({"text": f"The {thing} is {colour}. The {thing} is {colour}."}) + "\n")
    with open(HERE / "chat-validation.jsonl", "w") as f:
        for thing, colour in rows(n=8, seed=3):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What colour is the {thing}?"},
                {"role": "assistant", "content": f"The {thing} is {colour}."},
            ]}) + "\n")

    for name, n, seed in (("preference.jsonl", 64, 4), ("preference-validation.jsonl", 8, 5)):
        with open(HERE / name, "w") as f:
            for thing, colour in rows(n=n, seed=seed):
                f.write(json.dumps({
                    "input": {"messages": [{"role": "user", "content": f"What colour is the {thing}?"}]},
                    "preferred_output": [{"role": "assistant", "content": f"The {thing} is {colour}."}],
                    "non_preferred_output": [{"role": "assistant", "content": "I do not know."}],
                }) + "\n")


if __name__ == "__main__":
    main()
