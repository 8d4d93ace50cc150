"""Training checkpoints from the shell: ``rayeval run --checkpoints``, ``rayeval watch`` and
``rayeval results`` of a sweep.

- ``rayeval run ... --checkpoints A,B,C`` (or a glob, ``run/step-*``, sorted by step) evaluates
  each checkpoint of the model of ``--model_args pretrained=...`` with the same tasks and
  settings, on ranks started once (:func:`rayeval.service.engine.sweep.run_sweep`).
- ``rayeval watch DIR ...`` takes ``run``'s flags and evaluates each checkpoint that appears
  under ``DIR`` once its save is complete, until Ctrl-C or ``--max_checkpoints``
  (:func:`rayeval.service.engine.watch.watch`).
- ``rayeval results OUT`` prints a sweep's table from ``OUT/sweep.json`` (no server involved).

Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rayeval.api.cli.evaluation_flags import GROUP_TITLE, add_config_flags, config_from_args

#: ``run`` flags of a sweep (not lm-eval's, not the evaluation config's).
_SWEEP_FLAGS = ("checkpoints",)
#: ``watch`` flags beside ``run``'s.
_WATCH_FLAGS = ("directory", "poll_interval", "max_checkpoints", "idle_timeout")


def add_checkpoints_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--checkpoints`` to ``rayeval run``."""
    parser.add_argument(
        "--checkpoints",
        default=None,
        metavar="A,B,C|GLOB",
        help="evaluate these training checkpoints of the model of --model_args pretrained=... "
        "one after another, on ranks started once (a sweep): torch.distributed.checkpoint "
        "directories (accelerate's pytorch_model_fsdp_0/ too), safetensors directories, or "
        "LoRA adapter checkpoints (adapter_config.json + adapter_model.safetensors: the base "
        "pretrained= stays loaded and only the adapter is swapped), comma-separated, or a glob "
        "such as run/checkpoint-* (sorted by step: trainer_state.json, else the name). Each "
        "one's lm-eval "
        "files go under --output_path/<checkpoint>/, the sweep's table in "
        "--output_path/sweep.json",
    )


def add_watch_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``watch``: ``run``'s flags, the directory, the polling interval and when to stop."""
    from lm_eval._cli.run import Run

    from rayeval.api.cli.evaluation_flags import adapt_lm_eval_flags, add_ray_flags
    from rayeval.api.cli.remote import _Renamed

    watch = Run.create(
        _Renamed(
            subparsers,
            "watch",
            help="evaluate each new checkpoint of a training run here, as it is saved (on a "
            "server: submit --watch DIR)",
            description="Evaluate every checkpoint that appears under DIR (a DCP directory "
            "with its .metadata written, safetensors files complete, or a LoRA adapter with "
            "its adapter_config.json written: the base pretrained= stays loaded) with rayeval "
            "run's "
            "flags, in this process, on ranks started once, skipping checkpoints evaluated "
            "before (their results under --output_path, or --use_cache). Ctrl-C stops it. "
            "(`rayeval submit --watch DIR` asks a server to do the same; `rayeval status "
            "--watch ID` follows one evaluation's progress.)",
            usage="rayeval watch DIR --model_args pretrained=CONFIG_DIR --tasks TASKS "
            "[--output_path OUT] [--poll_interval S] [--max_checkpoints N] [rayeval run flags]",
            epilog=None,
        )  # type: ignore[arg-type]
    )._parser
    watch.prog = "rayeval watch"
    watch.description = textwrap.fill(watch.description or "", width=88)
    watch.add_argument("directory", metavar="DIR", help="the training run's checkpoint folder")
    adapt_lm_eval_flags(watch)
    add_config_flags(watch.add_argument_group(GROUP_TITLE), queued=False)
    group = watch.add_argument_group("watching")
    group.add_argument(
        "--poll_interval",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between two looks at DIR (0.1 to 3600; default 30)",
    )
    group.add_argument(
        "--max_checkpoints",
        type=int,
        default=None,
        metavar="N",
        help="stop after evaluating N checkpoints (default: run until Ctrl-C)",
    )
    group.add_argument(
        "--idle_timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop after S seconds without a new checkpoint (default: never)",
    )
    add_ray_flags(group)


def _without(args: argparse.Namespace, names: tuple[str, ...]) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in names})


def run_sweep_command(
    args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """``rayeval run --checkpoints``: the sweep, a line per checkpoint, then its table.

    Args:
        args: ``rayeval run``'s parsed command line.
        out: Where the lines and the table go (default: standard output).
        err: Where an error goes (default: standard error).

    Returns:
        0; 1 when a checkpoint was refused or failed; 2 for input that cannot run.
    """
    from rayeval.actors.errors import RayEvalError
    from rayeval.actors.weights.checkpoint_dirs import expand
    from rayeval.service.engine.dispatch.cluster import preflight
    from rayeval.service.engine.sweep import run_sweep

    out = out or sys.stdout
    try:
        config, host = config_from_args(_without(args, _SWEEP_FLAGS))
        preflight(config, host.address, args.oversubscribe)
        on_checkpoint = functools.partial(_print_record, out=out)
        summary = run_sweep(config, host, expand(args.checkpoints), on_checkpoint=on_checkpoint)
    except (RayEvalError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rayeval run: error: {exc}", file=err or sys.stderr)
        return 2
    return _print_summary(summary, host.output_path, out)


def watch_command(args: argparse.Namespace) -> int:
    """``rayeval watch DIR``: evaluate new checkpoints until stopped; then the table.

    Returns:
        0 (also after Ctrl-C), 2 for input that cannot run.
    """
    from rayeval.actors.errors import RayEvalError
    from rayeval.service.engine.dispatch.cluster import preflight
    from rayeval.service.engine.watch import WatchOptions, watch

    try:
        options = WatchOptions(args.poll_interval, args.max_checkpoints, args.idle_timeout)
        config, host = config_from_args(_without(args, _WATCH_FLAGS))
        preflight(config, host.address, args.oversubscribe)
        print(f"watching {args.directory} (Ctrl-C stops)", flush=True)
        summary = watch(args.directory, config, host, options, on_checkpoint=_print_record)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return _print_saved(args.output_path)
    except (RayEvalError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rayeval watch: error: {exc}", file=sys.stderr)
        return 2
    _print_summary(summary, host.output_path)
    return 0


def results_command(args: argparse.Namespace) -> int | None:
    """``rayeval results PATH`` for a sweep saved under PATH; None when PATH names none (then
    ``results`` asks a server for the evaluation of that id)."""
    from rayeval.service.engine.sweep_summary import SUMMARY_FILE, read_summary, table

    path = Path(args.id)
    if not (path.is_file() or (path / SUMMARY_FILE).is_file()):
        return None
    try:
        summary = read_summary(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"rayeval results: error: {path} is not a readable sweep summary: {exc}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        import json

        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(table(summary))
    return 0


def _print_record(record: Any, out: TextIO | None = None) -> None:
    seconds = record.seconds
    timing = ", ".join(
        f"{name} {seconds[name]:.2f}s" for name in ("swap", "compute", "total") if name in seconds
    )
    line = f"{record.label}: {record.status}" + (f" ({timing})" if timing else "")
    print(line, file=out or sys.stdout, flush=True)


def _print_summary(summary: Any, output_path: str | None, out: TextIO | None = None) -> int:
    from rayeval.service.engine.sweep_summary import SUMMARY_FILE, table

    print(table(summary), file=out or sys.stdout)
    if output_path:
        print(f"sweep summary: {Path(output_path) / SUMMARY_FILE}", file=out or sys.stdout)
    bad = [r for r in summary.checkpoints if r.status in ("refused", "failed")]
    return 1 if bad else 0


def _print_saved(output_path: str | None) -> int:
    """After Ctrl-C: the table of what the watch wrote, if it wrote a summary."""
    from rayeval.service.engine.sweep_summary import SUMMARY_FILE, read_summary, table

    if output_path and (Path(output_path) / SUMMARY_FILE).is_file():
        print(table(read_summary(output_path)))
    return 0
