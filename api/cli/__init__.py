"""The ``rayeval`` command line: the parser and the dispatch to one module per command.

- ``rayeval run`` (:mod:`.run`) takes lm-eval's own ``run`` flags — its parser is reused, so
  every flag means what it means in ``lm_eval`` — plus the layout and Ray options, generated from
  the evaluation's configuration (:mod:`.evaluation_flags`). It is also the entrypoint for
  ``ray job submit``.
- ``rayeval serve`` (:mod:`.serve`) runs the REST service (see ``rayeval.api.app``).
- ``rayeval submit`` takes ``run``'s flags and sends the evaluation to a server instead, and
  ``rayeval status/results/cancel`` follow it there, with progress bars; ``rayeval audit``
  reads the server's audit trail (:mod:`.remote`).
- ``rayeval users`` manages users and API keys on the server's database (:mod:`.users`).
- ``rayeval run --checkpoints`` (a sweep over training checkpoints), ``rayeval watch DIR`` (each
  new checkpoint of a training run) and ``rayeval results OUT`` of a sweep (:mod:`.sweep`).
  "watch" names three things: ``rayeval watch DIR`` (checkpoints, here), ``submit --watch DIR``
  (checkpoints, on a server) and ``status --watch ID`` (one evaluation's progress bars).
- ``rayeval compare A B`` (:mod:`.compare`): a paired comparison of two evaluations' result
  directories, or of two evaluations on a server.
- ``rayeval parity`` (:mod:`.parity`): lm-eval hf at several batch sizes and rayeval at the
  layouts a team plans to use, on a sample of its own model and tasks, with a verdict per layout.

``run``, ``parity`` and ``serve --demo`` keep the console for rayeval's own lines and send the
rest to a log file (:mod:`.console`; ``--verbose`` shows everything).

Every flag takes both spellings (``--model_args``, ``--model-args``), and an unknown flag is
refused under its command's usage naming the nearest one (:mod:`.parsing`).

Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The ``rayeval`` parser: ``run``, ``watch``, ``serve``, ``submit``, ``status``, ``results``,
    ``cancel``, ``compare``, ``parity``.

    Returns:
        The parser; ``args.command`` names the command given.
    """
    from rayeval.api.cli import compare, parity, remote, run, serve, sweep, users
    from rayeval.api.cli.parsing import SPELLINGS_NOTE, Parser, leaves

    parser = Parser(
        prog="rayeval",
        description="Distributed lm-evaluation-harness on Ray, with FSDP2-sharded models. "
        + SPELLINGS_NOTE,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run.add_parser(subparsers)
    sweep.add_watch_parser(subparsers)
    serve.add_parser(subparsers)
    remote.add_parsers(subparsers)
    compare.add_parser(subparsers)
    parity.add_parser(subparsers)
    users.add_parser(subparsers)
    for command in leaves(parser):
        command.epilog = (
            f"{command.epilog.rstrip()}\n\n{SPELLINGS_NOTE}" if command.epilog else SPELLINGS_NOTE
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rayeval`` console script.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(argv)
    from rayeval.api.cli import compare, parity, remote, run, serve, sweep, users
    from rayeval.api.cli.console import basic_logging

    if args.command == "run":  # these three set up their console themselves
        return run.command(args)
    if args.command == "parity":
        return parity.command(args)
    if args.command == "serve":
        return serve.command(args)
    basic_logging()
    if args.command == "users":
        return users.main(args)
    if args.command == "watch":
        return sweep.watch_command(args)
    if args.command == "results" and (status := sweep.results_command(args)) is not None:
        return status
    if args.command == "compare":
        return compare.command(args)
    if args.command in remote.COMMANDS:
        return remote.main(args)
    return 2


__all__ = ["build_parser", "main"]
