"""Generate ``demo.txt``: short English stories from a small seeded grammar.

The demo needs text whose structure a tiny byte-level model learns within a few hundred
steps (spelling, common words, punctuation, recurring names), so that the loss visibly falls,
while staying small enough to ship in the package. A seeded grammar gives that with no
download and no licence question, and the same bytes on every run.

Run ``python -m trainer.assets.make_corpus`` to rewrite ``demo.txt`` next to this file.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["DEMO_PATH", "generate"]

DEMO_PATH = Path(__file__).with_name("demo.txt")
TARGET_BYTES = 200_000
SEED = 20240520

NAMES = [
    "Anna", "Tom", "the miller", "old Martha", "the young baker", "Peter", "the fisherman",
    "Clara", "the shepherd", "Jonas", "the schoolteacher", "little Ben", "the blacksmith",
    "Rosa", "the farmer's wife", "Samuel",
]  # fmt: skip
PLACES = [
    "the river", "the market", "the mill", "the old bridge", "the forest", "the harbour",
    "the hill above the village", "the bakery", "the church", "the meadow", "the well",
    "the schoolhouse", "the orchard", "the quiet road to the town",
]  # fmt: skip
TIMES = [
    "At dawn", "In the morning", "Before noon", "After lunch", "In the afternoon",
    "Late in the evening", "At sunset", "That night", "On Sunday", "Early on Monday",
    "When the bells rang", "Once the rain had stopped",
]  # fmt: skip
WEATHER = [
    "the sky was grey and low", "a cold wind came from the sea", "the sun was warm",
    "a light rain was falling", "the fog lay thick over the fields", "the air smelled of bread",
    "the snow had begun to melt", "the stars were bright and clear",
]  # fmt: skip
THINGS = [
    "a basket of apples", "a loaf of bread", "a letter", "a small wooden box", "a lantern",
    "a sack of flour", "a bundle of wood", "a silver coin", "a jar of honey", "an old map",
    "a net full of fish", "a pair of new boots", "a bunch of flowers", "a heavy key",
]  # fmt: skip
GO_VERBS = ["walked to", "went down to", "hurried to", "climbed up to", "wandered to"]
DO_VERBS = ["found", "carried", "sold", "bought", "lost", "gave away", "mended", "hid"]
DONE_VERBS = ["found", "carried", "sold", "bought", "lost", "given away", "mended", "hidden"]
FEELINGS = ["happy", "tired", "worried", "surprised", "glad", "afraid", "proud", "quiet"]
SAYINGS = [
    "We shall see what tomorrow brings.",
    "It is better to ask than to lose the way.",
    "A good neighbour is worth more than gold.",
    "The river does not wait for anyone.",
    "Bread is best when it is shared.",
    "Slow hands make good work.",
    "There is always time for a cup of tea.",
    "Nobody knows the forest like the wind.",
]


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _sentence(rng: random.Random, who: str) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return f"{rng.choice(TIMES)}, {who} {rng.choice(GO_VERBS)} {rng.choice(PLACES)}."
    if kind == 1:
        return f"{_cap(rng.choice(WEATHER))}, and {who} felt {rng.choice(FEELINGS)}."
    if kind == 2:
        return f"{_cap(who)} {rng.choice(DO_VERBS)} {rng.choice(THINGS)} near {rng.choice(PLACES)}."
    if kind == 3:
        other = rng.choice([n for n in NAMES if n != who])
        return f'"{rng.choice(SAYINGS)[:-1]}," said {who} to {other}.'
    if kind == 4:
        other = rng.choice([n for n in NAMES if n != who])
        return (
            f"{_cap(who)} met {other} at {rng.choice(PLACES)}, and they talked about "
            f"{rng.choice(THINGS)} until {rng.choice(WEATHER)}."
        )
    if kind == 5:
        count = rng.choice(["two", "three", "four", "five", "seven", "ten"])
        return f"There were {count} boats at {rng.choice(PLACES)}, but {who} did not count them."
    other = rng.choice([n for n in NAMES if n != who])
    return (
        f"{_cap(who)} was {rng.choice(FEELINGS)}, because {other} had "
        f"{rng.choice(DONE_VERBS)} {rng.choice(THINGS)}."
    )


def generate(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> str:
    """Paragraphs of seeded story text, stopping at the first paragraph past ``target_bytes``."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        who = rng.choice(NAMES)
        sentences = [_sentence(rng, who) for _ in range(rng.randint(3, 7))]
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    DEMO_PATH.write_text(generate(), encoding="utf-8")
    print(f"wrote {DEMO_PATH} ({DEMO_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
