"""Generate the bundled demo data under ``service/demo/data/``.

The demo data is small, synthetic, natural-ish English: simple facts (colours, animal
sounds, baby animals, animal homes, opposites), small-number arithmetic, counting and
day/month sequences, and short farm stories. Everything is derived from the tables below
with a seeded :class:`random.Random`, so running this script again reproduces the committed
files byte for byte::

    python -m service.demo.make_data            # rewrite service/demo/data/*.jsonl
    python -m service.demo.make_data --out DIR  # write somewhere else

Files written (one JSON object per line):

* ``corpus.jsonl`` -- ``{"text"}``: the "textbook" the tiny demo model and its tokenizer are
  trained on. It states about three quarters of the facts the tasks ask about (in plain
  sentences and in the tasks' prompt formats), plus the training stories; the other facts
  and sequences are held out. A model trained on it therefore scores clearly above chance
  but not perfectly, so per-document results differ and mix-ups between documents show.
* ``mc_{train,test}.jsonl`` -- ``{"question", "choices", "answer"}`` (four choices).
* ``cloze_{train,test}.jsonl`` -- ``{"text"}``: a sentence whose last word is predictable.
* ``rolling_{train,test}.jsonl`` -- ``{"text"}``: stories, several longer than the tiny
  model's 128-token context window and a couple of short ones.
* ``gen_short_{train,test}.jsonl`` -- ``{"question", "answer"}``: one-word answers.
* ``gen_long_{train,test}.jsonl`` -- ``{"prompt", "answer"}``: comma-separated sequences.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The committed demo data, which this script writes (the package and its modules read it here).
DATA_DIR = Path(__file__).resolve().parent / "data"
SEED = 20240601

NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip

# (thing, colour) -- "What colour is {thing}?"
COLOURS: list[tuple[str, str]] = [
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
    ("a banana", "yellow"), ("a tomato", "red"), ("a carrot", "orange"), ("a lemon", "yellow"),
    ("a frog", "green"), ("milk", "white"), ("the sun", "yellow"), ("a strawberry", "red"),
    ("a crow", "black"), ("a plum", "purple"), ("chocolate", "brown"), ("the sea", "blue"),
    ("a pumpkin", "orange"), ("a lime", "green"), ("a cherry", "red"), ("a flamingo", "pink"),
    ("a violet", "purple"), ("cotton", "white"), ("soot", "black"), ("a pig", "pink"),
]  # fmt: skip
COLOUR_NAMES = sorted({c for _, c in COLOURS})

# (animal, sound) -- "What does a {animal} say?"
SOUNDS: list[tuple[str, str]] = [
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
    ("pig", "oink"), ("horse", "neigh"), ("owl", "hoot"), ("lion", "roar"), ("bee", "buzz"),
    ("snake", "hiss"), ("mouse", "squeak"), ("frog", "croak"), ("goat", "bleat"),
]  # fmt: skip

# (animal, young) -- "What is a baby {animal} called?"
YOUNG: list[tuple[str, str]] = [
    ("cow", "calf"), ("dog", "puppy"), ("cat", "kitten"), ("sheep", "lamb"), ("horse", "foal"),
    ("frog", "tadpole"), ("duck", "duckling"), ("bear", "cub"), ("pig", "piglet"),
    ("hen", "chick"), ("kangaroo", "joey"), ("deer", "fawn"), ("goose", "gosling"),
    ("owl", "owlet"),
]  # fmt: skip

# (animal, home) -- "Where does a {animal} live?"
HOMES: list[tuple[str, str]] = [
    ("bird", "nest"), ("bee", "hive"), ("spider", "web"), ("rabbit", "burrow"), ("fox", "den"),
    ("horse", "stable"), ("pig", "sty"), ("dog", "kennel"), ("hen", "coop"), ("bear", "cave"),
    ("fish", "pond"), ("cow", "barn"),
]  # fmt: skip

# (word, opposite) -- "What is the opposite of {word}?"
OPPOSITES: list[tuple[str, str]] = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
    ("happy", "sad"), ("wet", "dry"), ("open", "closed"), ("light", "dark"), ("tall", "short"),
    ("full", "empty"), ("early", "late"), ("loud", "quiet"), ("hard", "soft"),
    ("left", "right"), ("first", "last"), ("rich", "poor"), ("young", "old"),
]  # fmt: skip

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Rosa", "Leo", "Nora"]
PLACES = ["a small farm", "a green valley", "a quiet village", "a house by the sea"]

# Share of facts and sequences left out of the training corpus: the tiny model can only
# guess those, which keeps its scores clearly above chance but well below perfect.
HELD_OUT_FRACTION = 0.25


@dataclass(frozen=True)
class Fact:
    """One fact, rendered as a question, its one-word answer and a statement."""

    kind: str
    subject: tuple[str, ...]
    question: str
    answer: str
    statement: str
    """A sentence ending with the answer word (no final full stop)."""
    pool: tuple[str, ...] = ()
    """Answers to draw multiple-choice distractors from; empty for short-answer facts."""


def _facts() -> list[Fact]:
    """Every fact: multiple-choice facts (with a pool) first, then short-answer facts."""
    facts = [
        Fact("colour", (t,), f"What colour is {t}?", c, f"The colour of {t} is {c}",
             tuple(COLOUR_NAMES))
        for t, c in COLOURS
    ]  # fmt: skip
    pool = tuple(s for _, s in SOUNDS)
    facts += [
        Fact("sound", (a,), f"What does a {a} say?", s, f"Every morning the {a} says {s}", pool)
        for a, s in SOUNDS
    ]
    pool = tuple(y for _, y in YOUNG)
    facts += [
        Fact("young", (a,), f"What is a baby {a} called?", y, f"A baby {a} is called a {y}", pool)
        for a, y in YOUNG
    ]
    pool = tuple(h for _, h in HOMES)
    facts += [
        Fact("home", (a,), f"Where does a {a} live?", h, f"The {a} sleeps at home in the {h}",
             pool)
        for a, h in HOMES
    ]  # fmt: skip
    pool = tuple(o for _, o in OPPOSITES)
    facts += [
        Fact("opposite", (w,), f"What is the opposite of {w}?", o, f"The opposite of {w} is {o}",
             pool)
        for w, o in OPPOSITES
    ]  # fmt: skip
    for a in range(7):
        for b in range(7):
            x, y, total = NUMBERS[a], NUMBERS[b], NUMBERS[a + b]
            facts.append(
                Fact("sum", (x, y), f"What is {x} plus {y}?", total,
                     f"If you add {x} and {y} you get {total}")
            )  # fmt: skip
    for i in range(7):
        day, nxt = DAYS[i], DAYS[(i + 1) % 7]
        facts.append(
            Fact("day", (day,), f"What day comes after {day}?", nxt,
                 f"The day after {day} is {nxt}")
        )  # fmt: skip
    for i in range(12):
        month, nxt = MONTHS[i], MONTHS[(i + 1) % 12]
        facts.append(
            Fact("month", (month,), f"What month comes after {month}?", nxt,
                 f"The month after {month} is {nxt}")
        )  # fmt: skip
    for i in range(12):
        number, nxt = NUMBERS[i], NUMBERS[i + 1]
        facts.append(
            Fact("number", (number,), f"What number comes after {number}?", nxt,
                 f"After {number} comes {nxt}")
        )  # fmt: skip
    return facts


def _sequences() -> list[dict[str, str]]:
    """Sequence completions: count from x to y, list the days or months from x to y."""
    items: list[dict[str, str]] = []
    for lo in range(1, 9):
        for hi in range(lo + 3, 13):
            prompt = f"Count from {NUMBERS[lo]} to {NUMBERS[hi]}:"
            items.append({"prompt": prompt, "answer": ", ".join(NUMBERS[lo : hi + 1])})
    for lo in range(4):
        for hi in range(lo + 2, 7):
            prompt = f"List the days from {DAYS[lo]} to {DAYS[hi]}:"
            items.append({"prompt": prompt, "answer": ", ".join(DAYS[lo : hi + 1])})
    for lo in range(0, 8, 2):
        for hi in range(lo + 3, 12, 2):
            prompt = f"List the months from {MONTHS[lo]} to {MONTHS[hi]}:"
            items.append({"prompt": prompt, "answer": ", ".join(MONTHS[lo : hi + 1])})
    return items


def _story(rng: random.Random, facts: list[Fact], n_paragraphs: int) -> str:
    """A farm story of ``n_paragraphs`` short paragraphs that mentions only ``facts``."""
    by_kind: dict[str, list[Fact]] = {}
    for fact in facts:
        by_kind.setdefault(fact.kind, []).append(fact)
    sums = [f for f in by_kind["sum"] if f.subject[0] not in ("zero", "one")]
    name = rng.choice(NAMES)
    friend = rng.choice([n for n in NAMES if n != name])
    paragraphs = [f"Once upon a time, {name} lived in {rng.choice(PLACES)} with {friend}."]
    for _ in range(n_paragraphs):
        sound, colour, young, home, opposite, day = (
            rng.choice(by_kind[kind])
            for kind in ("sound", "colour", "young", "home", "opposite", "day")
        )
        total = rng.choice(sums)
        animal = sound.subject[0]
        sentences = [
            f"On {day.subject[0]}, {name} saw a {animal} and the {animal} said {sound.answer}.",
            f"{friend} pointed at {colour.subject[0]} and said that it was {colour.answer}.",
            f"They found {total.subject[0]} eggs and then {total.subject[1]} more, "
            f"so they had {total.answer} eggs.",
            f"A baby {young.subject[0]} is called a {young.answer}, "
            f"and {name} met a little {young.answer}.",
            f"The {home.subject[0]} went back to its {home.answer} when it got dark.",
            f"The next day was {day.answer}, and {friend} said the opposite of "
            f"{opposite.subject[0]} is {opposite.answer}.",
        ]
        rng.shuffle(sentences)
        paragraphs.append(" ".join(sentences[: rng.randrange(3, 6)]))
    paragraphs.append(f"At night {name} and {friend} went to sleep. The end.")
    return "\n".join(paragraphs)


def _split(rng: random.Random, items: list[Any], n_test: int) -> tuple[list[Any], list[Any]]:
    """Shuffle ``items`` and return ``(train, test)`` with ``n_test`` test items."""
    shuffled = list(items)
    rng.shuffle(shuffled)
    return shuffled[n_test:], shuffled[:n_test]


def build_data(seed: int = SEED) -> dict[str, list[dict[str, Any]]]:
    """Build every demo data file in memory, keyed by file stem (``mc_test``, ...)."""
    rng = random.Random(seed)
    facts = _facts()
    known = [f for f in facts if rng.random() >= HELD_OUT_FRACTION]
    sequences = _sequences()
    known_sequences = [s for s in sequences if rng.random() >= HELD_OUT_FRACTION]
    files: dict[str, list[dict[str, Any]]] = {}

    mc_docs = []
    for fact in facts:
        if not fact.pool:
            continue
        choices = [*rng.sample([c for c in fact.pool if c != fact.answer], 3), fact.answer]
        rng.shuffle(choices)
        mc_docs.append(
            {"question": fact.question, "choices": choices, "answer": choices.index(fact.answer)}
        )
    files["mc_train"], files["mc_test"] = _split(rng, mc_docs, 40)

    cloze_docs = [{"text": fact.statement} for fact in facts]
    files["cloze_train"], files["cloze_test"] = _split(rng, cloze_docs, 40)

    short_docs = [{"question": f.question, "answer": f.answer} for f in facts if not f.pool]
    files["gen_short_train"], files["gen_short_test"] = _split(rng, short_docs, 20)

    files["gen_long_train"], files["gen_long_test"] = _split(rng, sequences, 15)

    # Rolling test set: five long stories (well over 128 tokens) and three short lines.
    long_stories = [{"text": _story(rng, facts, rng.randrange(3, 7))} for _ in range(5)]
    short_texts = [{"text": f.statement + "."} for f in rng.sample(facts, 3)]
    files["rolling_test"] = long_stories + short_texts
    files["rolling_train"] = [{"text": _story(rng, known, rng.randrange(2, 5))} for _ in range(6)]

    corpus = [f"{f.statement}." for f in known]
    corpus += [f"Question: {f.question}\nAnswer: {f.answer}" for f in known]
    corpus += [f"{s['prompt']} {s['answer']}." for s in known_sequences]
    corpus += [doc["text"] for doc in files["rolling_train"]]
    corpus += [_story(rng, known, rng.randrange(2, 5)) for _ in range(20)]
    rng.shuffle(corpus)
    files["corpus"] = [{"text": text} for text in corpus]
    return files


def write_data(out_dir: Path = DATA_DIR, seed: int = SEED) -> list[Path]:
    """Write every demo data file as JSONL into ``out_dir`` and return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, docs in build_data(seed).items():
        path = out_dir / f"{stem}.jsonl"
        lines = [json.dumps(doc, ensure_ascii=True) for doc in docs]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: regenerate the demo data files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output directory")
    parser.add_argument("--seed", type=int, default=SEED, help="random seed")
    args = parser.parse_args(argv)
    for path in write_data(args.out, args.seed):
        print(f"{path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
