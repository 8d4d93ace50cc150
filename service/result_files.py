"""lm-eval's output files on disk: one run's results file and the samples files beside it.

``lm_eval run --output_path OUT --log_samples`` (and ``rayeval run``, and ``rayeval results
--output_path``) write ``OUT/<model>/results_<date>.json`` and, per task,
``samples_<task>_<date>.jsonl`` beside it. :func:`read_run` finds one run's files from ``OUT``,
``OUT/<model>`` or the results file itself, and reads them as a comparison reads an evaluation
(:class:`rayeval.service.comparison.EvaluationSamples`); :func:`read_lm_eval_files` and
:func:`write_lm_eval_files` read and write one run's files as text. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError
from rayeval.service.comparison import EvaluationSamples, IncomparableError


def find_results_file(path: Path) -> Path:
    """The one results file at ``path``: the file itself, or the only ``results_*.json`` under
    the directory.

    Raises:
        ConfigError: nothing there, no results file, or several runs (named, to pick one).
    """
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(
            f"{path} does not exist: give the directory lm-eval wrote (its --output_path, or the "
            "model directory inside it) or a results_*.json file"
        )
    found = sorted(path.rglob("results_*.json"))
    if not found:
        raise ConfigError(
            f"no lm-eval results file (results_*.json) under {path}: give the --output_path of a "
            "finished `rayeval run` or `lm_eval run`"
        )
    if len(found) > 1:
        listed = ", ".join(str(p.relative_to(path)) for p in found[:5])
        raise ConfigError(
            f"{path} holds {len(found)} runs ({listed}{', ...' if len(found) > 5 else ''}): "
            "give one results file, or the directory of one run"
        )
    return found[0]


def read_run(path: str | Path, label: str | None = None) -> EvaluationSamples:
    """One run's results and samples, as lm-eval wrote them.

    Args:
        path: The run's output directory, its model directory, or its results file.
        label: How to name the run (default: ``path`` as given).

    Returns:
        The run, its samples per task that has a samples file.

    Raises:
        ConfigError: no single results file there, or one that is not lm-eval's JSON.
        IncomparableError: the run logged no samples (``--log_samples`` was not given).
    """
    results_file = find_results_file(Path(path).expanduser())
    try:
        results = json.loads(results_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {results_file} as lm-eval's results JSON: {exc}") from None
    date_id = results_file.stem.rsplit("_", 1)[-1]
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in results.get("configs", {}):
        # The exact name, not a glob: one task name may be a prefix of another.
        samples_file = results_file.parent / f"samples_{task}_{date_id}.jsonl"
        if samples_file.is_file():
            samples[task] = parse_samples(samples_file.read_text(encoding="utf-8"))
    name = label or str(path)
    if not samples:
        raise IncomparableError(
            f"{name} has no samples files beside {results_file.name}: a comparison pairs "
            "documents, so run the evaluation with --log_samples"
        )
    return EvaluationSamples(name, results, samples)


def parse_samples(jsonl: str) -> list[dict[str, Any]]:
    """lm-eval's samples JSONL: one dict per document (and filter)."""
    return [json.loads(line) for line in jsonl.splitlines() if line.strip()]


def read_lm_eval_files(output_dir: Path) -> tuple[str, dict[str, str]]:
    """The text of the one results file lm-eval wrote under ``output_dir`` (one run's), and of
    each task's samples file beside it (tasks without one are left out).

    Raises:
        RuntimeError: not exactly one results file there.
    """
    results_files = sorted(output_dir.rglob("results_*.json"))
    if len(results_files) != 1:
        raise RuntimeError(f"expected one lm-eval results file, found {results_files}")
    results_file = results_files[0]
    results_json = results_file.read_text(encoding="utf-8")
    date_id = results_file.stem.removeprefix("results_")
    samples = {}
    for task in json.loads(results_json).get("configs", {}):
        # The exact name, not a glob: one task name may be a prefix of another.
        path = results_file.parent / f"samples_{task}_{date_id}.jsonl"
        if path.is_file():
            samples[task] = path.read_text(encoding="utf-8")
    return results_json, samples


def write_lm_eval_files(out: Path, results_json: str, samples: Mapping[str, str]) -> Path:
    """``out/<model>/results_<date>.json`` and, per task, ``samples_<task>_<date>.jsonl`` beside
    it, as lm-eval names them, holding ``results_json`` and ``samples`` verbatim (what
    :func:`read_lm_eval_files` reads back); returns the results file."""
    results = json.loads(results_json)
    name = results.get("model_name_sanitized") or str(results["model_name"]).replace("/", "__")
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    date_id = datetime.now().isoformat().replace(":", "-")
    results_file = directory / f"results_{date_id}.json"
    results_file.write_text(results_json, encoding="utf-8")
    for task, jsonl in samples.items():
        (directory / f"samples_{task}_{date_id}.jsonl").write_text(jsonl, encoding="utf-8")
    return results_file


def read_outputs(out: Path) -> tuple[str, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """What ``lm_eval run --output_path out --log_samples`` wrote: model dir, results, samples."""
    (model_dir,) = out.iterdir()
    (results_file,) = model_dir.glob("results_*.json")
    samples = {}
    for path in model_dir.glob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return model_dir.name, json.loads(results_file.read_text()), samples
