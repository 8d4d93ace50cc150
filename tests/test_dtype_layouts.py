"""bf16 results that do not depend on the layout, on models of the shapes users bring.

A Qwen2-style model (sums of 256 and 704 terms, tied embeddings) and a Qwen3-MoE-style model (8
experts, top-2 routing: random weights make near ties, so one bf16 step anywhere moves a token
or an expert) run the demo group (multiple choice, loglikelihood, rolling loglikelihood, two
generate_until tasks; continuous batching and shared prefixes on as by default, which apply in
float32 only) at every layout
under both strategies (the Qwen2-style model in fp16, and the bundled trained Llama in bf16, at
1x1 and under TP). Each layout's
per-sample results are held to lm-eval's own ``hf`` backend in the same dtype. In bf16 and fp16,
to lm-eval hf's own spread between batch sizes 1, 4 and 16 on this machine (tests.helpers.HfSpread;
DESIGN invariant 1): bit for bit by every measure in which lm-eval hf does not move (on a CPU with
AVX-512 its log-probs do not), never further than it moves in the others (with AVX2 alone they
do). In float32, within the fidelity tolerance of lm-eval hf, bit for bit against the one-rank
layout where the kernels are the same (two replicas each run whole batches) and within the same
tolerance where they are not (FSDP gives each rank its own micro-batch, TP multiplies split
matrices: on an AVX2-only CPU, MKL's float32 bits depend on a product's shape).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, hf_reference, hf_spread
from tests.models import build_model

pytestmark = [pytest.mark.e2e, pytest.mark.parity]

RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}
#: name -> (replicas, shard size, strategy); ``auto`` takes tensor parallelism at G = 2.
LAYOUTS = {
    "1x1": (1, 1, "auto"),
    "2x1": (2, 1, "auto"),
    "1x2-tp": (1, 2, "auto"),
    "1x2-fsdp": (1, 2, "fsdp"),
    "2x2-tp": (2, 2, "tp"),
}
CASES = [
    (arch, dtype, layout)
    for arch, dtype in [("qwen2", "bfloat16"), ("qwen3_moe", "bfloat16"), ("qwen3_moe", "float32")]
    for layout in LAYOUTS
] + [
    ("qwen2", "float16", "1x1"),
    ("qwen2", "float16", "1x2-tp"),
    ("llama", "bfloat16", "1x1"),
    ("llama", "bfloat16", "1x2-tp"),
    ("llama", "bfloat16", "2x2-tp"),
]


@pytest.fixture(scope="module")
def models(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    built = {
        arch: build_model(arch, root / arch, demo.model_dir) for arch in ("qwen2", "qwen3_moe")
    }
    return {"llama": demo.model_dir, **built}  # the bundled Llama: trained, meaningful answers


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], task_manager: Any, ray_session: None) -> Any:
    """lm-eval hf's results and each layout's, per (model, dtype), computed once on demand."""
    from rayeval.service.engine.lm import RayEvalLM

    cache: dict[tuple[str, str, str], Any] = {}

    def run(arch: str, dtype: str, layout: str) -> Any:
        key = (arch, dtype, layout)
        if key not in cache:
            if layout == "hf" and dtype == "float32":
                cache[key] = hf_reference(models[arch], task_manager, ["demo"], dtype, **RUN)
            elif layout == "hf":
                cache[key] = hf_spread(models[arch], task_manager, ["demo"], dtype, **RUN)
            else:
                replicas, shard_size, strategy = LAYOUTS[layout]
                with RayEvalLM(
                    pretrained=str(models[arch]),
                    num_replicas=replicas,
                    shard_size=shard_size,
                    shard_strategy=strategy,
                    dtype=dtype,
                    max_batch_tokens=512,  # several micro-batches, so replicas share the work
                ) as lm:
                    results = evaluate(lm, task_manager, ["demo"], **RUN)
                    strategies = {report.strategy for report in lm.engine.load_reports}
                    # packed rows only in float32 (bf16/fp16 attention rounds by row width)
                    assert lm.engine.share_prefixes is (dtype == "float32")
                    # continuous batching in float32 only (the same reason)
                    batching = "continuous" if dtype == "float32" else "static"
                    assert lm.engine.stats["generate_until"].report()["batching"] == batching
                cache[key] = (results, strategies)
        return cache[key]

    return run


@pytest.mark.parametrize(("arch", "dtype", "layout"), CASES, ids=["-".join(c) for c in CASES])
def test_layout_matches_lm_eval_hf(arch: str, dtype: str, layout: str, runs: Any) -> None:
    reference = runs(arch, dtype, "hf")
    ours, strategies = runs(arch, dtype, layout)
    expected = {"1x2-tp": {"tp"}, "2x2-tp": {"tp"}, "1x2-fsdp": {"fsdp"}}.get(layout, {None})
    assert strategies == expected
    assert {"demo_mc", "demo_rolling", "demo_gen_short", "demo_gen_long"} <= set(ours["samples"])
    if dtype == "float32":
        assert_same_results(reference, ours)
        assert_same_results(runs(arch, dtype, "1x1")[0], ours, exact=layout == "2x1")
    else:
        reference.assert_holds(ours, f"rayeval {layout}")
