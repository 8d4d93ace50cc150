"""``rayeval parity``: before a team trusts rayeval with a large run, the check on its own model,
tasks and hardware, in minutes.

It evaluates a sample of the tasks (``--limit``) with lm-eval's own ``hf`` backend at several batch
sizes (``--hf_batch_sizes``), then with rayeval at each layout the team plans to use
(``--layouts``), and prints lm-eval hf's spread between its own batch sizes, each layout's
distance to the nearest lm-eval hf run, the samples that differ, and a verdict per layout and
overall (the bound of :mod:`rayeval.service.parity`, DESIGN invariant 1). The evaluations are
:mod:`rayeval.service.engine.parity_runs`'s.

lm-eval's flags mean what they mean in ``rayeval run`` (its parser supplies them); the layout
flags of ``run`` are replaced by ``--layouts``.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rayeval.service.parity import figures

#: ``--layouts``' syntax, said in its help and in every refusal of a bad value.
LAYOUT_SYNTAX = (
    "RxG[:STRATEGY], comma-separated: R replicas of G ranks each, STRATEGY how a replica of G > 1 "
    "ranks shards the model (auto, fsdp or tp; default auto), e.g. 1x1,1x2,2x1,2x2:fsdp"
)
STRATEGIES = ("auto", "fsdp", "tp")
#: ``rayeval run``'s flags that ``--layouts`` replaces (rayeval's refusals may name them).
LAYOUT_FLAGS = ("--num_replicas", "--shard_size", "--shard_strategy")
#: ``rayeval run``'s flags that ``parity`` takes as they are: lm-eval's (the model, the tasks and
#: the sample, the prompts, rayeval's micro-batch size) and rayeval's (batching, timeouts, Ray).
RUN_FLAGS = {
    "lm-eval's options (as in `rayeval run` and `lm_eval run`), the same for every run": (
        "model",
        "model_args",
        "tasks",
        "include_path",
        "limit",
        "samples",
        "num_fewshot",
        "gen_kwargs",
        "seed",
        "device",
        "batch_size",
        "max_batch_size",
        "apply_chat_template",
        "system_instruction",
        "fewshot_as_multiturn",
        "trust_remote_code",
        "confirm_run_unsafe_code",
        "metadata",
    ),
    "rayeval's batching and timeouts (as in `rayeval run`), at every layout": (
        "cpus_per_rank",
        "placement",
        "shm_collectives",
        "max_batch_tokens",
        "share_prefixes",
        "continuous_batching",
        "kv_cache_tokens",
        "logits_budget_mib",
        "tokenizer_workers",
        "placement_timeout",
        "load_timeout",
        "step_timeout",
        "collective_timeout",
        "control_timeout",
        "reuse_timeout",
    ),
    "where Ray runs, the console": ("address", "oversubscribe", "verbose"),
}
#: Set for every run, whatever ``run``'s defaults: no file or cache is involved, and stderrs are
#: not bootstrapped (the answers and metrics are what is compared). Samples are logged by
#: :meth:`~rayeval.service.engine.parity_runs.Samples.evaluate` (lm-eval's config would want an
#: output path for ``log_samples``).
FIXED = {
    "output_path": None,
    "use_cache": None,
    "bootstrap_iters": 0,
    "tracking": None,
}
DEVICE_HELP = (
    "what lm-eval hf and every layout's ranks run on: auto (cuda where this machine has a GPU, "
    "else cpu; the default), cpu or cuda. lm-eval hf runs in this process: run parity on a "
    "machine of the kind the ranks use"
)
BATCH_SIZE_HELP = (
    "rayeval's rows per micro-batch at every layout, as `rayeval run --batch_size` (default "
    "auto); lm-eval hf's batch sizes are --hf_batch_sizes"
)

EXAMPLES = """\
examples:
  # the demo model and tasks (`make demo-cli`) on the CPU: one rank, and one replica of 2 ranks
  $ rayeval parity --model_args pretrained=.rayeval/demo/model,dtype=bfloat16 \\
      --include_path .rayeval/demo/tasks --tasks demo_mc,demo_gen_short --limit 10 \\
      --layouts 1x1,1x2 --device cpu

  # before a 64-GPU run: the layouts it will use, on 4 of the cluster's GPUs
  $ rayeval parity --model_args pretrained=/models/m,dtype=bfloat16 --tasks gsm8k,hellaswag \\
      --limit 20 --layouts 1x1,1x2:tp,2x2:fsdp --address auto --output_path parity.json

Exit status: 0 when every layout holds, 1 when one does not (or was refused), 2 for input that
cannot run (the message names the fix).
"""


@dataclass(frozen=True)
class Layout:
    """One ``--layouts`` entry: R replicas of G ranks, sharded by ``strategy``."""

    num_replicas: int
    shard_size: int
    strategy: str = "auto"

    def __str__(self) -> str:
        shown = f"{self.num_replicas}x{self.shard_size}"
        return shown if self.strategy == "auto" else f"{shown}:{self.strategy}"


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """``--layouts``' value: each ``RxG[:STRATEGY]``, in order, without repeats.

    Raises:
        argparse.ArgumentTypeError: a value not in :data:`LAYOUT_SYNTAX` (argparse names the flag).
    """
    layouts = []
    for item in (part.strip() for part in text.split(",")):
        shape, _, strategy = item.partition(":")
        replicas, x, shards = shape.strip().lower().partition("x")
        strategy = strategy.strip().lower() or "auto"
        if not (x and replicas.isdigit() and shards.isdigit()) or strategy not in STRATEGIES:
            raise argparse.ArgumentTypeError(f"{item!r} is not a layout: give {LAYOUT_SYNTAX}")
        layout = Layout(int(replicas), int(shards), strategy)
        if layout.num_replicas < 1 or layout.shard_size < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} has no ranks: R and G are at least 1 ({LAYOUT_SYNTAX})"
            )
        layouts.append(layout)
    return tuple(dict.fromkeys(layouts))


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``--hf_batch_sizes``' value: at least two different positive integers.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give positive integers, comma-separated, e.g. 1,4,16"
        )
    sizes = tuple(dict.fromkeys(int(item) for item in items))
    if len(sizes) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give at least two batch sizes, e.g. 1,4,16 (lm-eval hf's spread is how "
            "far its answers at two batch sizes are apart)"
        )
    return sizes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``parity``: ``--layouts``, ``--hf_batch_sizes``, ``--output_path`` and the flags of
    ``rayeval run`` listed in :data:`RUN_FLAGS`."""
    from rayeval.service.parity import SPREAD_BATCH_SIZES

    parity = subparsers.add_parser(
        "parity",
        help="check rayeval against lm-eval hf on your model, tasks and layouts (minutes)",
        usage="rayeval parity --model_args pretrained=PATH_OR_ID --tasks TASKS --limit N "
        "--layouts RxG[:STRATEGY],... [--hf_batch_sizes B,B,...] [lm-eval options]",
        description=textwrap.fill(
            "Evaluate a sample of the tasks (--limit) with lm-eval's own hf backend at several "
            "batch sizes and with rayeval at each layout, and print, per measure (log-probs, "
            "is_greedy flags, generations, metrics), how far lm-eval hf's runs are from each "
            "other, how far each layout is from the nearest of them, which samples differ, and "
            "a verdict: a layout holds when it is no further from lm-eval hf than lm-eval hf "
            "is from itself (in float32, log-probs within 1e-4 too).",
            width=88,
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    own = parity.add_argument_group("parity")
    own.add_argument(
        "--layouts",
        type=parse_layouts,
        required=True,
        metavar="RxG[:STRATEGY],...",
        help=f"the layouts to check: {LAYOUT_SYNTAX}",
    )
    own.add_argument(
        "--hf_batch_sizes",
        type=parse_batch_sizes,
        default=SPREAD_BATCH_SIZES,
        metavar="B,B,...",
        help="lm-eval hf's batch sizes, whose answers' spread bounds rayeval's (default "
        f"{','.join(map(str, SPREAD_BATCH_SIZES))}: 1 takes other matrix kernels than full "
        "batches on many CPUs)",
    )
    own.add_argument(
        "--output_path",
        default=None,
        metavar="PATH",
        help="also write the report as JSON to this file (a directory: parity.json in it)",
    )
    run = _run_parser()
    actions = {action.dest: action for action in run._actions}
    for title, dests in RUN_FLAGS.items():
        group = parity.add_argument_group(title)
        for name in dests:
            group._add_action(actions[name])
    actions["device"].help = DEVICE_HELP
    actions["batch_size"].help = BATCH_SIZE_HELP


def _run_parser() -> argparse.ArgumentParser:
    """A fresh ``rayeval run`` parser (its actions are moved into ``parity``'s)."""
    from rayeval.api.cli.parsing import Parser
    from rayeval.api.cli.run import add_parser

    subparsers = Parser(prog="rayeval").add_subparsers(dest="command")
    add_parser(subparsers)
    parser: argparse.ArgumentParser = subparsers.choices["run"]
    return parser


def command(args: argparse.Namespace) -> int:
    """Run the parity check ``args`` describe and print its report.

    Returns:
        The exit status: 0 when every layout holds; 1 when one does not, was refused, or its
        answers could not be paired with lm-eval hf's; 2 for input that cannot run (the message
        names the fix).
    """
    import os

    from rayeval.api.cli.console import console

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # as `rayeval run`: no fork from the driver
    with console("parity", verbose=args.verbose) as shown:
        import ray

        had_ray = ray.is_initialized()
        try:
            return _check(args, shown.out, shown.err)
        finally:
            if not had_ray and ray.is_initialized():
                ray.shutdown()


def _check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The check: the usage refused first (exit 2), then lm-eval hf, then each layout."""
    from rayeval.actors.errors import RayEvalError
    from rayeval.service.engine import parity_runs

    try:
        _require_sample(args)
        report_file = _report_file(args.output_path)
        device = parity_runs.resolve_device(args.device)
        configs, host = layout_configs(args, device)
        first = next(iter(configs.values()))
        samples = parity_runs.Samples.resolve(first, host)
        print(_heading(first, device), file=out, flush=True)
        spread = parity_runs.hf_spread(samples, args.hf_batch_sizes, device)
    except (RayEvalError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rayeval parity: error: {exc}", file=err)
        return 2
    print(_spread_lines(spread), file=out, flush=True)
    checks = []
    for check in parity_runs.check_layouts(spread, samples, configs, args.oversubscribe):
        checks.append(check)
        print(_layout_lines(check), file=out, flush=True)
    holds = all(check.holds for check in checks)
    print(_overall(checks), file=out, flush=True)
    if report_file is not None:
        report_file.write_text(json.dumps(_report(args, device, spread, checks), indent=2) + "\n")
        print(f"report: {report_file}", file=out, flush=True)
    return 0 if holds else 1


def layout_configs(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], Any]:
    """Each layout's evaluation on ``device``, as ``rayeval run`` reads its flags, and the host
    options.

    Returns:
        ``({label: EvaluationConfig}, HostOptions)``.

    Raises:
        ConfigError: a bad flag (named).
    """
    from rayeval.api.cli.evaluation_flags import config_from_args

    given = {k: v for k, v in vars(args).items() if k not in ("layouts", "hf_batch_sizes")}
    base = vars(_run_parser().parse_args([])) | given | FIXED | {"device": device}
    base.pop("checkpoints")  # a `run` flag of its own (a sweep), not an evaluation's
    configs, host = {}, None
    for layout in args.layouts:
        namespace = argparse.Namespace(**base)
        namespace.num_replicas = layout.num_replicas
        namespace.shard_size = layout.shard_size
        namespace.shard_strategy = layout.strategy
        configs[str(layout)], host = config_from_args(namespace)
    return configs, host


def _require_sample(args: argparse.Namespace) -> None:
    """Refuse a check of whole tasks: it would take hours, not minutes."""
    from rayeval.actors.errors import ConfigError

    if args.limit is None and args.samples is None:
        raise ConfigError(
            "give --limit N (e.g. --limit 20) or --samples: parity evaluates the sample once per "
            "lm-eval hf batch size and once per layout, minutes on a sample, hours on whole tasks"
        )


def _report_file(output_path: str | None) -> Path | None:
    """Where the JSON report goes (its folder made now, so a bad path fails before the runs)."""
    if not output_path:
        return None
    path = Path(output_path).expanduser()
    if path.is_dir() or output_path.endswith(("/", "\\")):
        path = path / "parity.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output_path {output_path}: {exc}; give a writable path") from None
    return path


# ----------------------------------------------------------------------------- the report
def _heading(config: Any, device: str) -> str:
    limit = f"limit {config.limit:g}" if config.limit is not None else "the --samples given"
    return (
        f"parity of rayeval with lm-eval hf: {config.pretrained} "
        f"({config.model_args.get('dtype', 'dtype auto')}), tasks {','.join(config.tasks)}, "
        f"{limit}, num_fewshot {config.num_fewshot}, on {device}"
    )


def _spread_lines(spread: Any) -> str:
    measures = spread.spread()
    sizes = ", ".join(map(str, spread.batch_sizes))
    lines = [f"lm-eval hf at batch sizes {sizes}: spread ({figures(measures)})"]
    moved = {name: value for name, value in measures.items() if value and ":" in name}
    lines += [
        f"  {name.removeprefix('metric:')} moved by {value:g}" for name, value in moved.items()
    ]
    if not any(measures.values()):
        lines.append("  lm-eval hf gives the same answers at every batch size: rayeval must too")
    return "\n".join(lines)


def _layout_lines(check: Any) -> str:
    strategy = f", {check.strategy}" if check.strategy else ""
    head = f"layout {check.label}{strategy} ({check.seconds:.0f} s)"
    if check.refused is not None:
        # rayeval's messages name `run`'s layout flags; here the layout is one --layouts entry.
        named = any(flag in check.refused for flag in LAYOUT_FLAGS)
        hint = f" (here: change {check.label} in --layouts, {LAYOUT_SYNTAX})" if named else ""
        return f"layout {check.label}: refused by rayeval: {check.refused}{hint}"
    if check.unpaired is not None:
        return (
            f"{head}: does not hold: its samples do not pair with lm-eval hf's ({check.unpaired})"
        )
    judged = check.judgement
    where = judged.where
    differing = ", ".join(where[:10]) + (f" and {len(where) - 10} more" if len(where) > 10 else "")
    lines = [
        f"{head}: distance to the nearest lm-eval hf run ({figures(judged.nearest)})",
        f"  samples whose is_greedy or generation differs: {differing or 'none'}",
    ]
    if judged.holds:
        lines.append(
            f"  {check.label}: holds (no further from lm-eval hf than lm-eval hf is from itself)"
        )
    else:
        beyond = "; ".join(f"{name} {text}" for name, text in judged.beyond.items())
        lines.append(
            f"  {check.label}: does not hold: further from lm-eval hf than lm-eval hf is from "
            f"itself in {beyond}"
        )
    return "\n".join(lines)


def _overall(checks: Sequence[Any]) -> str:
    held = [check.label for check in checks if check.holds]
    refused = [check.label for check in checks if check.refused is not None]
    failed = [c.label for c in checks if not c.holds and c.refused is None]
    if not refused and not failed:
        return f"parity holds at every layout ({', '.join(held)})"
    parts = [f"does not hold at {', '.join(failed)}"] if failed else []
    parts += [f"refused at {', '.join(refused)} (not checked)"] if refused else []
    parts += [f"holds at {', '.join(held)}"] if held else []
    return "parity " + "; ".join(parts)


def _report(
    args: argparse.Namespace, device: str, spread: Any, checks: Sequence[Any]
) -> dict[str, Any]:
    """The report as JSON: the settings, lm-eval hf's spread, each layout, the verdict."""
    return {
        "model_args": args.model_args,
        "tasks": args.tasks,
        "limit": args.limit,
        "num_fewshot": args.num_fewshot,
        "gen_kwargs": args.gen_kwargs,
        "device": device,
        "hf_batch_sizes": list(spread.batch_sizes),
        "spread": spread.spread(),
        "layouts": [check.to_json() for check in checks],
        "holds": all(check.holds for check in checks),
    }
