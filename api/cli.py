"""The ``rayeval`` command line.

``rayeval run`` takes lm-eval's own ``run`` flags — its parser is reused, so every flag means what
it means in ``lm_eval`` — plus the layout and Ray options. It is also the entrypoint for
``ray job submit``: inside a Ray job, ``RAY_ADDRESS`` is set and the job's cluster is used.
Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

#: Our flags on top of lm-eval's; they are removed before lm-eval's config sees the namespace.
_ENGINE_FLAGS = (
    "num_replicas",
    "shard_size",
    "address",
    "max_batch_tokens",
    "placement_timeout",
    "load_timeout",
    "step_timeout",
    "collective_timeout",
)


def build_parser() -> argparse.ArgumentParser:
    """The ``rayeval`` parser: ``run`` with lm-eval's flags plus the layout."""
    from lm_eval._cli.run import Run

    parser = argparse.ArgumentParser(
        prog="rayeval",
        description="Distributed lm-evaluation-harness on Ray, with FSDP2-sharded models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = Run.create(subparsers)._parser
    run.prog = "rayeval run"
    run.usage = (
        "rayeval run --model hf --model_args pretrained=PATH_OR_ID --tasks TASKS "
        "[--num_replicas R] [--shard_size G] [lm-eval options]"
    )
    group = run.add_argument_group("rayeval layout and cluster")
    group.add_argument("--num_replicas", type=int, default=1, metavar="R",
                       help="data-parallel replicas of the model (default 1)")
    group.add_argument("--shard_size", type=int, default=1, metavar="G",
                       help="ranks (GPUs) per replica; the model is FSDP2-sharded over them (default 1)")
    group.add_argument("--address", default=None,
                       help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)")
    group.add_argument("--max_batch_tokens", type=int, default=None,
                       help="padded tokens per micro-batch with --batch_size auto (default 8192)")
    group.add_argument("--placement_timeout", type=float, default=120.0, metavar="S",
                       help="seconds to wait for the cluster to provide the layout's resources")
    group.add_argument("--load_timeout", type=float, default=1800.0, metavar="S",
                       help="seconds for every rank to load the model")
    group.add_argument("--step_timeout", type=float, default=900.0, metavar="S",
                       help="seconds one batch may take on one replica before the run fails")
    group.add_argument("--collective_timeout", type=float, default=600.0, metavar="S",
                       help="seconds one collective may take inside a replica")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rayeval`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        return _run(args)
    return 2


def _run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import make_table

    from actors.errors import RayEvalError
    from actors.group import Timeouts
    from service.runner import EngineOptions, run_evaluation

    # lm-eval's config defaults the device to cuda; rayeval picks it from the cluster instead.
    args.device = args.device or "auto"
    engine_args = {flag: getattr(args, flag) for flag in _ENGINE_FLAGS}
    for flag in _ENGINE_FLAGS:
        delattr(args, flag)
    try:
        engine = EngineOptions(
            num_replicas=engine_args["num_replicas"],
            shard_size=engine_args["shard_size"],
            address=engine_args["address"],
            max_batch_tokens=engine_args["max_batch_tokens"],
            timeouts=Timeouts(
                placement_s=engine_args["placement_timeout"],
                load_s=engine_args["load_timeout"],
                step_s=engine_args["step_timeout"],
                collective_s=engine_args["collective_timeout"],
            ),
        )
        cfg = EvaluatorConfig.from_cli(args)
        output = run_evaluation(cfg, engine)
    except (RayEvalError, ValueError, FileNotFoundError) as exc:
        print(f"rayeval run: error: {exc}", file=sys.stderr)
        return 2
    if output is None:
        return 0
    results = output.results
    batch_sizes = ",".join(map(str, results["config"].get("batch_sizes", [])))
    print(
        f"{cfg.model} ({cfg.model_args}), gen_kwargs: ({cfg.gen_kwargs}), limit: {cfg.limit}, "
        f"num_fewshot: {cfg.num_fewshot}, batch_size: {cfg.batch_size}"
        f"{f' ({batch_sizes})' if batch_sizes else ''}, layout: "
        f"{engine.num_replicas}x{engine.shard_size}"
    )
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    for phase, stats in output.stats.items():
        print(
            f"{phase}: {stats['requests']} requests in {stats['micro_batches']} micro-batches, "
            f"{stats['tokens_per_s']:,.0f} tokens/s, real-token fraction {stats['real_token_fraction']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
