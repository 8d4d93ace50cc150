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
  ``lm.load_reports``, which waits until every rank is ready).
* ``eval s`` — the ``simple_evaluate`` call: building tasks and requests, every model call,
  metrics. ``total s`` = load + eval (+ releasing the actors for rayeval).
* ``LM s`` — time spent inside the LM's request methods (``loglikelihood``,
  ``loglikelihood_rolling``, ``generate_until``), summed. This is the model work including the
  LM's own tokenisation, batching and (rayeval) dispatch; the rest of ``eval s`` is lm-eval's
  driver work, identical for every row.
* ``req/s`` — lm-eval requests (``Instance`` objects) / ``LM s``.
* ``tok/s`` — workload tokens / ``LM s``. Workload tokens are the distinct model-input tokens of
  the requests as rayeval's planner counts them (``lm.stats[phase].real_tokens``: identical
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

A per-request-type table follows, with rayeval's own figures (``lm.stats``): ``engine s`` =
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
import gc
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PHASES = ("loglikelihood", "loglikelihood_rolling", "generate_until")
LOGPROB_TOL = 1e-4


# ------------------------------------------------------------------------------------ figures
@dataclass
class PhaseFigures:
    """One request type on one row."""

    requests: int = 0
    seconds: float = 0.0  # inside the LM method
    engine_seconds: float | None = None  # rayeval: dispatch wall time (lm.stats)
    micro_batches: int | None = None
    real_tokens: int | None = None
    padded_tokens: int | None = None
    replica_utilisation: dict[int, float] | None = None  # rayeval: busy share per replica

    def real_token_fraction(self) -> float | None:
        if self.real_tokens is None or not self.padded_tokens:
            return None
        return self.real_tokens / self.padded_tokens


@dataclass
class Row:
    """One way of running the evaluation, and what it measured."""

    name: str
    layout: str | None
    load_s: float = 0.0
    start_s: float | None = None  # rayeval: the constructor alone (actors started, not loaded)
    eval_s: float = 0.0
    close_s: float = 0.0
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    load_reports: list[dict[str, Any]] | None = None
    results: dict[str, Any] | None = None

    @property
    def total_s(self) -> float:
        return self.load_s + self.eval_s + self.close_s

    @property
    def lm_s(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def requests(self) -> int:
        return sum(p.requests for p in self.phases.values())

    def real_token_fraction(self) -> float | None:
        real = sum(p.real_tokens or 0 for p in self.phases.values())
        padded = sum(p.padded_tokens or 0 for p in self.phases.values())
        return real / padded if padded else None


class PhaseTimer:
    """Times the LM's request methods (the calls lm-eval's evaluator makes) on one instance."""

    def __init__(self, lm: Any) -> None:
        self.phases: dict[str, PhaseFigures] = {}
        for phase in PHASES:
            setattr(lm, phase, self._wrap(phase, getattr(lm, phase)))

    def _wrap(self, phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            figures = self.phases.setdefault(phase, PhaseFigures())
            started = time.perf_counter()
            try:
                return method(requests, *args, **kwargs)
            finally:
                figures.seconds += time.perf_counter() - started
                figures.requests += len(requests)

        return timed


# ------------------------------------------------------------------------------------ running
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="lm-eval's hf backend vs rayeval layouts on the same tasks, in one run.",
    )
    parser.add_argument(
        "--layouts",
        default="1x1,2x1",
        help="rayeval layouts RxG, comma-separated (R replicas x G shard ranks; default 1x1,2x1)",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=None,
        help="documents per task (lm-eval's --limit; <1 is a fraction; default: all)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of the hf row and of every rank (default cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="model dtype (default float32; only float32 rows must agree to 1e-4)",
    )
    parser.add_argument(
        "--model", default=None, help="model path or hub id (default: the bundled tiny Llama)"
    )
    parser.add_argument(
        "--tasks", default="demo", help="lm-eval tasks/groups, comma-separated (default demo)"
    )
    parser.add_argument(
        "--include_path", default=None, help="task YAML directory (default: the bundled demo tasks)"
    )
    parser.add_argument("--num_fewshot", type=int, default=0, help="few-shot examples (default 0)")
    parser.add_argument(
        "--batch_size",
        type=int,
        default=16,
        help="rows per batch of the hf row (default 16; lm-eval's 'auto' probes GPU memory)",
    )
    parser.add_argument(
        "--max_batch_tokens",
        type=int,
        default=None,
        help="rayeval padded-token budget per micro-batch (default: the engine's, 8192)",
    )
    parser.add_argument(
        "--hf_threads",
        type=int,
        default=None,
        help="torch threads for the hf row (default: torch's default)",
    )
    parser.add_argument(
        "--num_cpus",
        type=int,
        default=None,
        help="logical CPUs of the local Ray (default: max(cores, largest layout))",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="use an existing Ray cluster instead of starting a local one",
    )
    parser.add_argument(
        "--skip_hf",
        action="store_true",
        help="no lm-eval hf row (e.g. a model larger than one GPU)",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="OUT",
        help="also write every figure as JSON to OUT",
    )
    args = parser.parse_args(argv)
    try:
        args.layouts = [_parse_layout(item) for item in args.layouts.split(",") if item.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    if not args.layouts and args.skip_hf:
        parser.error("nothing to run: give --layouts or drop --skip_hf")
    return args


def _parse_layout(text: str) -> tuple[int, int]:
    try:
        replicas, shards = (int(part) for part in text.strip().lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r} is not RxG, e.g. 2x1") from None
    if replicas < 1 or shards < 1:
        raise ValueError(f"layout {text!r}: R and G must be >= 1")
    return replicas, shards


def set_environment(local_ray: bool) -> None:
    """Offline Hugging Face (the ranks inherit it), quiet tokenizers, local Ray without auth."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if local_ray:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster only


def evaluate(model: Any, args: argparse.Namespace, task_manager: Any) -> dict[str, Any]:
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=model,
        tasks=args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        bootstrap_iters=0,  # stderr bootstrap is driver-side and identical for every row
        log_samples=True,  # for the per-sample agreement check
        task_manager=task_manager,
        device=args.device,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    return results


def evaluate_timed(row: Row, lm: Any, args: argparse.Namespace, task_manager: Any) -> None:
    """Evaluate with ``lm``, recording results, eval wall time and per-phase LM time in ``row``."""
    timer = PhaseTimer(lm)
    started = time.perf_counter()
    row.results = evaluate(lm, args, task_manager)
    row.eval_s = time.perf_counter() - started
    row.phases = timer.phases


def run_hf(args: argparse.Namespace, model_dir: str, task_manager: Any) -> Row:
    """lm-eval's own hf backend in this process."""
    import torch
    from lm_eval.api.registry import get_model

    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    row = Row("lm-eval hf", None)
    started = time.perf_counter()
    # Exactly what simple_evaluate(model="hf", model_args={...}, batch_size=..., device=...) does.
    lm = get_model("hf").create_from_arg_obj(
        {"pretrained": model_dir, "dtype": args.dtype},
        {"batch_size": args.batch_size, "max_batch_size": None, "device": args.device},
    )
    row.load_s = time.perf_counter() - started
    evaluate_timed(row, lm, args, task_manager)
    del lm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def run_rayeval(
    args: argparse.Namespace, model_dir: str, task_manager: Any, layout: tuple[int, int]
) -> Row:
    """One rayeval layout on the already running Ray."""
    from rayeval.service.engine.lm import RayEvalLM

    replicas, shards = layout
    row = Row(f"rayeval {replicas}x{shards}", f"{replicas}x{shards}")
    started = time.perf_counter()
    lm = RayEvalLM(
        pretrained=model_dir,
        num_replicas=replicas,
        shard_size=shards,
        batch_size="auto",
        max_batch_tokens=args.max_batch_tokens,
        device=args.device,
        dtype=args.dtype,
    )
    row.start_s = time.perf_counter() - started
    try:
        # Waits until every rank has loaded the model, so the load stays out of the eval time.
        row.load_reports = lm.load_reports
        row.load_s = time.perf_counter() - started
        evaluate_timed(row, lm, args, task_manager)
        for phase, stats in lm.stats.items():
            figures = row.phases.setdefault(phase, PhaseFigures())
            figures.engine_seconds = stats.seconds
            figures.micro_batches = stats.micro_batches
            figures.real_tokens = stats.real_tokens
            figures.padded_tokens = stats.padded_tokens
            busy = stats.replica_utilisation  # a replica that ran nothing is absent: show 0
            figures.replica_utilisation = {r: busy.get(r, 0.0) for r in range(replicas)}
    finally:
        started = time.perf_counter()
        lm.close()
        row.close_s = time.perf_counter() - started
    return row


def make_task_manager(tasks: list[str], include_path: str) -> Any:
    """Only the include path when it has every task (skips lm-eval's index scan), else both."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_defaults=False, include_path=include_path)
    if all(local.match_tasks([task]) for task in tasks):
        return local
    return TaskManager(include_path=include_path)


# ---------------------------------------------------------------------------------- agreement
@dataclass
class Agreement:
    """How one row's results compare with the baseline row's."""

    max_metric_diff: float = 0.0
    max_metric_name: str = ""
    max_logprob_diff: float = 0.0
    #: the (baseline, other) log-probabilities of the largest difference
    max_logprob_pair: tuple[float, float] | None = None
    #: log-probabilities differing by more than ``logprob_tolerance`` allows
    beyond_tolerance: int = 0
    discrete_diffs: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not self.problems and self.discrete_diffs == 0 and self.beyond_tolerance == 0


def logprob_tolerance(a: float, b: float) -> float:
    """|dlogprob| allowed between two log-probabilities: ``LOGPROB_TOL``, or two float32 ulps.

    A log-probability summed over hundreds of tokens (a ``loglikelihood_rolling`` document) is
    larger than 1024 in magnitude, where float32 values are 1.2e-4 apart: the 1e-4 of the
    invariant is then below float32's own resolution, and two exact computations that sum the
    same tokens in another order (another batch shape) differ by one ulp.
    """
    import numpy

    magnitude = numpy.float32(max(abs(a), abs(b)))
    return max(LOGPROB_TOL, 2 * float(numpy.spacing(magnitude)))


def compare(baseline: dict[str, Any], other: dict[str, Any]) -> Agreement:
    agreement = Agreement()
    for section in ("results", "groups"):
        for name, metrics in baseline.get(section, {}).items():
            for key, value in metrics.items():
                if (
                    "_stderr" in key
                    or isinstance(value, bool)
                    or not isinstance(value, int | float)
                ):
                    continue
                theirs = other.get(section, {}).get(name, {}).get(key)
                if not isinstance(theirs, int | float):
                    agreement.problems.append(f"{section}/{name}/{key} missing")
                    continue
                if math.isnan(value) and math.isnan(theirs):
                    continue
                diff = abs(float(value) - float(theirs))
                if math.isnan(diff) or diff > agreement.max_metric_diff:
                    agreement.max_metric_diff = diff
                    agreement.max_metric_name = f"{name}/{key}"
    base_samples = baseline.get("samples", {})
    other_samples = other.get("samples", {})
    if set(base_samples) != set(other_samples):
        agreement.problems.append(
            f"task sets differ: {sorted(set(base_samples) ^ set(other_samples))}"
        )
    for task in set(base_samples) & set(other_samples):
        theirs_by_doc = {s["doc_id"]: s for s in other_samples[task]}
        for sample in base_samples[task]:
            theirs = theirs_by_doc.get(sample["doc_id"])
            if theirs is None:
                agreement.problems.append(f"{task}/{sample['doc_id']} missing")
                continue
            agreement.samples += 1
            if sample["arguments"] != theirs["arguments"]:
                agreement.problems.append(f"{task}/{sample['doc_id']}: prompts differ")
            for a, b in _leaves(sample["resps"], theirs["resps"]):
                if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
                    if abs(a - b) > logprob_tolerance(a, b):
                        agreement.beyond_tolerance += 1
                    if abs(a - b) >= agreement.max_logprob_diff:
                        agreement.max_logprob_diff = abs(a - b)
                        agreement.max_logprob_pair = (a, b)
                elif a != b:
                    agreement.discrete_diffs += 1
    return agreement


def _leaves(a: Any, b: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            yield from _leaves(x, y)
    else:
        yield a, b


# ----------------------------------------------------------------------------------- printing
def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


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


def report(
    args: argparse.Namespace,
    rows: list[Row],
    agreements: dict[str, Agreement],
    header: dict[str, Any],
) -> dict[str, Any]:
    tokens, warnings = workload_tokens(rows)
    total_tokens = sum(tokens.values()) if tokens else None
    hf = next((row for row in rows if row.layout is None), None)

    def per_row(row: Row) -> dict[str, Any]:
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
                phase: {
                    **vars(figures),
                    "requests_per_s": figures.requests / figures.seconds
                    if figures.seconds
                    else None,
                    "tokens_per_s": (
                        tokens[phase] / figures.seconds
                        if phase in tokens and figures.seconds
                        else None
                    ),
                    "real_token_fraction": figures.real_token_fraction(),
                }
                for phase, figures in row.phases.items()
            },
            "agreement": vars(agreements[row.name]) if row.name in agreements else None,
        }

    figures = [per_row(row) for row in rows]

    print()
    for key, value in header.items():
        print(f"{key:<18} {value}")
    print()
    table_rows = []
    for row, fig in zip(rows, figures, strict=True):
        agreement = agreements.get(row.name)
        table_rows.append(
            [
                row.name,
                _fmt(row.load_s, ".2f"),
                _fmt(row.eval_s, ".2f"),
                _fmt(row.total_s, ".2f"),
                _fmt(row.lm_s, ".2f"),
                _fmt(fig["requests_per_s"], ",.0f"),
                _fmt(fig["tokens_per_s"], ",.0f"),
                _fmt(fig["real_token_fraction"], ".3f"),
                _fmt(fig["speedup_total_vs_hf"], ".2f")
                + ("x" if fig["speedup_total_vs_hf"] else ""),
                _fmt(fig["speedup_lm_vs_hf"], ".2f") + ("x" if fig["speedup_lm_vs_hf"] else ""),
                "baseline" if agreement is None else f"{agreement.max_metric_diff:.1e}",
                "" if agreement is None else f"{agreement.max_logprob_diff:.1e}",
                ""
                if agreement is None
                else str(agreement.discrete_diffs + len(agreement.problems)),
            ]
        )
    print(
        _table(
            [
                "row",
                "load s",
                "eval s",
                "total s",
                "LM s",
                "req/s",
                "tok/s",
                "real-tok",
                "total vs hf",
                "LM vs hf",
                "max|dmetric|",
                "max|dlogprob|",
                "diffs",
            ],
            table_rows,
        )
    )
    print()
    phase_rows = []
    for phase in PHASES:
        for row in rows:
            f = row.phases.get(phase)
            if f is None:
                continue
            phase_rows.append(
                [
                    phase,
                    row.name,
                    str(f.requests),
                    _fmt(f.seconds, ".2f"),
                    _fmt(f.requests / f.seconds if f.seconds else None, ",.0f"),
                    _fmt(
                        tokens[phase] / f.seconds if phase in tokens and f.seconds else None, ",.0f"
                    ),
                    _fmt(f.engine_seconds, ".2f"),
                    "n/a" if f.micro_batches is None else str(f.micro_batches),
                    _fmt(f.real_token_fraction(), ".3f"),
                    "n/a"
                    if f.replica_utilisation is None
                    else "/".join(f"{u:.2f}" for u in f.replica_utilisation.values()) or "-",
                ]
            )
    print(
        _table(
            [
                "request type",
                "row",
                "requests",
                "LM s",
                "req/s",
                "tok/s",
                "engine s",
                "micro-batches",
                "real-tok",
                "replica util",
            ],
            phase_rows,
        )
    )
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
    return {"header": header, "rows": figures, "workload_tokens": tokens, "warnings": warnings}


# --------------------------------------------------------------------------------------- main
def warm_up_imports(model_dir: str) -> None:
    """Import what both backends import on first use, so the first row does not pay for it."""
    import lm_eval.models.huggingface  # noqa: F401
    import torch
    import transformers

    import rayeval.service.engine.lm  # noqa: F401

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)  # imports the modeling code


def _describe_cluster() -> str:
    import ray

    resources = ray.cluster_resources()
    return f"{resources.get('CPU', 0):g} logical CPUs, {resources.get('GPU', 0):g} GPUs"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=args.address is None and not os.environ.get("RAY_ADDRESS"))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("lm_eval", "service", "actors"):
        logging.getLogger(name).setLevel(logging.WARNING)

    import lm_eval
    import ray
    import torch
    import transformers

    from rayeval.service.demo import ensure_demo_assets

    started = time.perf_counter()
    model_dir = args.model
    include_path = args.include_path
    if model_dir is None or include_path is None:
        assets = ensure_demo_assets()
        model_dir = model_dir or str(assets.model_dir)
        include_path = include_path or str(assets.tasks_dir)
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    task_manager = make_task_manager(args.tasks, include_path)
    from lm_eval.tasks import get_task_dict

    get_task_dict(args.tasks, task_manager)  # warm-up: datasets are prepared before any row
    warm_up_imports(model_dir)
    prep_s = time.perf_counter() - started

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
    ray_s = time.perf_counter() - started

    gpus = (
        ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        if torch.cuda.is_available()
        else "none"
    )
    header = {
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

    baseline = rows[0]
    assert baseline.results is not None
    agreements = {row.name: compare(baseline.results, row.results or {}) for row in rows[1:]}
    figures = report(args, rows, agreements, header)
    failed = [name for name, a in agreements.items() if not a.ok()]
    if failed:
        verdict = (
            f"results DIFFER from {baseline.name} beyond |dlogprob| {LOGPROB_TOL:g} (two "
            "float32 ulps for sums above 1024) or in "
            f"greedy flags / generations: {', '.join(failed)}"
        )
    else:
        verdict = (
            f"results agree with {baseline.name} (|dlogprob| <= {LOGPROB_TOL:g} or two "
            "float32 ulps of a sum above 1024, same generations)"
        )
    print("load average at end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"\n{verdict}")
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        figures["argv"] = sys.argv
        figures["verdict"] = verdict
        out.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        print(f"figures written to {out}")
    # In float32 the rows must agree; bf16/fp16 batches legitimately round differently.
    return 1 if failed and args.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
