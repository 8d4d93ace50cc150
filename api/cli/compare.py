"""``rayeval compare A B``: is the difference between two evaluations real?

A and B are result directories as lm-eval writes them (``results_*.json`` and
``samples_*.jsonl``: the ``--output_path`` of ``rayeval run`` or ``lm_eval run``, or a results
file) or evaluation ids on a rayeval server (``--url``). Two ids are compared by the server
(``GET /compare``); a directory is read here, and an id beside it is fetched from the server. The
statistics are :mod:`rayeval.service.comparison`'s either way. ``--json`` prints exactly what
``GET /compare`` answers; otherwise a table, significant differences marked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rayeval.actors.errors import RayEvalError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``compare``: two result directories or evaluation ids, ``--json``, the server."""
    from rayeval.api.cli.remote import add_server_flags

    compare = subparsers.add_parser(
        "compare",
        help="paired comparison of two evaluations: is the difference real?",
        description="Pair two evaluations' samples by task and document and report, per task "
        "and metric, the difference (B - A) with a paired 95%% interval and p-value (McNemar's "
        "exact test for 0/1 metrics, a paired sign-flip permutation test otherwise), the "
        "unpaired interval from each run's stderr, and how many documents flipped each way. "
        "Both must have logged samples (--log_samples) on the same documents with the same "
        "few-shot settings.",
    )
    for name, which in (("a", "the first (A)"), ("b", "the second (B): differences are B - A")):
        compare.add_argument(
            name,
            metavar=name.upper(),
            help=f"{which}: a result directory (lm-eval's --output_path, or a results_*.json "
            "file) or an evaluation id on the server",
        )
    compare.add_argument("--json", action="store_true", help="print GET /compare's JSON itself")
    add_server_flags(compare)


def command(args: argparse.Namespace) -> int:
    """Compare, and print the comparison.

    Returns:
        The exit status: 0; 1 when the server refused or could not be reached (its message is
        printed); 2 when the two cannot be compared (the message says why).
    """
    from rayeval.api.client import ServiceError

    try:
        answer = comparison(args.a, args.b, args.url, _token(args))
    except ServiceError as exc:
        print(f"rayeval compare: error: {exc}", file=sys.stderr)
        return 1
    except RayEvalError as exc:
        print(f"rayeval compare: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2) if args.json else render(answer))
    return 0


def comparison(a: str, b: str, url: str, token: str | None) -> dict[str, Any]:
    """The comparison of ``a`` and ``b`` (directories or ids), as ``GET /compare`` answers it.

    Raises:
        RayEvalError: a directory that holds no single run, a server that refused or could not
            be reached, or two evaluations that cannot be paired.
    """
    from rayeval.api.client import RayEvalClient
    from rayeval.service.comparison import compare
    from rayeval.service.result_files import read_run

    local = [_is_path(name) for name in (a, b)]
    if all(local):
        return compare(read_run(a), read_run(b)).to_json()
    with RayEvalClient(url, token=token) as client:
        if not any(local):
            answer: dict[str, Any] = client.compare(a, b)
            return answer
        first, second = (
            read_run(name) if here else _fetch(client, name)
            for name, here in zip((a, b), local, strict=True)
        )
    return compare(first, second).to_json()


def _is_path(name: str) -> bool:
    """A directory or file here (a name with a slash that is not there is an error, not an id)."""
    from rayeval.actors.errors import ConfigError

    if Path(name).expanduser().exists():
        return True
    if os.sep in name or name.startswith("."):
        raise ConfigError(f"{name} does not exist: give a result directory or an evaluation id")
    return False


def _fetch(client: Any, evaluation_id: str) -> Any:
    """A server's evaluation as a comparison reads it: its results and samples."""
    from rayeval.service.comparison import EvaluationSamples, IncomparableError
    from rayeval.service.result_files import parse_samples

    tasks = client.get(evaluation_id)["links"]["samples"]
    if not tasks:
        raise IncomparableError(
            f"evaluation {evaluation_id} has no samples (it was submitted without log_samples): "
            "a comparison pairs documents"
        )
    samples = {task: parse_samples(client.samples_text(evaluation_id, task)) for task in tasks}
    return EvaluationSamples(evaluation_id, client.results(evaluation_id), samples)


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get("RAYEVAL_API_TOKEN") or None


# ----------------------------------------------------------------------------- the table
_COLUMNS = (
    "task",
    "metric",
    "filter",
    "docs",
    "A",
    "B",
    "B - A",
    "paired 95% interval",
    "p",
    "test",
    "unpaired 95% interval",
    "moved +/-",
)


def render(answer: dict[str, Any]) -> str:
    """The comparison as a table: one row per task and metric, ``*`` after a significant p."""
    rows = [[str(cell) for cell in _row(metric)] for metric in answer["metrics"]]
    widths = [max(len(c) for c in column) for column in zip(_COLUMNS, *rows, strict=True)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "|" + "|".join(f" {c:<{w}} " for c, w in zip(cells, widths, strict=True)) + "|"

    lines = [
        f"Paired comparison, B - A ({answer['confidence']:.0%} intervals; "
        f"{answer['iterations']:,} bootstrap resamples, seed {answer['seed']})",
        f"  A: {answer['a']}{_differs(answer, 0)}",
        f"  B: {answer['b']}{_differs(answer, 1)}",
        "",
        line(_COLUMNS),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *(line(row) for row in rows),
        "",
        "* significant at the 5% level. moved: documents B got right and A wrong (+), and the "
        "reverse (-); for other metrics, documents whose value rose (+) or fell (-); for corpus "
        "metrics (perplexities, bits per byte), documents whose log-likelihood rose (+) or fell "
        "(-); n/a: the metric has no value per document.",
    ]
    for label, tasks in answer["unpaired_tasks"].items():
        if tasks:
            lines.append(f"Only {label} has samples of {', '.join(tasks)} (not compared).")
    return "\n".join(lines)


def _differs(answer: dict[str, Any], side: int) -> str:
    """What tells this side apart from the other (dtype, layout, ...), or nothing."""
    differs = answer.get("differs") or {}  # absent from older servers
    shown = ", ".join(f"{name} {values[side]}" for name, values in differs.items())
    return f" ({shown})" if shown else ""


def _row(metric: dict[str, Any]) -> list[Any]:
    mark = " *" if metric["significant"] else ""
    flipped = metric["flipped"]
    return [
        metric["task"],
        metric["metric"],
        metric["filter"],
        metric["documents"],
        _number(metric["a"]),
        _number(metric["b"]),
        _number(metric["difference"], signed=True),
        _interval(metric["paired_interval"]),
        _number(metric["p_value"]) + mark,
        metric["test"],
        _interval(metric["unpaired_interval"]),
        f"+{flipped['better']}/-{flipped['worse']}" if metric.get("moved") else "n/a",
    ]


def _number(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _interval(bounds: list[float | None] | None) -> str:
    if bounds is None:
        return "n/a"
    return f"[{_number(bounds[0], signed=True)}, {_number(bounds[1], signed=True)}]"
