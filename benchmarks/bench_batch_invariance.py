"""Do a request's results depend on the batch it shares? rayeval at several batch limits, compared.

Runs the same lm-eval tasks (default: the bundled ``demo`` group, 1-shot) with
:class:`rayeval.service.engine.lm.RayEvalLM` at 1x1 several times, changing only how many rows a
micro-batch (or a continuous-batching step) may hold: ``--max_batch_size 1``, ``8`` and ``auto``
(the default), with continuous batching and without (``static``). For every task it prints, against
the ``auto`` run, how many logged samples differ at all and the largest log-probability
difference, then whether every generation is the same text.

Within one setting the results never depend on the layout (tests/test_parity.py,
tests/test_continuous.py); this measures what changing the batch limit changes. Findings go in
docs/performance-notes.md ("Results that do not depend on the batch").

Usage::

    .venv/bin/python benchmarks/bench_batch_invariance.py
    .venv/bin/python benchmarks/bench_batch_invariance.py --model PATH --include_path DIR --tasks T
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import set_environment  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "auto": {},
    "max_batch_size 8": {"max_batch_size": 8},
    "max_batch_size 1": {"max_batch_size": 1},
    "auto, static": {"continuous_batching": False},
    "max_batch_size 1, static": {"max_batch_size": 1, "continuous_batching": False},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the bundled tiny one)")
    parser.add_argument("--include_path", default=None, help="task YAMLs (default: the demo's)")
    parser.add_argument("--tasks", default="demo", help="lm-eval tasks or groups (demo)")
    parser.add_argument("--num_fewshot", type=int, default=1)
    parser.add_argument("--limit", type=float, default=None)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, model_dir: str, task_manager: Any, **options: Any) -> Any:
    """Every logged sample's responses, by task and document."""
    import lm_eval

    from rayeval.service.engine.lm import RayEvalLM

    with RayEvalLM(pretrained=model_dir, dtype="float32", **options) as lm:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=args.tasks.split(","),
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            log_samples=True,
            bootstrap_iters=0,
            task_manager=task_manager,
        )
    return {
        task: {sample["doc_id"]: sample for sample in samples}
        for task, samples in results["samples"].items()
    }


def _numbers(value: Any) -> list[float]:
    if isinstance(value, list | tuple):
        return [number for item in value for number in _numbers(item)]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return []
    return [float(value)]


def compare(base: Any, other: Any) -> list[tuple[str, int, int, float, int]]:
    """Per task: samples, samples that differ at all, max |d log-prob|, generations that differ."""
    rows = []
    for task, samples in base.items():
        differ = generations = 0
        largest = 0.0
        for doc, sample in samples.items():
            theirs = other[task][doc]
            if sample["resps"] != theirs["resps"]:
                differ += 1
            for a, b in zip(_numbers(sample["resps"]), _numbers(theirs["resps"]), strict=False):
                largest = max(largest, abs(a - b))
            generations += sample["filtered_resps"] != theirs["filtered_resps"] and isinstance(
                sample["filtered_resps"][0], str
            )
        rows.append((task, len(samples), differ, largest, generations))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=True)
    import ray
    from lm_eval.tasks import TaskManager

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets(None)
    model_dir = args.model or str(assets.model_dir)
    include = args.include_path or str(assets.tasks_dir)
    task_manager = TaskManager(include_defaults=False, include_path=include)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs = {
        name: run(args, model_dir, task_manager, **options) for name, options in SETTINGS.items()
    }
    print(f"\n{'setting':28s} {'task':22s} {'samples':>7s} {'differ':>6s} {'max|dlp|':>9s} gens")
    for name, samples in runs.items():
        for task, count, differ, largest, generations in compare(runs["auto"], samples):
            print(f"{name:28s} {task:22s} {count:7d} {differ:6d} {largest:9.2e} {generations}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
