"""Write examples/chat/chats.jsonl: the README's "fine-tune a chat model" walkthrough data.

A few hundred short conversations in OpenAI's fine-tuning format (``{"messages": [...]}``)
that teach a terse assistant to answer arithmetic, unit and spelling questions in one
sentence: some with a system message, some with two turns, a few with an assistant turn
marked ``"weight": 0`` (a bad answer shown in context, not learned). Deterministic: running
it again writes the same file (``tests/cli/test_examples.py`` checks), so edit this script,
not the data. ``python examples/chat/make_chats.py [OUT]``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYSTEM = "You are a terse assistant. Answer in one sentence."
UNITS = [("metres", "centimetres", 100), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("kilometres", "metres", 1000)]  # fmt: skip
WORDS = ["apple", "river", "garden", "window", "planet", "yellow", "pencil", "bridge", "silver",
         "candle", "forest", "orange", "rocket", "winter", "violet", "harbor"]  # fmt: skip


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def _product(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def _units(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    return f"How many {small} are in {n} {big}?", f"There are {n * factor} {small} in {n} {big}."


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How do you spell {word} backwards?", f"{word} backwards is {word[::-1]}."


def _length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


ASKS = [_sum, _product, _units, _spell, _length]


def conversation(rng: random.Random) -> dict[str, list[dict[str, object]]]:
    messages: list[dict[str, object]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": SYSTEM})
    for turn in range(1 if rng.random() < 0.75 else 2):
        question, answer = rng.choice(ASKS)(rng)
        messages.append({"role": "user", "content": question})
        if turn == 0 and rng.random() < 0.05:  # a wrong answer in context, then the fix
            messages.append({"role": "assistant", "content": "I am not sure.", "weight": 0})
            messages.append({"role": "user", "content": "Please answer."})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def lines(n: int = 400, seed: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps(conversation(rng), ensure_ascii=False) for _ in range(n)]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("chats.jsonl")
    out.write_text("\n".join(lines()) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
