"""bench_engine.py's output: the figures of every row as JSON-ready dicts, and the printed tables.

:func:`report` prints the header, the table of rows, the per-request-type table and the notes
(workload tokens, load breakdown, agreement problems, warnings), and returns every figure.
What each column means is in bench_engine.py's module docstring.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.agreement import Agreement
from benchmarks.common import PHASES, PhaseFigures, format_table
from benchmarks.engine_runs import Row

ROW_COLUMNS = [
    "row", "load s", "eval s", "total s", "LM s", "req/s", "tok/s", "real-tok", "total vs hf",
    "LM vs hf", "max|dmetric|", "max|dlogprob|", "diffs",
]  # fmt: skip
PHASE_COLUMNS = [
    "request type", "row", "requests", "LM s", "req/s", "tok/s", "engine s", "micro-batches",
    "real-tok", "replica util",
]  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _speedup(value: float | None) -> str:
    return _fmt(value, ".2f") + ("x" if value else "")


def workload_tokens(rows: list[Row]) -> tuple[dict[str, int], list[str]]:
    """Real tokens per request type as rayeval counts them; warns when layouts disagree."""
    tokens: dict[str, int] = {}
    warnings = []
    for row in rows:
        for phase, figures in row.phases.items():
            if figures.real_tokens is None:
                continue
            if phase in tokens and tokens[phase] != figures.real_tokens:
                warnings.append(
                    f"{row.name}: {phase} has {figures.real_tokens} real tokens, another layout "
                    f"{tokens[phase]} (planning should not depend on the layout)"
                )
            tokens.setdefault(phase, figures.real_tokens)
    return tokens, warnings


def _phase_figures(phase: str, figures: PhaseFigures, tokens: dict[str, int]) -> dict[str, Any]:
    return {
        **vars(figures),
        "requests_per_s": figures.requests / figures.seconds if figures.seconds else None,
        "tokens_per_s": (
            tokens[phase] / figures.seconds if phase in tokens and figures.seconds else None
        ),
        "real_token_fraction": figures.real_token_fraction(),
    }


def row_figures(
    row: Row, hf: Row | None, tokens: dict[str, int], agreement: Agreement | None
) -> dict[str, Any]:
    """Every figure of one row, with its speed-ups against the hf row (if any) of the run."""
    total_tokens = sum(tokens.values()) if tokens else None
    lm_s = row.lm_s
    covered = tokens and all(phase in tokens for phase in row.phases)
    return {
        "name": row.name,
        "layout": row.layout,
        "load_s": row.load_s,
        "start_s": row.start_s,
        "eval_s": row.eval_s,
        "close_s": row.close_s,
        "total_s": row.total_s,
        "lm_s": lm_s,
        "requests": row.requests,
        "requests_per_s": row.requests / lm_s if lm_s else None,
        "tokens_per_s": total_tokens / lm_s if covered and lm_s and total_tokens else None,
        "real_token_fraction": row.real_token_fraction(),
        "speedup_total_vs_hf": hf.total_s / row.total_s if hf and row is not hf else None,
        "speedup_lm_vs_hf": hf.lm_s / lm_s if hf and row is not hf and lm_s else None,
        "load_reports": row.load_reports,
        "phases": {
            phase: _phase_figures(phase, figures, tokens) for phase, figures in row.phases.items()
        },
        "agreement": vars(agreement) if agreement is not None else None,
    }


def _row_cells(row: Row, fig: dict[str, Any], agreement: Agreement | None) -> list[str]:
    return [
        row.name,
        _fmt(row.load_s, ".2f"),
        _fmt(row.eval_s, ".2f"),
        _fmt(row.total_s, ".2f"),
        _fmt(row.lm_s, ".2f"),
        _fmt(fig["requests_per_s"], ",.0f"),
        _fmt(fig["tokens_per_s"], ",.0f"),
        _fmt(fig["real_token_fraction"], ".3f"),
        _speedup(fig["speedup_total_vs_hf"]),
        _speedup(fig["speedup_lm_vs_hf"]),
        "baseline" if agreement is None else f"{agreement.max_metric_diff:.1e}",
        "" if agreement is None else f"{agreement.max_logprob_diff:.1e}",
        "" if agreement is None else str(agreement.discrete_diffs + len(agreement.problems)),
    ]


def _phase_cells(phase: str, row: Row, f: PhaseFigures, tokens: dict[str, int]) -> list[str]:
    utilisation = (
        "n/a"
        if f.replica_utilisation is None
        else "/".join(f"{u:.2f}" for u in f.replica_utilisation.values()) or "-"
    )
    return [
        phase,
        row.name,
        str(f.requests),
        _fmt(f.seconds, ".2f"),
        _fmt(f.requests / f.seconds if f.seconds else None, ",.0f"),
        _fmt(tokens[phase] / f.seconds if phase in tokens and f.seconds else None, ",.0f"),
        _fmt(f.engine_seconds, ".2f"),
        "n/a" if f.micro_batches is None else str(f.micro_batches),
        _fmt(f.real_token_fraction(), ".3f"),
        utilisation,
    ]


def phase_table(rows: list[Row], tokens: dict[str, int]) -> str:
    """Per request type, then per row: LM time, rates and rayeval's engine figures."""
    cells = [
        _phase_cells(phase, row, row.phases[phase], tokens)
        for phase in PHASES
        for row in rows
        if phase in row.phases
    ]
    return format_table(PHASE_COLUMNS, cells)


def _print_notes(
    rows: list[Row], agreements: dict[str, Agreement], tokens: dict[str, int], warnings: list[str]
) -> None:
    if tokens:
        print(
            "\nworkload tokens (rayeval real tokens): "
            + ", ".join(f"{phase} {count:,}" for phase, count in tokens.items())
        )
    for row in rows:
        if row.load_reports:
            secs = ", ".join(f"{r.get('seconds', 0):.2f}" for r in row.load_reports)
            print(
                f"{row.name}: load {row.load_s:.2f} s = constructor {row.start_s or 0:.2f} s "
                f"(tokeniser, placement group, actors created) + waiting for the ranks; "
                f"per-rank setup (process group + model load) s: {secs}"
            )
    for name, agreement in agreements.items():
        if agreement.max_metric_name:
            print(
                f"{name}: largest metric difference at {agreement.max_metric_name}; "
                f"{agreement.samples} samples compared"
            )
        for problem in agreement.problems[:5]:
            print(f"{name}: PROBLEM {problem}")
    for warning in warnings:
        print(f"WARNING {warning}")


def report(
    args: argparse.Namespace,
    rows: list[Row],
    agreements: dict[str, Agreement],
    header: dict[str, Any],
) -> dict[str, Any]:
    """Print the header, both tables and the notes; return every figure (the JSON output).

    Args:
        args: The benchmark's parsed arguments.
        rows: Every row that ran, the baseline first.
        agreements: Each non-baseline row's comparison with the baseline, by row name.
        header: What was run where, printed as ``key value`` lines.

    Returns:
        ``header``, per-row figures, workload tokens and warnings.
    """
    tokens, warnings = workload_tokens(rows)
    hf = next((row for row in rows if row.layout is None), None)
    figures = [row_figures(row, hf, tokens, agreements.get(row.name)) for row in rows]

    print()
    for key, value in header.items():
        print(f"{key:<18} {value}")
    print()
    cells = [
        _row_cells(row, fig, agreements.get(row.name))
        for row, fig in zip(rows, figures, strict=True)
    ]
    print(format_table(ROW_COLUMNS, cells))
    print()
    print(phase_table(rows, tokens))
    _print_notes(rows, agreements, tokens, warnings)
    return {"header": header, "rows": figures, "workload_tokens": tokens, "warnings": warnings}
