"""Peak private memory of every rank through load and evaluation, for shard sizes G = 1, 2, 4.

One process builds a Llama of a few hundred MB with random weights (fp32, saved with
``save_pretrained``; nothing is trained), then for each shard size ``G`` runs a short real
evaluation with :class:`rayeval.service.engine.lm.RayEvalLM` (``num_replicas=1, shard_size=G,
cpus_per_rank=1``) through ``lm_eval.simple_evaluate`` on the bundled demo tasks: multiple-choice
``loglikelihood`` requests, then a few ``generate_until`` requests.

The default model has the proportions of Llama-2-7B at about 1/28 of its size: 32 decoder blocks,
each about 3% of the weights, and embeddings and head about 3% each (``--vocab 32000 --hidden
1024 --layers 12`` gives a model whose embeddings are 15% of it, as in small real models).

While it runs, a driver thread reads ``/proc/<pid>/status`` of every rank process (the pids come
from Ray's actor table as soon as the actors exist) every few milliseconds and keeps, per rank and
per phase (load, loglikelihood, generate_until):

* **RssAnon peak** — private anonymous memory (the heap: parameters, all-gather buffers,
  activations, KV cache, logits), sampled, so a spike shorter than the interval can be missed;
* **VmHWM** — the kernel's own high-water mark of the resident set. It misses nothing but also
  counts file-backed pages (shared libraries, and the memory-mapped checkpoint: a G=1 rank's
  weights are file-backed pages of the safetensors file, not anonymous memory).

Both are reported above an **empty rank**: an idle actor that has imported torch, transformers,
the rank code and the model's modeling code (it builds the model on the meta device: no weights).
The ideal for a sharded rank is ``model / G``; FSDP adds one unit all-gathered at a time (twice
its size while its all-gather buffer is copied out) and every rank adds its micro-batch's
activations, which do not shard (for generation, mostly the KV cache). Results of every ``G`` are
also compared with the first ``G`` (they must be bit-identical: micro-batches never depend on the
layout); the exit status is 1 if they are not.

Usage::

    .venv/bin/python benchmarks/bench_memory.py                       # ~240M-parameter Llama
    .venv/bin/python benchmarks/bench_memory.py --shard_sizes 2 --json out/memory.json
    .venv/bin/python benchmarks/bench_memory.py --shard_sizes 1,2 --shard_strategy tp

With ``--shard_strategy tp`` the ranks hold transformers' tensor-parallel slices (the projections
split, the embeddings and norms whole on every rank) and add no all-gathered unit, only the
activations of the batch they compute together.

The sampler is in ``rank_memory.py``, the model builder (shared with bench_generate.py) in
``llama_model.py``; this script runs the layouts and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import set_environment  # noqa: E402
from benchmarks.llama_model import add_model_arguments, build_model, model_figures  # noqa: E402
from benchmarks.rank_memory import PHASES, EmptyRank, RankMemory, RankSampler  # noqa: E402

__all__ = ["add_model_arguments", "build_model", "main", "model_figures"]

MIB = 1024 * 1024


# ------------------------------------------------------------------------------------ running
def run_layout(
    shard_size: int, model_dir: Path, task_manager: Any, args: argparse.Namespace
) -> tuple[list[RankMemory], dict[str, Any], float]:
    """One evaluation at ``1 x shard_size``; the ranks' memory, the lm-eval results, seconds."""
    import lm_eval

    from rayeval.service.engine.lm import RayEvalLM

    name = f"bench-mem-g{shard_size}-{os.getpid()}"
    started = time.perf_counter()
    with (
        RankSampler(name, args.interval_ms / 1000) as sampler,
        RayEvalLM(
            pretrained=str(model_dir),
            num_replicas=1,
            shard_size=shard_size,
            cpus_per_rank=1,
            shard_strategy=args.shard_strategy,
            dtype="float32",
            batch_size="auto",
            kv_cache_tokens=args.kv_cache_tokens,
            continuous_batching=not args.static,
            name=name,
        ) as lm,
    ):
        lm.engine.load_reports  # noqa: B018 - waits until every rank has loaded
        sampler.sample()
        sampler.phase = "between"
        sampler.track(lm)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=args.tasks,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            bootstrap_iters=0,
            log_samples=True,
            task_manager=task_manager,
        )
        sampler.sample()  # the last figures, before the ranks go
    assert results is not None
    ranks = sorted(sampler.ranks.values(), key=lambda r: r.name)
    return ranks, results, time.perf_counter() - started


def responses(results: dict[str, Any]) -> dict[tuple[str, int], Any]:
    """Every logged sample's raw responses, keyed by task and document."""
    return {
        (task, sample["doc_id"]): sample["resps"]
        for task, samples in results["samples"].items()
        for sample in samples
    }


def table_rows(
    shard_size: int, ranks: list[RankMemory], sizes: dict[str, int], empty: dict[str, int]
) -> list[dict[str, Any]]:
    """One row per rank: MiB above the empty rank per phase, the peak against model and ideal."""
    model = sizes["model"]
    rows = []
    for rank in ranks:
        above = {
            phase: (rank.peak_anon[phase] - empty["RssAnon"]) / MIB
            for phase in PHASES
            if phase in rank.peak_anon
        }
        peak = max(above.values(), default=0.0)
        rows.append(
            {
                "G": shard_size,
                "rank": rank.name.rsplit("-", 1)[-1],
                "ideal_mib": model / shard_size / MIB,
                **{f"{phase}_mib": above.get(phase) for phase in PHASES},
                "peak_mib": peak,
                "end_mib": (rank.last_anon - empty["RssAnon"]) / MIB,
                "peak_vs_model": peak * MIB / model,
                "peak_vs_ideal": peak * MIB / (model / shard_size),
                "hwm_mib": (rank.vm_hwm - empty["VmHWM"]) / MIB,
                "samples": rank.samples,
            }
        )
    return rows


COLUMNS = [
    ("G", "G", "{}"),
    ("rank", "rank", "{}"),
    ("ideal_mib", "model/G", "{:,.0f}"),
    ("load_mib", "load", "{:,.0f}"),
    ("loglikelihood_mib", "loglik", "{:,.0f}"),
    ("generate_until_mib", "generate", "{:,.0f}"),
    ("end_mib", "at end", "{:,.0f}"),
    ("peak_vs_model", "peak/model", "{:.2f}x"),
    ("peak_vs_ideal", "peak/(model/G)", "{:.2f}x"),
    ("hwm_mib", "VmHWM", "{:,.0f}"),
]


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows of :func:`table_rows` under ``COLUMNS``' titles, right-aligned."""
    cells = [
        [fmt.format(row[key]) if row[key] is not None else "n/a" for key, _, fmt in COLUMNS]
        for row in rows
    ]
    widths = [
        max(len(title), *(len(c[i]) for c in cells)) for i, (_, title, _) in enumerate(COLUMNS)
    ]
    print("  ".join(title.rjust(w) for (_, title, _), w in zip(COLUMNS, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--shard_sizes`` and ``--tasks`` as lists."""
    parser = argparse.ArgumentParser(description="Peak private memory per rank, G = 1, 2, 4.")
    parser.add_argument("--shard_sizes", default="1,2,4", help="G values (default 1,2,4)")
    parser.add_argument(
        "--shard_strategy",
        default="fsdp",
        choices=["fsdp", "tp", "auto"],
        help="how replicas of G > 1 shard the model (fsdp; tp results are not bit-identical "
        "across G, so only fsdp fails the run on a difference)",
    )
    add_model_arguments(parser)
    parser.add_argument("--tasks", default="demo_mc,demo_gen_short", help="lm-eval tasks")
    parser.add_argument("--limit", type=int, default=8, help="documents per task (8)")
    parser.add_argument("--num_fewshot", type=int, default=2, help="few-shot examples (2)")
    parser.add_argument("--interval_ms", type=float, default=10.0, help="sampling interval (10)")
    parser.add_argument(
        "--kv_cache_tokens", type=int, default=None, help="rayeval's KV-cache budget (default)"
    )
    parser.add_argument(
        "--static", action="store_true", help="generate in static batches (continuous off)"
    )
    parser.add_argument("--num_cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument(
        "--model_dir",
        default=None,
        help="build the model here and keep it; reused if it already has a config.json "
        "(default: a temporary directory, removed at the end)",
    )
    parser.add_argument("--json", default=None, help="also write every figure as JSON here")
    args = parser.parse_args(argv)
    args.shard_sizes = [int(g) for g in args.shard_sizes.split(",") if g.strip()]
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return args


@dataclass
class Measured:
    """Every layout's rows, seconds, and whether its results equal the first layout's."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[int, float] = field(default_factory=dict)
    identical: dict[int, bool] = field(default_factory=dict)


def measure_empty_rank(model_dir: Path) -> dict[str, int]:
    """The memory of an idle actor that imported what a rank imports (no weights)."""
    import ray

    empty_actor = ray.remote(num_cpus=1)(EmptyRank).remote()
    empty = ray.get(empty_actor.measure.remote(str(model_dir)), timeout=300)
    ray.kill(empty_actor)
    return dict(empty)


def describe_run(
    args: argparse.Namespace,
    sizes: dict[str, int],
    empty: dict[str, int],
    built: float | None,
    model_dir: Path,
) -> dict[str, str]:
    """The header lines; ``built`` is the seconds the model took to build, None if reused."""
    import ray
    import torch

    return {
        "model": f"Llama, {sizes['model'] / 4e6:.0f}M parameters, fp32, "
        f"{sizes['model'] / MIB:,.0f} MiB, random weights "
        + (f"(built in {built:.1f} s)" if built is not None else f"(reused {model_dir})"),
        "largest unit": f"{sizes['largest_unit'] / MIB:,.0f} MiB "
        f"({sizes['largest_unit'] / sizes['model']:.1%} of the model)",
        "tasks": f"{','.join(args.tasks)} (limit {args.limit}, num_fewshot {args.num_fewshot})",
        "machine": f"{os.cpu_count()} CPU cores, CPU only, torch {torch.__version__}, "
        f"ray {ray.__version__}",
        "empty rank": f"RssAnon {empty['RssAnon'] / MIB:,.0f} MiB, "
        f"VmHWM {empty['VmHWM'] / MIB:,.0f} MiB (subtracted from every figure)",
        "sampling": f"every {args.interval_ms:g} ms from the driver",
    }


def measure_layouts(
    args: argparse.Namespace,
    model_dir: Path,
    task_manager: Any,
    sizes: dict[str, int],
    empty: dict[str, int],
) -> Measured:
    """Every ``--shard_sizes`` layout in turn, its results compared with the first one's."""
    measured = Measured()
    baseline: dict[tuple[str, int], Any] | None = None
    for shard_size in args.shard_sizes:
        ranks, results, measured.seconds[shard_size] = run_layout(
            shard_size, model_dir, task_manager, args
        )
        measured.rows += table_rows(shard_size, ranks, sizes, empty)
        ours = responses(results)
        baseline = baseline or ours
        measured.identical[shard_size] = ours == baseline
    return measured


def print_summary(args: argparse.Namespace, measured: Measured) -> None:
    """The memory table, then each layout's time and whether its results are identical."""
    print("RssAnon peak per phase, MiB above the empty rank (sampled); VmHWM: kernel peak")
    print_table(measured.rows)
    print()
    for shard_size in args.shard_sizes:
        same = "identical to" if measured.identical[shard_size] else "DIFFERENT from"
        print(
            f"G={shard_size}: {measured.seconds[shard_size]:.1f} s (load + evaluation), results "
            f"{same} G={args.shard_sizes[0]}"
        )


def write_json(
    args: argparse.Namespace,
    header: dict[str, str],
    sizes: dict[str, int],
    empty: dict[str, int],
    measured: Measured,
) -> None:
    """Every figure, and the arguments, as JSON in ``--json``."""
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "header": header,
                "sizes": sizes,
                "empty_rank": empty,
                "rows": measured.rows,
                "seconds": measured.seconds,
                "identical_results": measured.identical,
                "args": vars(args),
            },
            indent=2,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Build (or reuse) the model, measure every layout; 1 if fsdp results differ, else 0."""
    args = parse_args(argv)
    set_environment(local_ray=True)  # the local, single-user Ray below
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import ray
    from lm_eval.tasks import TaskManager

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    task_manager = TaskManager(include_defaults=False, include_path=str(assets.tasks_dir))
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="bench-memory-"))
    built = None
    if not (model_dir / "config.json").is_file():
        started = time.perf_counter()
        build_model(model_dir, args, assets.model_dir)
        built = time.perf_counter() - started
    sizes = model_figures(model_dir)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        empty = measure_empty_rank(model_dir)
        header = describe_run(args, sizes, empty, built, model_dir)
        for key, value in header.items():
            print(f"{key:<13} {value}")
        print()
        measured = measure_layouts(args, model_dir, task_manager, sizes, empty)
        print_summary(args, measured)
        if args.json:
            write_json(args, header, sizes, empty, measured)
        exact = args.shard_strategy == "fsdp"
        return 0 if all(measured.identical.values()) or not exact else 1
    finally:
        ray.shutdown()
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
