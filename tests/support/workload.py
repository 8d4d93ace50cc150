"""Synthetic lm-eval requests for ``bench_driver.py``, and a weightless model to tokenise them.

``mmlu_instances(n)``: ``loglikelihood`` Instances shaped as MMLU multiple choice, as lm-eval's
``mmlu`` task builds them (0-shot): a header naming one of 57 subjects, a question, four lettered
choices and ``Answer:``; each question makes 4 requests with the one-token continuations
`` A`` .. `` D`` behind the same context string. ``generation_instances(n)``: ``generate_until``
Instances shaped as a GSM8K-style question (greedy, ``until`` stop strings, ``max_gen_toks``).
Texts are random words, so sizes are set in tokens of the tokenizer used. Every question is
different, so nothing is answered twice.

``bench_model(root)``: a model directory with the bundled demo tokenizer and a Llama config whose
window is 4096 tokens, and no weights: the driver builds its tokenizer over a meta-device model;
the simulated ranks load nothing.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

SUBJECTS = 57
WINDOW = 4096
LETTERS = ("A", "B", "C", "D")
#: Characters per word drawn (the demo tokenizer makes about one token of 2-3 characters).
_SYLLABLES = ("ta", "ne", "ro", "mi", "sal", "ter", "con", "ing", "ed", "pro", "ly", "at")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


def mmlu_instances(count: int, seed: int = 0, question_words: tuple[int, int] = (5, 45)) -> list:
    """``count`` loglikelihood Instances (a multiple of 4 is used: 4 per question).

    Args:
        count: Requests wanted.
        seed: Of the random texts.
        question_words: Least and most words of a question (choices add 4 x 1-5 words).
    """
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    instances: list[Any] = []
    for question in range(count // 4):
        subject = question % SUBJECTS
        choices = [_words(rng, rng.randint(1, 5)) for _ in LETTERS]
        body = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, choices, strict=True))
        context = (
            f"The following are multiple choice questions (with answers) about subject "
            f"{subject}.\n\n{_words(rng, rng.randint(*question_words))}\n{body}\nAnswer:"
        )
        doc = {"question": context, "choices": choices, "answer": question % 4}
        for index, letter in enumerate(LETTERS):
            instances.append(
                Instance(
                    request_type="loglikelihood",
                    doc=doc,
                    arguments=(context, f" {letter}"),
                    idx=index,
                    metadata=(f"sim_mmlu_{subject}", question, 1),
                )
            )
    return instances


def generation_instances(
    count: int, seed: int = 0, max_gen_toks: int = 256, question_words: tuple[int, int] = (15, 60)
) -> list:
    """``count`` greedy generate_until Instances, one per question."""
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    kwargs = {"until": ["Question:", "\n\n"], "do_sample": False, "max_gen_toks": max_gen_toks}
    return [
        Instance(
            request_type="generate_until",
            doc={"question": question},
            arguments=(f"Question: {_words(rng, rng.randint(*question_words))}\nAnswer:", kwargs),
            idx=0,
            metadata=("sim_gsm", question, 1),
        )
        for question in range(count)
    ]


def bench_model(root: Path, demo_model: Path | None = None) -> Path:
    """A weightless model directory (demo tokenizer, 4096-token Llama config) under ``root``
    (``demo_model``: the built demo model to copy from; default: built under ``root``)."""
    target = root / "bench-driver-model"
    if (target / "config.json").exists():
        return target
    if demo_model is None:
        from rayeval.service.demo import ensure_demo_assets

        demo_model = ensure_demo_assets(root / "demo").model_dir
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(demo_model / name, target / name)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        config = json.loads((demo_model / name).read_text())
        config[key] = WINDOW
        (target / name).write_text(json.dumps(config, indent=2))
    return target
