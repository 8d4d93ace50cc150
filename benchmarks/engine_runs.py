"""bench_engine.py's rows: lm-eval's ``hf`` backend and rayeval layouts, each timed as a Row.

A row's load time, ``simple_evaluate`` time, release time and per-request-type figures (seconds
inside the LM's request methods; for rayeval also the engine's own ``lm.engine.stats``).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import PhaseFigures, PhaseTimer


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
        """Real / padded tokens over every request type rayeval counted, else None."""
        real = sum(p.real_tokens or 0 for p in self.phases.values())
        padded = sum(p.padded_tokens or 0 for p in self.phases.values())
        return real / padded if padded else None


def evaluate(model: Any, args: argparse.Namespace, task_manager: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` on ``model`` with the benchmark's tasks, samples logged.

    Raises:
        RuntimeError: lm-eval returned no results.
    """
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
        row.load_reports = [asdict(r) for r in lm.engine.load_reports]
        row.load_s = time.perf_counter() - started
        evaluate_timed(row, lm, args, task_manager)
        _add_engine_stats(row, lm.engine.stats, replicas)
    finally:
        started = time.perf_counter()
        lm.close()
        row.close_s = time.perf_counter() - started
    return row


def _add_engine_stats(row: Row, stats: dict[str, Any], replicas: int) -> None:
    """rayeval's own figures per request type (``lm.engine.stats``) beside the timed ones."""
    for phase, phase_stats in stats.items():
        figures = row.phases.setdefault(phase, PhaseFigures())
        figures.engine_seconds = phase_stats.seconds
        figures.micro_batches = phase_stats.micro_batches
        figures.real_tokens = phase_stats.real_tokens
        figures.padded_tokens = phase_stats.padded_tokens
        busy = phase_stats.replica_utilisation  # a replica that ran nothing is absent: show 0
        figures.replica_utilisation = {r: busy.get(r, 0.0) for r in range(replicas)}


def warm_up_imports(model_dir: str) -> None:
    """Import what both backends import on first use, so the first row does not pay for it."""
    import lm_eval.models.huggingface  # noqa: F401
    import torch
    import transformers

    import rayeval.service.engine.lm  # noqa: F401

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)  # imports the modeling code
