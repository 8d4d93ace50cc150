"""``rayeval submit/status/results/cancel``: the REST service from the shell, via
:mod:`rayeval.api.client`.

``submit`` reads the flags of ``rayeval run`` (lm-eval's own parser, same meanings) into the one
configuration object and posts it; with ``--wait`` it shows a progress bar per request type, then
prints lm-eval's table and, with ``--output_path``, writes the files ``lm_eval`` writes. Options
that are the server's (task directories, caches, loggers) are refused with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError, RayEvalError
from rayeval.api.cli.evaluation_flags import (
    GROUP_TITLE,
    adapt_lm_eval_flags,
    add_config_flags,
    config_from_args,
)
from rayeval.api.cli.remote_sweeps import (
    SWEEP_FLAGS,
    add_remote_sweep_flags,
    sweep_results,
    with_sweep,
)
from rayeval.api.client import RayEvalClient, ServiceError
from rayeval.service.console import LINE_INTERVAL_S, is_terminal
from rayeval.service.result_files import write_lm_eval_files
from rayeval.service.vocabulary.events import PhaseCounts
from rayeval.service.vocabulary.lm_eval_options import LM_EVAL_HOST_FIELDS

#: A request type's bar: the server's rates (tqdm's own would time this client's polls).
_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} req [{elapsed}{postfix}]"
#: The commands this module runs.
COMMANDS = ("submit", "status", "results", "cancel", "audit")
_REMOTE_FLAGS = ("url", "token", "wait")
#: lm-eval ``run`` flags the server's operator sets: ``submit`` refuses them, and does not offer
#: them in its help.
SERVER_SET = LM_EVAL_HOST_FIELDS | {"include_path"}


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``submit``, ``status``, ``results`` and ``cancel``: the REST service from the shell."""
    _add_submit_parser(subparsers)
    status = subparsers.add_parser(
        "status", help="list evaluations on a server, or show one (--watch: progress bars)"
    )
    status.add_argument("id", nargs="?", help="an evaluation id (none: list the newest)")
    status.add_argument(
        "--watch",
        action="store_true",
        help="follow the evaluation's progress bars until it ends (not `rayeval watch`, which "
        "evaluates new checkpoints)",
    )
    add_server_flags(status)
    results = subparsers.add_parser(
        "results", help="print a finished evaluation's results, or write lm-eval's files"
    )
    results.add_argument(
        "id", help="the evaluation id, or a sweep's --output_path (or its sweep.json)"
    )
    results.add_argument(
        "--output_path",
        default=None,
        help="write lm-eval's results file (and samples files) under this directory",
    )
    results.add_argument("--json", action="store_true", help="print the results JSON itself")
    add_server_flags(results)
    cancel = subparsers.add_parser("cancel", help="cancel an evaluation on a server")
    cancel.add_argument("id", help="the evaluation id")
    add_server_flags(cancel)
    audit = subparsers.add_parser("audit", help="a server's audit trail, newest first (admins)")
    audit.add_argument("--actor", default=None, help="only this user's actions")
    audit.add_argument("--action", default=None, help="only this action (submit, cancel, ...)")
    audit.add_argument("--limit", type=int, default=50, help="most entries (default 50)")
    add_server_flags(audit)


class _Renamed:
    """Hands lm-eval's ``Run`` a subparsers object that names its parser ``name``."""

    def __init__(self, subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> None:
        self._subparsers = subparsers
        self._name = name
        self._kwargs = kwargs

    def add_parser(self, _name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._subparsers.add_parser(
            self._name, **{**kwargs, **self._kwargs}
        )
        return parser


def _add_submit_parser(subparsers: argparse._SubParsersAction) -> None:
    """``submit``: lm-eval's ``run`` parser renamed, rayeval's flags, the server's flags."""
    from lm_eval._cli.run import Run

    submit = Run.create(
        _Renamed(
            subparsers,
            "submit",
            help="send an evaluation to a rayeval server (rayeval run's flags)",
            description="Submit an evaluation to a rayeval server: the flags of `rayeval run` "
            "(task directories and models are the server's). With --wait, follow it with "
            "progress bars, print lm-eval's table, and write lm-eval's files to --output_path.",
            usage="rayeval submit --model_args pretrained=SERVER_PATH_OR_ID --tasks TASKS "
            "[--num_replicas R] [--shard_size G] [--wait] [--url URL] [lm-eval options]",
            epilog=None,
        )  # type: ignore[arg-type]
    )._parser
    submit.prog = "rayeval submit"
    adapt_lm_eval_flags(submit)
    for name in sorted(SERVER_SET):  # refused by submission_body: not offered either
        submit._option_string_actions[f"--{name}"].help = argparse.SUPPRESS
    add_config_flags(submit.add_argument_group(GROUP_TITLE))
    remote = submit.add_argument_group("the server")
    add_server_flags(remote)  # type: ignore[arg-type]
    remote.add_argument(
        "--wait",
        action="store_true",
        help="follow the evaluation's progress bars until it ends, then print its results (as "
        "`rayeval status --watch ID` follows one already submitted)",
    )
    add_remote_sweep_flags(submit.add_argument_group("checkpoints (paths on the server)"))


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--token``: the server a client command talks to."""
    parser.add_argument(
        "--url",
        default=os.environ.get("RAYEVAL_URL", "http://127.0.0.1:8000"),
        help="the rayeval server (default: $RAYEVAL_URL, else http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="your API key, or the server's API token (default: $RAYEVAL_API_TOKEN; prefer the "
        "variable: command lines are visible to other users)",
    )


def main(args: argparse.Namespace) -> int:
    """Run one client command.

    Returns:
        The exit status: 0; 1 when the server refused (its message is printed: 401, 403, 404,
        409, 422 ...) or could not be reached, or the evaluation failed; 2 for a usage error
        (flags that cannot make a request).
    """
    token = args.token or os.environ.get("RAYEVAL_API_TOKEN") or None
    try:
        with RayEvalClient(args.url, token=token) as client:
            if args.command == "submit":
                return _submit(client, args)
            if args.command == "status":
                return _status(client, args)
            if args.command == "results":
                return _results(client, args.id, args.output_path, args.json)
            if args.command == "audit":
                return _audit(client, args)
            print(_line(client.cancel(args.id)))
            return 0
    except ServiceError as exc:
        print(f"rayeval {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (RayEvalError, ValueError, TypeError) as exc:
        print(f"rayeval {args.command}: error: {exc}", file=sys.stderr)
        return 2


def submission_body(
    args: argparse.Namespace, read_config: Callable[..., Any] = config_from_args
) -> Any:
    """The body of ``POST /evaluations`` from ``rayeval submit``'s flags.

    Args:
        args: ``rayeval submit``'s parsed command line.
        read_config: Reads ``rayeval run``'s flags into ``(config, host)``.

    Returns:
        The ``EvaluationConfig`` to post.

    Raises:
        ConfigError: a bad flag, or one that only the server's operator sets.
    """
    given = vars(args)
    refused = [f"--{name}" for name in SERVER_SET if given.get(name)]
    if refused:
        raise ConfigError(
            f"{', '.join(sorted(refused))}: the server's operator sets these (task directories, "
            "caches and loggers live on the server); drop them, or use `rayeval run`"
        )
    dropped = (*_REMOTE_FLAGS, *SWEEP_FLAGS)
    local = argparse.Namespace(**{k: v for k, v in given.items() if k not in dropped}, address=None)
    if not given.get("output_path"):
        # lm-eval refuses --log_samples without --output_path; remotely the server keeps the
        # samples, so its check must pass. The path is only checked, never written.
        local.output_path = "server"
    config, _ = read_config(local)
    return with_sweep(config, args)


def _submit(client: RayEvalClient, args: argparse.Namespace) -> int:
    config = submission_body(args)
    evaluation = client.submit(config.to_json())
    print(f"submitted {evaluation['id']} ({client.url}/#{evaluation['id']})", flush=True)
    if not args.wait:
        return 0
    final = watch(client, evaluation["id"])
    if final["status"] != "succeeded":
        print(_line(final), file=sys.stderr)
        return 1
    return _results(client, final["id"], args.output_path, as_json=False)


def _status(client: RayEvalClient, args: argparse.Namespace) -> int:
    if args.id is None:
        for evaluation in client.list_evaluations(limit=20)["items"]:
            print(_line(evaluation))
        return 0
    evaluation = watch(client, args.id) if args.watch else client.get(args.id)
    print(_line(evaluation))
    for phase, p in _phases(evaluation).items():
        from_cache = f" ({p.cached} from cache)" if p.cached else ""
        print(f"  {phase}: {p.done}/{p.total} requests{from_cache}, {p.tokens_per_s:,.0f} tokens/s")
    return 0 if evaluation["status"] != "failed" else 1


def _audit(client: RayEvalClient, args: argparse.Namespace) -> int:
    page = client.audit(actor=args.actor, action=args.action, limit=args.limit)
    for entry in page["items"]:
        detail = json.dumps(entry["detail"], sort_keys=True) if entry["detail"] else ""
        print(
            f"{entry['at']}  {entry['actor']:<16} {entry['action']:<12} {entry['target']}  {detail}"
        )
    print(f"({len(page['items'])} of {page['total']})")
    return 0


def watch(client: RayEvalClient, evaluation_id: str, stream: Any = None) -> dict[str, Any]:
    """Follow an evaluation with one progress bar per request type; return its final state.

    Args:
        client: The server's client.
        evaluation_id: The evaluation.
        stream: Where the bars go (default: standard error).
    """
    from tqdm import tqdm

    stream = stream or sys.stderr
    if not is_terminal(stream):  # a file or a pipe: no cursor movements, no redrawn bars
        return _watch_in_lines(client, evaluation_id, stream)
    bars: dict[str, Any] = {}
    status_bar = tqdm(total=0, bar_format="{desc}", position=0, file=stream)

    def update(evaluation: dict[str, Any]) -> None:
        where = _where(evaluation, elapsed=True)
        if status_bar.desc != f"{evaluation_id}: {where}":  # a redraw only when it changed
            status_bar.set_description_str(f"{evaluation_id}: {where}")
        for phase, p in _phases(evaluation).items():
            bar = bars.get(phase)
            if bar is None:
                bar = bars[phase] = tqdm(
                    total=p.total,
                    desc=phase,
                    unit="req",
                    position=len(bars) + 1,
                    file=stream,
                    bar_format=_BAR,
                )
            bar.total = p.total
            bar.n = p.done
            figures = {"req_s": f"{p.requests_per_s:,.1f}", "tok_s": f"{p.tokens_per_s:,.0f}"}
            if p.cached:
                figures["from_cache"] = str(p.cached)
            bar.set_postfix(figures, refresh=False)
            bar.refresh()

    try:
        return client.wait(evaluation_id, on_update=update)
    finally:
        for bar in bars.values():
            bar.close()
        status_bar.close()


def _watch_in_lines(client: RayEvalClient, evaluation_id: str, stream: Any) -> dict[str, Any]:
    """:func:`watch` for a stream that is not a terminal: plain lines, one per change of state
    and per request type at most every :data:`LINE_INTERVAL_S` seconds (and when it ends)."""
    import time

    said: dict[str, Any] = {}  # "status" -> the last state said; phase -> (done, when)

    def update(evaluation: dict[str, Any]) -> None:
        where = _where(evaluation, elapsed=False)
        if said.get("status") != where:  # a line per stage, not per second in it
            said["status"] = where
            shown = _where(evaluation, elapsed=True)
            print(f"{evaluation_id}: {shown}", file=stream, flush=True)
        now = time.monotonic()
        for phase, p in _phases(evaluation).items():
            done, when = said.get(phase, (None, -LINE_INTERVAL_S))
            if p.done == done or (p.done < p.total and now - when < LINE_INTERVAL_S):
                continue
            said[phase] = (p.done, now)
            from_cache = f", {p.cached} from cache" if p.cached else ""
            print(
                f"{phase}: {p.done}/{p.total} req ({p.requests_per_s:,.1f} req/s, "
                f"{p.tokens_per_s:,.0f} tokens/s{from_cache})",
                file=stream,
                flush=True,
            )

    return client.wait(evaluation_id, on_update=update)


def _where(evaluation: dict[str, Any], elapsed: bool) -> str:
    """The state in words: the queue position, or what it does between batches (the stage, with
    its seconds so far when ``elapsed``)."""
    where = str(evaluation["status"])
    if evaluation.get("queue_position"):
        where += f" (queue #{evaluation['queue_position']})"
    stage = evaluation["progress"].get("stage")  # absent from older servers
    if stage and stage["name"] != "computing":
        where += f": {stage['label']}" + (f" ({stage['elapsed_s']:.0f} s)" if elapsed else "")
    return where


def _phases(evaluation: dict[str, Any]) -> dict[str, PhaseCounts]:
    """An evaluation's progress per request type, as the server answered it."""
    return {
        phase: PhaseCounts.parse(counts)
        for phase, counts in evaluation["progress"]["phases"].items()
    }


def _results(
    client: RayEvalClient, evaluation_id: str, output_path: str | None, as_json: bool
) -> int:
    if client.get(evaluation_id).get("kind", "evaluation") != "evaluation":
        return sweep_results(client, evaluation_id, output_path, as_json)
    text = client.results_text(evaluation_id)
    results = json.loads(text)
    if as_json:
        print(text)
        return 0
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if output_path:
        samples = {
            task: client.samples_text(evaluation_id, task)
            for task in client.get(evaluation_id)["links"]["samples"]
        }
        written = write_lm_eval_files(Path(output_path), text, samples)
        print(f"wrote {written}")
    return 0


def _line(evaluation: dict[str, Any]) -> str:
    progress = evaluation["progress"]
    error = f": {evaluation['error']}" if evaluation.get("error") else ""
    tasks = ",".join(evaluation["request"]["tasks"])
    where = (
        _where(evaluation, elapsed=True) if evaluation["status"] in ("starting", "running") else ""
    )
    stage = where.partition(": ")[2]  # what it does between batches, if anything
    return (
        f"{evaluation['id']}  {evaluation['status']:<9}  {progress['done']}/{progress['total']}"
        f"  {tasks}{error}" + (f"  ({stage})" if stage else "")
    )


__all__ = ["COMMANDS", "ServiceError", "add_parsers", "main", "submission_body"]
