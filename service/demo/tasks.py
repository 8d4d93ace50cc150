"""lm-eval (0.4.13) task and group YAMLs for the bundled demo data.

:func:`write_demo_tasks` writes one YAML per task plus the group YAML into a directory to
pass to lm-eval as ``include_path``. The YAMLs point at the committed JSONL files by
ABSOLUTE path, because lm-eval resolves relative ``data_files`` against the current
working directory rather than against the YAML file.

Tasks (every one has a ``train`` split for few-shot examples and a ``test`` split):

* ``demo_mc`` -- multiple_choice, four choices; ``acc``, ``acc_norm``.
* ``demo_cloze`` -- loglikelihood of a sentence's last word (like lambada);
  ``perplexity``, ``acc``.
* ``demo_rolling`` -- loglikelihood_rolling over stories (like wikitext), several longer
  than the tiny model's context window; ``word_perplexity``, ``byte_perplexity``,
  ``bits_per_byte``.
* ``demo_gen_short`` -- generate_until ``"\\n"``, at most 12 tokens; ``exact_match``.
* ``demo_gen_long`` -- generate_until ``"."``, at most 40 tokens; ``exact_match``
  (case-insensitive).
* ``demo`` -- group of all five, aggregating ``acc`` (size-weighted) over the tasks that
  report it. lm-eval says so at the end of an evaluation ("metric 'acc,none' is missing in 3/5
  tasks"): that is the design, and lm-eval 0.4.13's group config has no way to name the tasks
  an aggregate covers short of another group level, which would change the results' shape.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from rayeval.service.demo.make_data import DATA_DIR

logger = logging.getLogger(__name__)

DEMO_GROUP = "demo"
DEMO_TASKS = ("demo_mc", "demo_cloze", "demo_rolling", "demo_gen_short", "demo_gen_long")

# Leading/trailing whitespace is not part of an answer: the model generates " five" after
# "Answer:" because few-shot targets follow the default " " target delimiter.
_STRIP_WHITESPACE = [r"^\s+", r"\s+$"]
_METADATA = {"version": 1.0}


class _Dumper(yaml.SafeDumper):
    """A safe YAML dumper that writes strings with newlines readably."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    """Multi-line text as a literal block, other strings with a newline double-quoted."""
    style: str | None = None
    if "\n" in data.strip():
        style = "|"
    elif "\n" in data:
        style = '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def _dataset(stem: str, data_dir: Path) -> dict[str, Any]:
    """The ``dataset_*`` and split keys for the ``{stem}_train`` / ``{stem}_test`` files."""
    return {
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "train": str((data_dir / f"{stem}_train.jsonl").resolve()),
                "test": str((data_dir / f"{stem}_test.jsonl").resolve()),
            }
        },
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
    }


#: Every demo task's lm-eval config, but for its data files: ``_data`` names them (see
#: :func:`_dataset`).
_TASKS: dict[str, dict[str, Any]] = {
    "demo_mc": {
        "task": "demo_mc",
        "_data": "mc",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "doc_to_choice": "{{choices}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    },
    "demo_cloze": {
        "task": "demo_cloze",
        "_data": "cloze",
        "output_type": "loglikelihood",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' ' + text.split(' ')[-1]}}",
        "target_delimiter": "",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    },
    "demo_rolling": {
        "task": "demo_rolling",
        "_data": "rolling",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        # lm-eval's defaults for these metrics, spelled out (lm-eval warns when they are not).
        "metric_list": [
            {
                "metric": "word_perplexity",
                "aggregation": "weighted_perplexity",
                "higher_is_better": False,
            },
            {
                "metric": "byte_perplexity",
                "aggregation": "weighted_perplexity",
                "higher_is_better": False,
            },
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
    },
    "demo_gen_short": {
        "task": "demo_gen_short",
        "_data": "gen_short",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "regexes_to_ignore": _STRIP_WHITESPACE,
            }
        ],
    },
    "demo_gen_long": {
        "task": "demo_gen_long",
        "_data": "gen_long",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["."], "max_gen_toks": 40, "do_sample": False},
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "regexes_to_ignore": _STRIP_WHITESPACE,
            }
        ],
    },
}


def task_configs(data_dir: Path = DATA_DIR) -> dict[str, dict[str, Any]]:
    """Return the lm-eval config dict of every demo task and of the group, keyed by name."""
    configs: dict[str, dict[str, Any]] = {}
    for name, spec in _TASKS.items():
        config = {key: value for key, value in spec.items() if key != "_data"}
        configs[name] = {
            "task": config.pop("task"),
            **_dataset(spec["_data"], data_dir),
            **config,
            "metadata": dict(_METADATA),
        }
    configs[DEMO_GROUP] = {
        "group": DEMO_GROUP,
        "task": list(DEMO_TASKS),
        "aggregate_metric_list": [
            {"metric": "acc", "aggregation": "mean", "weight_by_size": True},
        ],
        "metadata": dict(_METADATA),
    }
    return configs


def write_demo_tasks(out_dir: Path) -> Path:
    """Write the demo task and group YAMLs into ``out_dir`` (created if missing).

    Each file is named ``<task or group name>.yaml``; the data paths inside are absolute.

    Returns:
        ``out_dir``, ready to pass to lm-eval as ``include_path``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, config in task_configs().items():
        path = out_dir / f"{name}.yaml"
        path.write_text(
            yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=100), encoding="utf-8"
        )
    logger.debug("wrote %d demo task YAMLs to %s", len(DEMO_TASKS) + 1, out_dir)
    return out_dir
