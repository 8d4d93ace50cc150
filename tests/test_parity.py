"""Fidelity and layout independence: rayeval equals lm-eval's own HF backend for every layout.

The bundled ``demo`` group covers multiple choice, loglikelihood, loglikelihood_rolling over
documents longer than the context window, and two generate_until tasks with different
gen_kwargs; it runs with ``num_fewshot`` and ``limit``. Each layout's per-sample results must match
lm-eval's ``hf`` backend (|delta logprob| <= 1e-4, identical is_greedy, generations, metrics) and
be bit-identical to the 1x1 layout, since micro-batches never depend on the layout. Sharded
layouts here run FSDP; tensor parallelism is as exact (tests/test_tensor_parallel.py), and bf16
at every layout and strategy is tests/test_dtype_layouts.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, hf_reference

pytestmark = pytest.mark.e2e

RUN = {"num_fewshot": 1, "limit": 6, "bootstrap_iters": 0}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def reference(demo: Any, task_manager: Any) -> dict[str, Any]:
    return hf_reference(demo.model_dir, task_manager, ["demo"], **RUN)


@pytest.fixture(scope="module")
def layout_runs(demo: Any, task_manager: Any, ray_session: None) -> Any:
    """Run each layout once per module, on demand."""
    from rayeval.service.engine.lm import RayEvalLM

    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def run(layout: tuple[int, int]) -> dict[str, Any]:
        if layout not in cache:
            with RayEvalLM(
                pretrained=str(demo.model_dir),
                num_replicas=layout[0],
                shard_size=layout[1],
                shard_strategy="fsdp",  # TP: tests/test_tensor_parallel, test_dtype_layouts
                dtype="float32",
                batch_size="auto",
                max_batch_tokens=256,  # small, so every run has many micro-batches and steps
            ) as lm:
                cache[layout] = evaluate(lm, task_manager, ["demo"], **RUN)
        return cache[layout]

    return run


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda rg: f"{rg[0]}x{rg[1]}")
def test_matches_lm_eval_hf(
    layout: tuple[int, int], reference: dict[str, Any], layout_runs: Any
) -> None:
    ours = layout_runs(layout)
    assert_same_results(reference, ours)
    # Every generate_until and multiple-choice request really ran (not just the group header).
    assert {"demo_mc", "demo_cloze", "demo_rolling", "demo_gen_short", "demo_gen_long"} <= set(
        ours["samples"]
    )
    assert ours["groups"]["demo"]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda rg: f"{rg[0]}x{rg[1]}")
def test_layout_independent(layout: tuple[int, int], layout_runs: Any) -> None:
    assert_same_results(layout_runs((1, 1)), layout_runs(layout), exact=True)
