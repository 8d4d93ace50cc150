"""``rayeval run``: one evaluation in this process (the Ray driver), printed as lm-eval prints it.

The parser is lm-eval's own ``run`` parser plus rayeval's flags
(:mod:`rayeval.api.cli.evaluation_flags`) and ``--address``. It is also the entrypoint for
``ray job submit``: inside a Ray job, ``RAY_ADDRESS`` is set and the job's cluster is used.
With ``--checkpoints`` it evaluates a list of training checkpoints (:mod:`rayeval.api.cli.sweep`).
The console shows rayeval's own lines and the results; the rest goes to a log file
(:mod:`rayeval.api.cli.console`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rayeval.api.cli.evaluation_flags import (
    GROUP_TITLE,
    adapt_lm_eval_flags,
    add_config_flags,
    add_ray_flags,
    config_from_args,
)
from rayeval.api.cli.sweep import add_checkpoints_flag, run_sweep_command

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run``: lm-eval's ``run`` flags, rayeval's layout flags and ``--address``."""
    from lm_eval._cli.run import Run

    run = Run.create(subparsers)._parser
    run.prog = "rayeval run"
    run.usage = (
        "rayeval run --model hf --model_args pretrained=PATH_OR_ID --tasks TASKS "
        "[--num_replicas R] [--shard_size G] [lm-eval options]"
    )
    run.description = textwrap.fill(
        "Evaluate a model on lm-eval's tasks in this process, its ranks on Ray: lm-eval's `run` "
        "flags (same meanings; --model hf only), rayeval's layout, batching and timeouts, and "
        "where Ray runs. A layout larger than this machine (or the --address cluster) is refused "
        "before anything starts.",
        width=88,
    )
    run.epilog = EXAMPLES
    adapt_lm_eval_flags(run)
    add_config_flags(run.add_argument_group(GROUP_TITLE), queued=False)
    add_checkpoints_flag(run)
    add_ray_flags(run)
    run.add_argument(
        "--mlflow_tracking_uri",
        default=None,
        metavar="URI",
        help="record the evaluation as one MLflow run on this tracking server (its "
        "configuration, metrics with stderrs, results and samples files); name the experiment "
        "and run with --tracking experiment=...,run_name=... A tracker that cannot be reached "
        "is a warning, never a failure",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="show every library's log lines and Ray's worker output on the console (by "
        "default they go to a log file under .rayeval/logs, whose path is printed first)",
    )


#: ``rayeval run --help``'s examples (lm-eval's use models rayeval refuses).
EXAMPLES = """\
examples:
  # the bundled demo model and tasks (built by `make demo-cli`), 2 replicas on the CPU
  $ rayeval run --model_args pretrained=.rayeval/demo/model,dtype=float32 \\
      --include_path .rayeval/demo/tasks --tasks demo --num_replicas 2 --device cpu \\
      --output_path out/ --log_samples

  # a hub model, 2 replicas of 2 GPU ranks each (FSDP2 or tensor parallel shards)
  $ rayeval run --model_args pretrained=meta-llama/Llama-3.1-8B,dtype=bfloat16 \\
      --tasks hellaswag,arc_easy --num_fewshot 0 --num_replicas 2 --shard_size 2

  # on an existing Ray cluster (also what `ray job submit -- rayeval run ...` runs)
  $ rayeval run --address auto --model_args pretrained=/models/m --tasks mmlu

`rayeval submit` takes the same flags and sends the evaluation to a server.
"""


def command(args: argparse.Namespace) -> int:
    """Run the evaluation ``args`` describe and print its results.

    Args:
        args: ``rayeval run``'s parsed command line.

    Returns:
        The exit status: 0, or 2 for input that cannot run (the message names the flag); with
        ``--checkpoints``, the sweep's (:func:`rayeval.api.cli.sweep.run_sweep_command`).
    """
    import os

    from rayeval.api.cli.console import console

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lm-eval's bootstrap would fork a pool from this Ray driver's threads; single-process gives
    # the same numbers (see service.jobs.manager).
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    # --write_out prints prompts through lm-eval's log: whoever asks for it reads everything.
    with console("run", verbose=args.verbose or bool(getattr(args, "write_out", False))) as shown:
        return _in_console(args, shown)


def _in_console(args: argparse.Namespace, shown: Any) -> int:
    """The evaluation or the sweep; an embedded Ray it started is shut down before the console
    is given back (its workers' last lines still reach the log)."""
    import ray

    had_ray = ray.is_initialized()
    try:
        if args.checkpoints:
            return run_sweep_command(args, shown.out, shown.err)
        return _run(
            argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "checkpoints"}), shown
        )
    finally:
        if not had_ray and ray.is_initialized():
            ray.shutdown()


def _run(args: argparse.Namespace, shown: Any) -> int:
    """The evaluation, its results on ``shown.out``."""
    from rayeval.actors.errors import ConfigError, RayEvalError
    from rayeval.service.engine.dispatch.cluster import preflight
    from rayeval.service.engine.runner import run_evaluation

    try:
        config, host = config_from_args(args)
        if config.tracking is not None and host.trackers.mlflow_tracking_uri is None:
            raise ConfigError(
                "--tracking names the evaluation's MLflow run: give --mlflow_tracking_uri URI "
                "too (W&B takes lm-eval's --wandb_args)"
            )
        preflight(config, host.address, args.oversubscribe)
        layout = config.parallelism
        logger.info(
            "evaluating %s on %s, layout %dx%d",
            ",".join(config.tasks),
            config.pretrained,
            layout.num_replicas,
            layout.shard_size,
        )
        output = run_evaluation(config, host)
        if output is not None:
            print_output(config, host, output, file=shown.out)
    except (RayEvalError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rayeval run: error: {exc}", file=shown.err)
        return 2
    return 0


def print_output(config: Any, host: Any, output: Any, file: TextIO | None = None) -> None:
    """What ``lm_eval run`` prints (the settings line, the tables), then rayeval's statistics.

    Args:
        config: The evaluation's ``EvaluationConfig``.
        host: Its ``HostOptions`` (``--show_config`` prints the whole results JSON first).
        output: What ``run_evaluation`` returned.
        file: Where to print (default: standard output).
    """
    from lm_eval.utils import make_table

    out = file or sys.stdout
    results = output.results
    if host.lm_eval.get("show_config"):  # as `lm_eval run --show_config`: the whole results JSON
        import json

        from lm_eval.utils import handle_non_serializable

        shown = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        print(shown, file=out)
    batch_sizes = ",".join(map(str, results["config"].get("batch_sizes", [])))
    layout = config.parallelism
    print(
        f"{config.model} ({config.model_args}), gen_kwargs: ({config.gen_kwargs}), "
        f"limit: {config.limit}, num_fewshot: {config.num_fewshot}, "
        f"batch_size: {config.batch_size}{f' ({batch_sizes})' if batch_sizes else ''}, "
        f"layout: {layout.num_replicas}x{layout.shard_size}"
        + (f" ({layout.placement})" if layout.placement != "auto" else ""),
        file=out,
    )
    print(make_table(results), file=out)
    if "groups" in results:
        print(make_table(results, "groups"), file=out)
    _print_statistics(output, out)
    _print_files(getattr(output, "files", []), host.output_path, out)
    out.flush()


def _print_files(files: list[str], output_path: str | None, out: TextIO) -> None:
    """Where lm-eval's files went: a line per file (lm-eval says it only in the log file)."""
    if not output_path:
        print("no files written: --output_path DIR keeps lm-eval's results file there", file=out)
        return
    for path in files:
        kind = "samples" if Path(path).name.startswith("samples_") else "results"
        print(f"{kind}: {path}", file=out)


def _print_statistics(output: Any, out: TextIO) -> None:
    """Per request type: work, cache answers, throughput, padding, replica use; then the ranks."""
    for phase, stats in output.stats.items():
        unit = "continuous-batching groups" if stats.get("batching") == "continuous" else ""
        lost = (
            f", {n} computed again after a replica was lost" if (n := stats.get("requeued")) else ""
        )
        print(
            f"{phase}: {stats['requests']} requests computed in {stats['micro_batches']} "
            f"{unit or 'micro-batches'}{lost} ({stats['cached']} answered from the cache), "
            f"{stats['tokens_per_s']:,.0f} tokens/s, "
            f"real-token fraction {stats['real_token_fraction']:.3f}, replica utilisation "
            + ", ".join(f"r{r}={u:.0%}" for r, u in stats["replica_utilisation"].items()),
            file=out,
        )
    if not output.ranks and any(stats["cached"] for stats in output.stats.values()):
        print("ranks: none started (every answer came from the response cache)", file=out)
    if output.ranks:
        print(
            "ranks: "
            + "; ".join(
                f"r{rank.replica}.s{rank.shard_rank} on {rank.ip} "
                f"(node {rank.node_id[:8]}, pid {rank.pid})"
                for rank in output.ranks
            ),
            file=out,
        )
