"""A checkpoint's ``generation_config.json`` applies on every path, as lm-eval's hf backend applies
it (``generate`` reads it).

Two copies of the demo model carry settings that change lm-eval hf's greedy answers on the demo
generate_until tasks: a repetition penalty; and an n-gram ban, a second EOS id (the comma) and a
least number of new tokens together (each of the three changes answers beyond what the other two
do: checked here against lm-eval hf on copies without it, so a layout that ignored one would
differ). At 1x1, 2x1, 1x2 under FSDP and 1x2 under tensor parallelism every answer must equal
lm-eval hf's, in continuous batching (these processors read each row's own tokens:
actors/compute/continuous.py). A setting continuous batching cannot reproduce (``min_length`` alone)
takes static batches and still matches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, hf_reference

pytestmark = pytest.mark.e2e

TASKS = ["demo_gen_short", "demo_gen_long"]
RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}
EOS, COMMA = 1, 15  # the demo tokenizer's </s> and ","
NGRAM = {"no_repeat_ngram_size": 2}
SECOND_EOS = {"eos_token_id": [EOS, COMMA]}
MIN_NEW = {"min_new_tokens": 3}
#: name -> what its generation_config.json adds (the models run at every layout).
SETTINGS: dict[str, dict[str, Any]] = {
    "repetition_penalty": {"repetition_penalty": 1.5},
    "ngram_eos_min_new": {**NGRAM, **SECOND_EOS, **MIN_NEW},
}
#: Models lm-eval hf runs only: the second one without each of its settings, and a setting
#: continuous batching leaves to static batches.
CHECKS: dict[str, dict[str, Any]] = {
    "without_ngram": {**SECOND_EOS, **MIN_NEW},
    "without_second_eos": {**NGRAM, **MIN_NEW},
    "without_min_new": {**NGRAM, **SECOND_EOS},
    "min_length": {"min_length": 3},
}
#: name -> (replicas, shard size, strategy); ``auto`` takes tensor parallelism at G = 2.
LAYOUTS = {
    "1x1": (1, 1, "auto"),
    "2x1": (2, 1, "auto"),
    "1x2-fsdp": (1, 2, "fsdp"),
    "1x2-tp": (1, 2, "auto"),
}


def _copy(demo: Any, root: Path, name: str, extra: dict[str, Any]) -> Path:
    """The demo model with ``extra`` added to its generation_config.json."""
    target = root / name
    shutil.copytree(demo.model_dir, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return target


def _answers(results: dict[str, Any]) -> dict[tuple[str, int], str]:
    return {
        (task, sample["doc_id"]): sample["resps"][0][0]
        for task, samples in results["samples"].items()
        for sample in samples
    }


@pytest.fixture(scope="module")
def models(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generation_config")
    return {name: _copy(demo, root, name, extra) for name, extra in {**SETTINGS, **CHECKS}.items()}


@pytest.fixture(scope="module")
def references(models: dict[str, Path], demo: Any, task_manager: Any) -> Any:
    """lm-eval hf's results per model (``plain``: the demo model without the file's settings)."""
    cache: dict[str, Any] = {}

    def reference(name: str) -> Any:
        if name not in cache:
            model_dir = demo.model_dir if name == "plain" else models[name]
            cache[name] = hf_reference(model_dir, task_manager, TASKS, "float32", **RUN)
        return cache[name]

    return reference


def _run(model_dir: Path, task_manager: Any, layout: str) -> tuple[Any, dict[str, Any], set[Any]]:
    """One evaluation: its results, the generate_until figures and the strategies loaded."""
    from rayeval.service.engine.lm import RayEvalLM

    replicas, shard_size, strategy = LAYOUTS[layout]
    with RayEvalLM(
        pretrained=str(model_dir),
        num_replicas=replicas,
        shard_size=shard_size,
        shard_strategy=strategy,
        dtype="float32",
        batch_size=2,  # two slots: rows leave and others join while a row's history grows
    ) as lm:
        results = evaluate(lm, task_manager, TASKS, **RUN)
        figures = lm.engine.stats["generate_until"].report()
        strategies = {report.strategy for report in lm.engine.load_reports}
    return results, figures, strategies


def test_each_setting_changes_lm_eval_hf_answers(references: Any) -> None:
    assert _answers(references("repetition_penalty")) != _answers(references("plain"))
    combined = _answers(references("ngram_eos_min_new"))
    for name in ("without_ngram", "without_second_eos", "without_min_new"):
        assert _answers(references(name)) != combined, f"{name}: the same answers"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_layout_matches_lm_eval_hf(
    name: str, layout: str, models: dict[str, Path], references: Any, task_manager: Any,
    ray_session: None,
) -> None:  # fmt: skip
    results, figures, strategies = _run(models[name], task_manager, layout)
    assert figures["batching"] == "continuous"
    assert strategies == {"1x2-tp": {"tp"}, "1x2-fsdp": {"fsdp"}}.get(layout, {None})
    assert_same_results(references(name), results)


def test_a_setting_continuous_batching_cannot_reproduce_takes_static_batches(
    models: dict[str, Path], references: Any, task_manager: Any, ray_session: None
) -> None:
    from rayeval.actors.compute.continuous import unsupported
    from rayeval.service.engine.plan.encoder import meta_model

    shell, _ = meta_model(str(models["min_length"]), {})
    assert "min_length" in (unsupported(shell, {"until": ["\n"]}) or "")
    results, figures, _ = _run(models["min_length"], task_manager, "1x1")
    assert figures["batching"] == "static"
    assert_same_results(references("min_length"), results)
