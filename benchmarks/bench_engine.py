"""lm-eval's own HF backend vs rayeval layouts, on the same tasks, in one run.

One process evaluates the same lm-eval tasks (default: the bundled ``demo`` group, every document,
``num_fewshot=0``) several ways and prints them side by side:

* ``lm-eval hf`` — lm-eval's ``hf`` backend in this process, created exactly as
  ``simple_evaluate(model="hf", model_args={"pretrained": ..., "dtype": ...}, batch_size=...,
  device=...)`` creates it (``HFLM.create_from_arg_obj``), so its load time can be timed apart;
* ``rayeval RxG`` — :class:`rayeval.service.engine.lm.RayEvalLM` with ``R`` replicas of ``G`` ranks
and ``batch_size="auto"`` (token-budget micro-batches), passed to ``lm_eval.simple_evaluate``.

Ray is started once, before any row, and its start-up is reported on its own line (it is in no
row). Dataset preparation and first-use imports are done once before the first row (warm-up),
so no row pays for them.

What each column means:

* ``load s`` — making the model ready. hf: reading the weights onto the device. rayeval: the
  driver's weightless tokeniser model, the placement group, the rank actors (each a new process
  that imports torch), their process groups and every rank's model load (the constructor, then
  ``lm.engine.load_reports``, which waits until every rank is ready).
* ``eval s`` — the ``simple_evaluate`` call: building tasks and requests, every model call,
  metrics. ``total s`` = load + eval (+ releasing the actors for rayeval).
* ``LM s`` — time spent inside the LM's request methods (``loglikelihood``,
  ``loglikelihood_rolling``, ``generate_until``), summed. This is the model work including the
  LM's own tokenisation, batching and (rayeval) dispatch; the rest of ``eval s`` is lm-eval's
  driver work, identical for every row.
* ``req/s`` — lm-eval requests (``Instance`` objects) / ``LM s``.
* ``tok/s`` — workload tokens / ``LM s``. Workload tokens are the distinct model-input tokens of
  the requests as rayeval's planner counts them (``lm.engine.stats[phase].real_tokens``: identical
  multiple-choice inputs counted once, prompt tokens only for ``generate_until`` — generated
  tokens are not counted). The requests are the same for every row, so the same count is used
  for the hf row; it is n/a when no rayeval row ran.
* ``real-tok`` — rayeval only: real / padded tokens over all micro-batches (padding efficiency of
  the token-budget batching; 1.0 = no padding). Not measured for hf.
* ``vs hf`` — speed-up against the hf row of this same run: hf seconds / row seconds for
  ``total s`` and for ``LM s`` (above 1: faster than lm-eval; below 1: slower).
* ``max|dmetric|`` — largest absolute difference of any reported metric (stderr excluded) to the
  baseline row (hf, or the first row with ``--skip_hf``); ``max|dlogprob|`` and ``diffs`` compare
  every logged sample: the largest log-prob difference and how many ``is_greedy`` flags or
  generations differ. In float32 anything above 1e-4 or any diff fails the run (exit status 1).

A per-request-type table follows, with rayeval's own figures (``lm.engine.stats``): ``engine s`` =
dispatch wall time from the first step sent to the last result, micro-batches, real-token
fraction, and ``replica util`` = per replica, the share of ``engine s`` its slowest rank spent
computing (low values: the replica idled or waited on Ray/the driver).

Note on CPU runs: Ray gives each rank actor ``OMP_NUM_THREADS`` = its CPU slots (1), so a CPU
rank runs torch on one thread, while the hf row uses torch's default thread count (shown in the
header; ``--hf_threads`` sets it).

Usage (see benchmarks/README.md)::

    .venv/bin/python benchmarks/bench_engine.py                       # CPU, bundled model + tasks
    .venv/bin/python benchmarks/bench_engine.py --device cuda --dtype bfloat16 \\
        --model /path/to/model --layouts 1x1,2x1,1x2 --json out/bench.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.agreement import LOGPROB_TOL, compare  # noqa: E402
from benchmarks.common import make_task_manager, parse_layout, set_environment  # noqa: E402
from benchmarks.engine_report import report  # noqa: E402
from benchmarks.engine_runs import Row, run_hf, run_rayeval, warm_up_imports  # noqa: E402

__all__ = ["main", "parse_args", "set_environment"]

#: The command line, flag by flag, in the order ``--help`` lists them.
ARGUMENTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--layouts", {
        "default": "1x1,2x1",
        "help": "rayeval layouts RxG, comma-separated (R replicas x G shard ranks; default "
        "1x1,2x1)",
    }),
    ("--limit", {
        "type": float,
        "default": None,
        "help": "documents per task (lm-eval's --limit; <1 is a fraction; default: all)",
    }),
    ("--device", {
        "choices": ("cpu", "cuda"),
        "default": "cpu",
        "help": "device of the hf row and of every rank (default cpu)",
    }),
    ("--dtype", {
        "choices": ("float32", "bfloat16", "float16"),
        "default": "float32",
        "help": "model dtype (default float32; only float32 rows must agree to 1e-4)",
    }),
    ("--model", {
        "default": None, "help": "model path or hub id (default: the bundled tiny Llama)",
    }),
    ("--tasks", {
        "default": "demo", "help": "lm-eval tasks/groups, comma-separated (default demo)",
    }),
    ("--include_path", {
        "default": None, "help": "task YAML directory (default: the bundled demo tasks)",
    }),
    ("--num_fewshot", {"type": int, "default": 0, "help": "few-shot examples (default 0)"}),
    ("--batch_size", {
        "type": int,
        "default": 16,
        "help": "rows per batch of the hf row (default 16; lm-eval's 'auto' probes GPU memory)",
    }),
    ("--max_batch_tokens", {
        "type": int,
        "default": None,
        "help": "rayeval padded-token budget per micro-batch (default: the engine's, 8192)",
    }),
    ("--hf_threads", {
        "type": int,
        "default": None,
        "help": "torch threads for the hf row (default: torch's default)",
    }),
    ("--num_cpus", {
        "type": int,
        "default": None,
        "help": "logical CPUs of the local Ray (default: max(cores, largest layout))",
    }),
    ("--address", {
        "default": None,
        "help": "use an existing Ray cluster instead of starting a local one",
    }),
    ("--skip_hf", {
        "action": "store_true",
        "help": "no lm-eval hf row (e.g. a model larger than one GPU)",
    }),
    ("--json", {
        "dest": "json_out",
        "default": None,
        "metavar": "OUT",
        "help": "also write every figure as JSON to OUT",
    }),
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--layouts`` as ``(R, G)`` pairs and a whole ``--limit`` an int.

    Raises:
        SystemExit: A layout is not ``RxG``, or there is nothing to run.
    """
    parser = argparse.ArgumentParser(
        description="lm-eval's hf backend vs rayeval layouts on the same tasks, in one run.",
    )
    for flag, options in ARGUMENTS:
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    try:
        args.layouts = [parse_layout(item) for item in args.layouts.split(",") if item.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    if not args.layouts and args.skip_hf:
        parser.error("nothing to run: give --layouts or drop --skip_hf")
    return args


def prepare(args: argparse.Namespace) -> tuple[str, Any]:
    """The model and tasks (the bundled demo where not given), datasets and imports warmed up.

    Splits ``args.tasks`` into a list. Returns the model directory and the task manager.
    """
    from lm_eval.tasks import get_task_dict

    from rayeval.service.demo import ensure_demo_assets

    model_dir = args.model
    include_path = args.include_path
    if model_dir is None or include_path is None:
        assets = ensure_demo_assets()
        model_dir = model_dir or str(assets.model_dir)
        include_path = include_path or str(assets.tasks_dir)
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    task_manager = make_task_manager(args.tasks, include_path)
    get_task_dict(args.tasks, task_manager)  # warm-up: datasets are prepared before any row
    warm_up_imports(model_dir)
    return model_dir, task_manager


def start_ray(args: argparse.Namespace) -> float:
    """Connect to ``--address`` / ``RAY_ADDRESS`` or start a local Ray; the seconds it took."""
    import ray

    largest = max((r * g for r, g in args.layouts), default=1)
    started = time.perf_counter()
    if args.layouts:
        if args.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=args.address or os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(
                num_cpus=args.num_cpus or max(os.cpu_count() or 1, largest),
                include_dashboard=False,
                log_to_driver=False,
            )
    return time.perf_counter() - started


def _describe_cluster() -> str:
    import ray

    resources = ray.cluster_resources()
    return f"{resources.get('CPU', 0):g} logical CPUs, {resources.get('GPU', 0):g} GPUs"


def describe_run(
    args: argparse.Namespace, model_dir: str, ray_s: float, prep_s: float
) -> dict[str, Any]:
    """The header lines: what is evaluated, how, on which machine and versions."""
    import lm_eval
    import ray
    import torch
    import transformers

    gpus = (
        ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        if torch.cuda.is_available()
        else "none"
    )
    return {
        "model": model_dir,
        "tasks": f"{','.join(args.tasks)} (num_fewshot {args.num_fewshot}, limit {args.limit})",
        "dtype / device": f"{args.dtype} / {args.device}",
        "batching": f"hf batch_size {args.batch_size}; rayeval auto, max_batch_tokens "
        f"{args.max_batch_tokens or 'default'}",
        "machine": f"{os.cpu_count()} CPU cores, GPUs: {gpus}, {platform.platform()}",
        "versions": f"torch {torch.__version__}, ray {ray.__version__}, lm-eval "
        f"{lm_eval.__version__}, transformers {transformers.__version__}",
        "hf torch threads": str(args.hf_threads or torch.get_num_threads()),
        "ray cluster": _describe_cluster() if args.layouts else "none",
        "ray start-up s": f"{ray_s:.2f} (once, in no row)",
        "warm-up s": f"{prep_s:.2f} (assets, datasets, imports; once, in no row)",
        "load average": "{:.1f} {:.1f} {:.1f} (1/5/15 min, at start)".format(*os.getloadavg()),
    }


def run_rows(args: argparse.Namespace, model_dir: str, task_manager: Any) -> list[Row]:
    """The hf row (unless ``--skip_hf``), then every layout; Ray is shut down afterwards."""
    import ray

    rows: list[Row] = []
    try:
        if not args.skip_hf:
            print("running lm-eval hf ...", file=sys.stderr, flush=True)
            rows.append(run_hf(args, model_dir, task_manager))
        for layout in args.layouts:
            print(f"running rayeval {layout[0]}x{layout[1]} ...", file=sys.stderr, flush=True)
            rows.append(run_rayeval(args, model_dir, task_manager, layout))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return rows


def verdict_line(baseline: str, failed: list[str]) -> str:
    """Whether every row agrees with the baseline row, and which do not."""
    if failed:
        return (
            f"results DIFFER from {baseline} beyond |dlogprob| {LOGPROB_TOL:g} (two "
            "float32 ulps for sums above 1024) or in "
            f"greedy flags / generations: {', '.join(failed)}"
        )
    return (
        f"results agree with {baseline} (|dlogprob| <= {LOGPROB_TOL:g} or two "
        "float32 ulps of a sum above 1024, same generations)"
    )


def write_json(path: str, figures: dict[str, Any], verdict: str) -> None:
    """Every figure, the command line and the verdict, as JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures["argv"] = sys.argv
    figures["verdict"] = verdict
    out.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(f"figures written to {out}")


def main(argv: list[str] | None = None) -> int:
    """Run every row, print the tables; 1 if a float32 row's results differ, else 0."""
    args = parse_args(argv)
    set_environment(local_ray=args.address is None and not os.environ.get("RAY_ADDRESS"))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("lm_eval", "service", "actors"):
        logging.getLogger(name).setLevel(logging.WARNING)

    started = time.perf_counter()
    model_dir, task_manager = prepare(args)
    prep_s = time.perf_counter() - started
    ray_s = start_ray(args)
    header = describe_run(args, model_dir, ray_s, prep_s)
    rows = run_rows(args, model_dir, task_manager)

    baseline = rows[0]
    assert baseline.results is not None
    agreements = {row.name: compare(baseline.results, row.results or {}) for row in rows[1:]}
    figures = report(args, rows, agreements, header)
    failed = [name for name, a in agreements.items() if not a.ok()]
    verdict = verdict_line(baseline.name, failed)
    print("load average at end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"\n{verdict}")
    if args.json_out:
        write_json(args.json_out, figures, verdict)
    # In float32 the rows must agree; bf16/fp16 batches legitimately round differently.
    return 1 if failed and args.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
