"""Tokenising a request type in parts: the driver alone beside tokeniser actors, in one run.

``N`` synthetic requests (``driver_workload.py``: MMLU-style pairs or generation prompts) are
made part by part exactly as the product's planning thread makes them
(``service/engine/tokenisers.made_parts``: the first part on the driver, the rest by ``W``
tokeniser actors, checked and read into the driver's shared ids) and consumed at once, with no
replicas: what is measured is how fast parts can be made, the ceiling the replicas see.
MMLU-style parts are planned too, by the product's planning thread
(``service/engine/parts/pipeline.Planner`` over ``parts/score.plan_part``: on the actors where
they tokenised the part; ``--budget`` tokens a micro-batch, shared prefixes packed). For
``W = 0`` (the driver alone, as before tokeniser actors) and each ``W`` of ``--workers``: the
actors' start-up (separately), the seconds to make every part, requests a second, the driver
process's CPU per request, and the ratio to ``W = 0``; every ``W``'s parts are checked equal to
the driver's own.

    .venv/bin/python benchmarks/bench_tokenisers.py --workload generation --requests 200000
    .venv/bin/python benchmarks/bench_tokenisers.py --workload mmlu --workers 1,2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # tests/support holds the simulated rank and the workloads
    sys.path.insert(0, str(REPO_ROOT))

from common import set_environment  # noqa: E402

from tests.support.workload import bench_model, generation_instances, mmlu_instances  # noqa: E402

ROOT = REPO_ROOT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("mmlu", "generation"), default="generation")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--workers", default="1,2", help="tokeniser actors to compare with 0")
    parser.add_argument("--budget", type=int, default=4000, help="micro-batch tokens (MMLU)")
    parser.add_argument("--num_cpus", type=int, default=None, help="logical CPUs of Ray")
    parser.add_argument("--json", default=None, help="append the figures here")
    return parser.parse_args(argv)


def part_tokens(encoder: Any, instances: list[Any], workload: str) -> tuple[Any, list[Any]]:
    """The product's PartTokens for the workload, and its parts' bounds."""
    from rayeval.service.engine.parts import pipeline
    from rayeval.service.engine.parts.generate import Prompts
    from rayeval.service.engine.parts.score import score_tokens
    from rayeval.service.engine.plan.checks import Origins, RequestChecks, RequestReport

    if workload == "generation":
        bounds = list(pipeline.even_bounds(len(instances), pipeline.GENERATE_PART))
        return Prompts(encoder, instances).tokens(), bounds
    pairs = [instance.args for instance in instances]
    checks = RequestChecks(encoder.tok_encode, True, RequestReport(), None)
    bounds = list(pipeline.part_bounds([c for c, _ in pairs], pipeline.SCORE_PART))
    return score_tokens(encoder, pairs, Origins(instances), checks), bounds


def comparable(part: Any) -> Any:
    if hasattr(part, "requests"):
        return part.start, part.requests
    if hasattr(part, "places"):  # a plan: its micro-batches as a rank receives them
        received = pickle.loads(pickle.dumps(list(part.micro_batches)))
        return received, list(part.places), part.computed, part.given
    return part.start, part.pairs, part.todo, part.fixed


def planned(parts: Any, pool: Any, encoder: Any, budget: int) -> Any:
    """Each part planned, in order, by the product's planning thread (on the pool's actors where
    they tokenised it)."""
    from rayeval.service.engine.parts.pipeline import Planner
    from rayeval.service.engine.parts.score import plan_part
    from rayeval.service.engine.plan.planner import TokenBudget

    plan = partial(plan_part, cache=None, budget=TokenBudget(max_tokens=budget),
                   share_prefixes=True, max_length=encoder.max_length, pool=pool)  # fmt: skip
    planner = Planner(parts, plan)
    planner.start()
    try:
        while True:
            part = planner.take(1.0)
            if part is not None:
                yield part
    except StopIteration:
        return
    finally:
        planner.stop()


def measure(
    encoder: Any, instances: list[Any], args: argparse.Namespace, workers: int
) -> dict[str, Any]:
    """Make (and plan, for MMLU) every part with ``workers`` actors; the figures, and the
    parts."""
    import ray

    from rayeval.service.engine.plan.tokenisers import TokeniserPool, made_parts

    tokens, bounds = part_tokens(encoder, instances, args.workload)
    started = time.monotonic()
    with TokeniserPool(encoder, workers) as pool:
        ray.get([actor.ready.remote() for actor in pool._actors], timeout=300)
        startup_s = time.monotonic() - started
        wall, cpu = time.monotonic(), time.process_time()
        parts: Any = made_parts(bounds, tokens, pool)
        if args.workload == "mmlu":
            parts = planned(parts, pool, encoder, args.budget)
        parts = list(parts)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        tokenised, by_actors = pool.tokenised, pool.planned
    return {
        "workload": args.workload,
        "requests": len(instances),
        "parts": len(bounds),
        "workers": workers,
        "startup_s": startup_s,
        "seconds": wall,
        "requests_per_s": len(instances) / wall,
        "driver_cpu_per_request_us": cpu / len(instances) * 1e6,
        "tokenised_by_actors": tokenised,
        "planned_by_actors": by_actors,
        "_parts": [comparable(part) for part in parts],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import ray

    from rayeval.service.engine.plan.encoder import build_encoder

    workers = [0] + [int(w) for w in args.workers.split(",") if w.strip()]
    ray.init(num_cpus=args.num_cpus or max(workers) + 1, include_dashboard=False)
    encoder, _ = build_encoder(str(bench_model(ROOT / ".rayeval")), {})
    if args.workload == "mmlu":
        instances = mmlu_instances(args.requests)
    else:
        instances = generation_instances(args.requests, max_gen_toks=16)
    runs = [measure(encoder, instances, args, w) for w in workers]
    alone, expected = runs[0], runs[0].pop("_parts")
    for run in runs[1:]:
        if run.pop("_parts") != expected:
            raise SystemExit(f"W = {run['workers']}: the parts differ from the driver's own")
    print(f"{args.workload} x {len(instances):,} requests in {alone['parts']} parts, "
          f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print("W  start-up  seconds  requests/s  driver CPU/request  tokenised/planned by actors"
          "  speed-up")  # fmt: skip
    for run in runs:
        run["speed_up"] = alone["seconds"] / run["seconds"]
        print(f"{run['workers']:<2} {run['startup_s']:7.2f} s {run['seconds']:7.2f} "
              f"{run['requests_per_s']:11,.0f} {run['driver_cpu_per_request_us']:15.1f} us "
              f"{run['tokenised_by_actors']:12,} / {run['planned_by_actors']:<12,} "
              f"{run['speed_up']:8.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "a") as out:
            out.writelines(json.dumps(run) + "\n" for run in runs)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
