"""lm-eval tasks shaped like the common benchmarks, over the bundled demo data.

For benchmarks and tests of how much model work each request type costs: the *shape* of the
requests matters (how long the shared context is, how many choices, how long each), not the
words. Built from the demo corpus and multiple-choice questions, so no dataset hub is needed.

* ``shaped_hellaswag`` -- 0-shot, a ~40-token story opening and four multi-token endings
  (the next sentence of the story and three sentences of other stories).
* ``shaped_arc`` -- 10-shot (random few-shot examples per document), a question and four short
  choices (the demo multiple-choice questions).
* ``shaped_mmlu`` -- 5-shot with the same first five examples for every document (lm-eval's
  ``first_n`` sampler, as MMLU's dev split), lettered options, one-token answers ``A``-``D``.
* ``shaped_wikitext`` -- ``loglikelihood_rolling`` over the stories.
* ``shaped_generation`` -- ``generate_until`` after a short question, few-shot.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

from rayeval.service.demo import DATA_DIR

SHAPED_TASKS = (
    "shaped_hellaswag",
    "shaped_arc",
    "shaped_mmlu",
    "shaped_wikitext",
    "shaped_generation",
)
#: Few-shot examples each shaped task is evaluated with (lm-eval's ``num_fewshot``).
SHAPED_FEWSHOT = {"shaped_arc": 10, "shaped_mmlu": 5, "shaped_generation": 3}


def _read(name: str) -> list[dict[str, Any]]:
    lines = (DATA_DIR / name).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _sentences(text: str) -> list[str]:
    parts = [p.strip() for p in text.replace("\n", " ").split(".")]
    return [p + "." for p in parts if len(p.split()) >= 4]


def _hellaswag_docs(rng: random.Random, count: int) -> list[dict[str, Any]]:
    stories = [
        _sentences(d["text"]) for d in _read("corpus.jsonl") if len(_sentences(d["text"])) >= 4
    ]
    pool = [s for story in stories for s in story]
    docs = []
    for index in range(count):
        story = stories[index % len(stories)]
        start = rng.randrange(0, len(story) - 3)
        context = " ".join(story[start : start + 3])
        endings = [story[start + 3], *rng.sample(pool, 3)]
        rng.shuffle(endings)
        docs.append({"ctx": context, "endings": endings, "label": endings.index(story[start + 3])})
    return docs


def _mmlu_doc(doc: dict[str, Any]) -> dict[str, Any]:
    options = "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", doc["choices"], strict=True))
    return {"question": doc["question"], "options": options, "answer": doc["answer"]}


def _write_jsonl(path: Path, docs: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return str(path.resolve())


def _dataset(out_dir: Path, stem: str, train: list[Any], test: list[Any]) -> dict[str, Any]:
    return {
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "train": _write_jsonl(out_dir / f"{stem}_train.jsonl", train),
                "test": _write_jsonl(out_dir / f"{stem}_test.jsonl", test),
            }
        },
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
    }


def write_shaped_tasks(out_dir: Path, seed: int = 0, docs: int = 40) -> Path:
    """Write the shaped tasks' data and YAMLs into ``out_dir`` (an lm-eval ``include_path``).

    Args:
        out_dir: Directory to write (created if missing).
        seed: Seed of the synthetic documents.
        docs: Test documents per task (the demo data has at most 40 questions).

    Returns:
        ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, config in _shaped_configs(out_dir, random.Random(seed), docs).items():
        config = {"task": name, **config, "metadata": {"version": 1.0}}
        if name in SHAPED_FEWSHOT:
            config["num_fewshot"] = SHAPED_FEWSHOT[name]
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir


def _shaped_configs(out_dir: Path, rng: random.Random, docs: int) -> dict[str, dict[str, Any]]:
    """Each shaped task's config (its data files written under ``out_dir``)."""
    hellaswag = _hellaswag_docs(rng, docs + 20)
    mc_train, mc_test = _read("mc_train.jsonl"), _read("mc_test.jsonl")[:docs]
    gen_train, gen_test = _read("gen_short_train.jsonl"), _read("gen_short_test.jsonl")[:docs]
    rolling = _read("rolling_train.jsonl") + _read("rolling_test.jsonl")
    acc = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    return {
        "shaped_hellaswag": {
            **_dataset(out_dir, "hellaswag", hellaswag[docs:], hellaswag[:docs]),
            "output_type": "multiple_choice",
            "doc_to_text": "{{ctx}}",
            "doc_to_target": "{{label}}",
            "doc_to_choice": "{{endings}}",
            "metric_list": [*acc, {"metric": "acc_norm", "aggregation": "mean"}],
        },
        "shaped_arc": {
            **_dataset(out_dir, "arc", mc_train, mc_test),
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{answer}}",
            "doc_to_choice": "{{choices}}",
            "metric_list": acc,
        },
        "shaped_mmlu": {
            **_dataset(
                out_dir, "mmlu", [_mmlu_doc(d) for d in mc_train], [_mmlu_doc(d) for d in mc_test]
            ),
            "output_type": "multiple_choice",
            "fewshot_config": {"sampler": "first_n"},
            "doc_to_text": "{{question}}\n{{options}}\nAnswer:",
            "doc_to_target": "{{answer}}",
            "doc_to_choice": ["A", "B", "C", "D"],
            "metric_list": acc,
        },
        "shaped_wikitext": {
            **_dataset(out_dir, "wikitext", rolling[:2], rolling[2:]),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}],
        },
        "shaped_generation": {
            **_dataset(out_dir, "generation", gen_train, gen_test),
            "output_type": "generate_until",
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean"}],
        },
    }
