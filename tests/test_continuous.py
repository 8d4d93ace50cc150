"""Continuous batching (actors/compute/continuous.py): lm-eval hf's greedy answers in every layout,
the same bits in every layout and rerun, sampled answers that do not depend on the layout, a request
too large for the KV-cache budget refused before any batch runs, progress counted per request, and
the static path where continuous batching cannot be exact.

Slots are few (``batch_size=3``: three rows decode together, a group holds 12 requests), so the
demo's generate_until tasks (short answers and up to 40-token ones, different stop strings) run
as several groups whose rows finish at different steps and are refilled many times.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, hf_reference

pytestmark = pytest.mark.e2e

TASKS = ["demo_gen_short", "demo_gen_long"]
RUN = {"num_fewshot": 1, "bootstrap_iters": 0}
SAMPLED = {**RUN, "gen_kwargs": "do_sample=True,temperature=1.0,top_k=20"}
LAYOUTS = {"1x1": (1, 1, "fsdp"), "2x1": (2, 1, "fsdp"), "1x2-fsdp": (1, 2, "fsdp")}


@pytest.fixture(scope="module")
def reference(demo: Any, task_manager: Any) -> dict[str, Any]:
    return hf_reference(demo.model_dir, task_manager, TASKS, **RUN)


def _run(demo: Any, task_manager: Any, layout: tuple[int, int, str], **kwargs: Any) -> Any:
    """One evaluation of the tasks; its results and the engine's generate_until figures."""
    from rayeval.service.engine.lm import RayEvalLM

    replicas, shard_size, strategy = layout
    run = kwargs.pop("run", RUN)
    progress: list[int] = []
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=replicas,
        shard_size=shard_size,
        shard_strategy=strategy,
        dtype="float32",
        batch_size=3,
        on_progress=lambda p: progress.append(p.done) if p.phase == "generate_until" else None,
        **kwargs,
    ) as lm:
        results = evaluate(lm, task_manager, TASKS, **run)
        figures = lm.engine.stats["generate_until"].report()
    return results, figures, progress


@pytest.fixture(scope="module")
def greedy(demo: Any, task_manager: Any, ray_session: None) -> dict[str, Any]:
    return {name: _run(demo, task_manager, layout) for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_matches_lm_eval_hf(name: str, greedy: dict[str, Any], reference: Any) -> None:
    results, figures, _ = greedy[name]
    assert figures["batching"] == "continuous"
    assert figures["micro_batches"] == 3  # 35 requests in groups of 12
    assert_same_results(reference, results)


def test_every_layout_and_rerun_gives_the_same_bits(
    greedy: dict[str, Any], demo: Any, task_manager: Any
) -> None:
    again, _, _ = _run(demo, task_manager, LAYOUTS["2x1"])
    for name in ("2x1", "1x2-fsdp"):
        assert_same_results(greedy["1x1"][0], greedy[name][0], exact=True)
    assert_same_results(greedy["2x1"][0], again, exact=True)


def test_progress_counts_each_request_as_it_finishes(greedy: dict[str, Any]) -> None:
    _, figures, progress = greedy["1x1"]
    assert progress == sorted(progress) and progress[-1] == figures["requests"] == 35
    # More reports than groups: requests are counted as they finish, not group by group.
    assert len(set(progress)) > figures["micro_batches"] + 3


def test_sampled_answers_do_not_depend_on_the_layout(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    runs = [
        _run(demo, task_manager, layout, run=SAMPLED)[0]
        for layout in (LAYOUTS["1x1"], LAYOUTS["2x1"], LAYOUTS["1x2-fsdp"], LAYOUTS["1x1"])
    ]
    for other in runs[1:]:
        assert_same_results(runs[0], other, exact=True)
    answers = [s["resps"][0][0] for s in runs[0]["samples"]["demo_gen_long"]]
    assert len(set(answers)) > 1, "every request drew the same answer"


def test_a_request_larger_than_the_kv_budget_is_refused_before_any_batch(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM

    with RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", kv_cache_tokens=30) as lm:
        with pytest.raises(
            ConfigError,
            match=r"task demo_gen_long doc \d+ needs \d+ KV-cache.*"
            r"--kv_cache_tokens",
        ):
            evaluate(lm, task_manager, ["demo_gen_long"], **RUN)
        assert lm.engine.stats["generate_until"].micro_batches == 0
        assert lm.engine.input_token_counts().calls == 0


def test_an_explicit_max_length_falls_back_to_static_batches(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    run = {**RUN, "gen_kwargs": "max_length=200"}
    reference = hf_reference(demo.model_dir, task_manager, TASKS, **run)
    results, figures, _ = _run(demo, task_manager, LAYOUTS["1x1"], run=run)
    assert figures["batching"] == "static"
    assert_same_results(reference, results)
