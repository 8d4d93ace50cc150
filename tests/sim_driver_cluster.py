"""The cluster side of tests/test_sim_driver.py, run as ``python -m tests.sim_driver_cluster``.

It starts a Ray with 12 logical CPUs and runs synthetic MMLU-style loglikelihood requests and
generation requests through ``RayEvalLM`` on simulated ranks (``tests/support/sim_rank.py``: real
rank actors in the real placement group, a modelled step instead of a model), in several layouts:
R = 8, 1 and 3; R = 8 with the loglikelihood and generation requests planned in small parts;
R = 3 with generation in parts (continuous and static batching); static generation; and R = 8
with one replica's rank killed mid-run. It writes every answer, the engine's figures
and the ranks' call counts as JSON for the tests to assert on. It runs in its own process because
a process joins only one Ray cluster, and the test session's has 4 CPUs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.sim_rank import StepCost, score_answer, simulated_rank
from tests.support.workload import bench_model, generation_instances, mmlu_instances

RAY_CPUS = 12
QUESTIONS = 600
GENERATIONS = 160
#: Small micro-batches (a few rows each), so every layout has many steps to share.
BUDGET_TOKENS = 600
#: Parts of this many requests in the ``R8-parts`` run.
PART = 256
#: Parts of this many generation requests in the ``*-parts`` runs (GENERATIONS make 7).
GEN_PART = 24
COST = StepCost(token_s=5e-6, decode_step_s=2e-4)


def _run(
    model: Path,
    replicas: int,
    mc: list,
    gen: list,
    kill: bool = False,
    parts: bool = False,
    **options: Any,
):
    """One RayEvalLM on simulated ranks: its answers, figures and (unless killed) rank calls."""
    import ray

    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.parts.pipeline import GENERATE_PART, SCORE_PART, Tunables

    killed: list[str] = []

    def on_progress(progress: Any) -> None:
        if kill and not killed and progress.phase == "loglikelihood" and progress.done > 0:
            name = f"{lm.engine.name}-r0-s0"
            ray.kill(ray.get_actor(name), no_restart=True)
            killed.append(name)

    with RayEvalLM(
        pretrained=str(model),
        num_replicas=replicas,
        device="cpu",
        batch_size="auto",
        max_batch_tokens=BUDGET_TOKENS,
        max_batch_size=8,
        kv_cache_tokens=4096,
        on_progress=on_progress,
        tunables=Tunables(
            score_part=PART if parts else SCORE_PART,
            generate_part=GEN_PART if parts else GENERATE_PART,
            rank_class=simulated_rank(COST),
        ),
        **options,
    ) as lm:
        out: dict[str, Any] = {"killed": killed}
        if mc:
            out["loglikelihood"] = lm.loglikelihood(mc, disable_tqdm=True)
        if gen:
            out["generate_until"] = lm.generate_until(gen, disable_tqdm=True)
        out["stats"] = {phase: stats.report() for phase, stats in lm.engine.stats.items()}
        if not kill:
            out["calls"] = lm.engine.input_token_counts().calls
    return out


def _expected(model: Path, mc: list) -> list[list[Any]]:
    """Each loglikelihood request's own simulated answer, from its own tokens."""
    from rayeval.service.engine.plan.encoder import build_encoder, encode_pairs
    from rayeval.service.engine.plan.planner import model_input

    encoder, _ = build_encoder(str(model), {})
    encoded = encode_pairs(encoder, [r.args for r in mc])
    return [
        list(score_answer(model_input(ctx, cont, encoder.max_length), cont))
        for ctx, cont in encoded.pairs
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim_driver_cluster")
    parser.add_argument("--report", required=True)
    parser.add_argument("--model-dir", required=True, help="the built demo model")
    parser.add_argument("--work", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import ray

    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    model = bench_model(Path(args.work), Path(args.model_dir))
    mc = mmlu_instances(QUESTIONS * 4, seed=3)
    gen = generation_instances(GENERATIONS, seed=4, max_gen_toks=24)
    runs = {
        "R8": _run(model, 8, mc, gen),
        "R1": _run(model, 1, mc, gen),
        "R3": _run(model, 3, mc, gen),
        "R8-static": _run(model, 8, [], gen, continuous_batching=False),
        "R3-static": _run(model, 3, [], gen, continuous_batching=False),
        "R8-lost": _run(model, 8, mc, gen, kill=True),
    }
    # planned in parts of PART requests (generation: GEN_PART)
    runs["R8-parts"] = _run(model, 8, mc, gen, parts=True)
    runs["R3-parts"] = _run(model, 3, [], gen, parts=True)
    runs["R3-parts-static"] = _run(model, 3, [], gen, parts=True, continuous_batching=False)
    report = {"expected": _expected(model, mc), "runs": runs}
    Path(args.report).write_text(json.dumps(report))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local test cluster only
    sys.exit(main(sys.argv[1:]))
