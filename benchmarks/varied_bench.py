"""The varied-length generation workload of ``bench_generate.py --workload varied``.

What a static batch wastes when answers differ in length, measured rather than estimated. The
task of :mod:`varied_workload` (360 greedy ``generate_until`` requests whose answers need 2 to 96
tokens) runs through ``lm_eval.simple_evaluate`` with lm-eval's ``hf`` backend (``--batch``
rows per batch, as ``lm_eval --model hf --batch_size 16``) and with rayeval in the layouts of
``bench_generate.py``; per row it reports:

* **decode row-steps** -- the rows of every call of the model whose input has one position (one-
  token decode steps), counted by a forward pre-hook on the input embeddings: finished rows that a
  static batch still computes are counted, the prefill calls are not. rayeval's ranks count the
  same (``RayEvalLM.engine.input_token_counts().decode_rows``), summed over the ranks of FSDP (each
  computes its own rows) and divided by G under tensor parallelism (every rank computes the
  replica's rows, a G-th of each);
* **fed** -- every position of every call, prefill and padding included;
* **useful** -- the sum over requests of the tokens each needs: generated up to the one that
  completes a stop string (decoded text, as lm-eval matches it), the end-of-sequence token, or
  ``max_gen_toks``. Read from lm-eval hf's own generated tokens, so an engine that stops every row
  at once needs ``useful - requests`` decode row-steps (each first token comes from the prefill);
* **start-up s** (the LM built and every rank loaded; Ray's start apart), **generate s** (the
  ``generate_until`` call), **eval s** (``simple_evaluate``);
* **same** -- answers identical to lm-eval hf's, per sample (``resps``), out of all.

The exit status is 1 when a float32 row's answers differ from hf's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import PhaseTimer, make_task_manager
from benchmarks.common import format_table as _table
from benchmarks.varied_workload import (
    MAX_GEN_TOKS,
    VARIED_TASK,
    build_varied_model,
    write_varied_task,
)


@dataclass
class VariedFigures:
    """One row: how it ran and what it measured."""

    name: str
    strategy: str | None = None
    batch: str = ""
    startup_s: float = 0.0
    generate_s: float = 0.0
    eval_s: float = 0.0
    decode_rows: int = 0
    fed: int = 0
    calls: int = 0
    forward_s: float = 0.0  # lm-eval hf: seconds inside the model's forward calls
    exact_match: float = 0.0
    same: int = 0
    answers: dict[int, str] = field(default_factory=dict)
    contexts: dict[int, str] = field(default_factory=dict)


class InputCounter:
    """Counts what a model's input embeddings are fed (the keys of rayeval's rank counts)."""

    def __init__(self, model: Any) -> None:
        self.counts = {"fed": 0, "calls": 0, "decode_rows": 0}
        model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, _module: Any, args: tuple[Any, ...]) -> None:
        ids = args[0]
        self.counts["fed"] += ids.numel()
        self.counts["calls"] += 1
        if ids.dim() == 2 and ids.shape[1] == 1:
            self.counts["decode_rows"] += ids.shape[0]


class ForwardTimer:
    """Seconds spent inside a module's forward calls (what is not model compute is overhead)."""

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        self._started = 0.0
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def _start(self, *_args: Any) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_args: Any) -> None:
        self.seconds += time.perf_counter() - self._started


class TokenRecorder:
    """Keeps the tokens lm-eval's hf backend generates (``HFLM._model_generate``'s output)."""

    def __init__(self, lm: Any) -> None:
        self.rows: list[list[int]] = []
        self.stops: list[str] = []
        generate = lm._model_generate

        def recording(context: Any, max_length: int, stop: list[str], **kwargs: Any) -> Any:
            out = generate(context=context, max_length=max_length, stop=stop, **kwargs)
            self.rows += out[:, context.shape[1] :].tolist()
            self.stops = list(stop)
            return out

        lm._model_generate = recording

    def needed(self, tokenizer: Any) -> list[int]:
        """Per generated row, the tokens up to its first stop condition (see the module)."""
        lengths = []
        for row in self.rows:
            need = min(len(row), MAX_GEN_TOKS)
            for k in range(1, need + 1):
                text = tokenizer.decode(row[:k])
                if row[k - 1] == tokenizer.eos_token_id or any(s in text for s in self.stops):
                    need = k
                    break
            lengths.append(need)
        return lengths


def _evaluate(lm: Any, task_manager: Any, figures: VariedFigures) -> None:
    import lm_eval

    timer = PhaseTimer(lm)
    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[VARIED_TASK], task_manager=task_manager, log_samples=True
    )
    figures.eval_s = time.perf_counter() - started
    figures.generate_s = timer.phases["generate_until"].seconds
    figures.exact_match = results["results"][VARIED_TASK]["exact_match,none"]
    samples = results["samples"][VARIED_TASK]
    figures.answers = {s["doc_id"]: s["resps"][0][0] for s in samples}
    figures.contexts = {s["doc_id"]: s["arguments"][0][0] for s in samples}


def run_hf(model_dir: Path, task_manager: Any, args: argparse.Namespace) -> tuple[Any, list[int]]:
    """lm-eval's hf backend in this process; returns its figures and the tokens each answer
    needed."""
    import torch
    from lm_eval.api.registry import get_model

    torch.set_num_threads(args.hf_threads or args.cores)
    figures = VariedFigures(f"lm-eval hf t{args.hf_threads or args.cores}", batch=str(args.batch))
    started = time.perf_counter()
    lm = get_model("hf").create_from_arg_obj(
        {"pretrained": str(model_dir), "dtype": args.dtype},
        {"batch_size": args.batch, "max_batch_size": None, "device": args.device},
    )
    figures.startup_s = time.perf_counter() - started
    counter, recorder, timer = InputCounter(lm.model), TokenRecorder(lm), ForwardTimer(lm.model)
    _evaluate(lm, task_manager, figures)
    figures.forward_s = timer.seconds
    figures.decode_rows, figures.fed = counter.counts["decode_rows"], counter.counts["fed"]
    figures.calls = counter.counts["calls"]
    return figures, recorder.needed(lm.tokenizer)


def run_rayeval(spec: Any, model_dir: Path, task_manager: Any, args: Any) -> VariedFigures:
    """One rayeval layout of ``bench_generate.row_specs`` on the running Ray."""
    from rayeval.service.engine.lm import RayEvalLM

    size = args.rayeval_batch_size
    batch: int | str = spec.batch or (int(size) if size.isdigit() else size)
    figures = VariedFigures(spec.name, batch=str(batch))
    started = time.perf_counter()
    lm = RayEvalLM(
        pretrained=str(model_dir),
        num_replicas=1,
        shard_size=spec.shard_size,
        cpus_per_rank=spec.cpus_per_rank,
        shard_strategy=spec.strategy,
        shm_collectives=not spec.gloo,
        continuous_batching=not spec.static,
        dtype=args.dtype,
        device=args.device,
        batch_size=batch,
    )
    try:
        lm.engine.load_reports  # noqa: B018 - waits until every rank has loaded
        figures.startup_s = time.perf_counter() - started
        figures.strategy = lm.engine.shard_strategy.value if spec.shard_size > 1 else None
        before = lm.engine.input_token_counts()
        _evaluate(lm, task_manager, figures)
        after = lm.engine.input_token_counts()
    finally:
        lm.close()
    # Tensor parallelism: every rank is fed the replica's rows and computes a G-th of each.
    per_replica = spec.shard_size if figures.strategy == "tp" else 1
    for key in ("decode_rows", "fed", "calls"):
        setattr(figures, key, getattr(after - before, key) // per_replica)
    return figures


def histogram(lengths: list[int], width: int = 10) -> str:
    """Answer lengths (tokens needed) in buckets of ``width``, one line per bucket."""
    buckets = Counter((n - 1) // width for n in lengths)
    top = max(buckets.values())
    lines = []
    for bucket in range(max(buckets) + 1):
        count = buckets.get(bucket, 0)
        label = f"{bucket * width + 1:>3}-{(bucket + 1) * width:<3}"
        lines.append(f"  {label} {count:>4} {'#' * round(40 * count / top)}")
    return "\n".join(lines)


def report(rows: list[VariedFigures], needed: list[int], ray_start_s: float) -> str:
    """The table of every row against lm-eval hf (the first row)."""
    hf, useful = rows[0], sum(needed)
    table = []
    for row in rows:
        table.append([
            row.name, row.strategy or "-", row.batch, f"{row.startup_s:.1f}",
            f"{row.generate_s:.1f}", f"{row.eval_s:.1f}", f"{row.decode_rows:,}",
            f"{row.decode_rows / hf.decode_rows:.2f}x", f"{row.decode_rows / useful:.2f}x",
            f"{row.fed:,}", f"{hf.generate_s / row.generate_s:.2f}x",
            f"{row.same}/{len(hf.answers)}", f"{row.exact_match:.3f}",
        ])  # fmt: skip
    headers = [
        "row", "strategy", "batch", "start-up s", "generate s", "eval s", "decode row-steps",
        "vs hf", "vs useful", "fed", "gen vs hf", "same", "exact_match",
    ]  # fmt: skip
    return "\n".join(
        [
            _table(headers, table),
            f"useful: {useful:,} tokens needed by {len(needed)} answers (an engine that stops "
            f"each row at once: {useful - len(needed):,} decode row-steps); Ray start "
            f"{ray_start_s:.1f} s (not in start-up s); load average "
            "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
            "gen vs hf: hf's generate s / this row's (above 1: faster)",
        ]
    )


def main_varied(args: argparse.Namespace, specs: list[Any]) -> int:
    """Build the workload, run every row, print the table; 1 when a float32 row differs."""
    import ray
    import torch
    import transformers
    from lm_eval.tasks import get_task_dict

    work = Path(tempfile.mkdtemp(prefix="bench-varied-"))
    try:
        model_dir = Path(args.model_dir) if args.model_dir else work / "model"
        if not (model_dir / "config.json").is_file():
            started = time.perf_counter()
            build_varied_model(model_dir, seed=args.seed)
            print(f"built the varied-length model in {time.perf_counter() - started:.1f} s")
        include_path = write_varied_task(work / "tasks", seed=args.seed)
        task_manager = make_task_manager([VARIED_TASK], str(include_path))
        get_task_dict([VARIED_TASK], task_manager)  # the dataset prepared before any row
        print(
            f"workload {VARIED_TASK}: 360 generate_until, greedy, max_gen_toks {MAX_GEN_TOKS}; "
            f"machine {args.device}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, dtype {args.dtype}"
        )
        hf, needed = run_hf(model_dir, task_manager, args)
        print(f"answer lengths (tokens needed, lm-eval hf's greedy answers):\n{histogram(needed)}")
        rows = [hf]
        started = time.perf_counter()
        gpus = {"num_gpus": torch.cuda.device_count()} if args.device == "cuda" else {}
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, **gpus)
        ray_start_s = time.perf_counter() - started
        try:
            rows += [run_rayeval(s, model_dir, task_manager, args) for s in specs if not s.hf]
        finally:
            ray.shutdown()
        for row in rows:
            row.same = sum(row.answers.get(d) == a for d, a in hf.answers.items())
        print(report(rows, needed, ray_start_s))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            figures = {"needed": needed, "ray_start_s": ray_start_s}
            figures["rows"] = [asdict(r) for r in rows]
            Path(args.json).write_text(json.dumps(figures))
        differ = any(row.same != len(hf.answers) for row in rows)
        return 1 if differ and args.dtype == "float32" else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
