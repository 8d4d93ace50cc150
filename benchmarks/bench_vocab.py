"""Wall time and memory at a real vocabulary: Qwen2.5-0.5B's shape beside lm-eval hf (issue 54).

Every other benchmark's model has the demo tokenizer's 768 tokens; real models have 32k-256k,
and scoring's logits grow with the vocabulary (a 2,048-position rolling window at 151,936 tokens
is 1.2 GB of float32 logits, and as much again of log-probabilities). This script builds, once, a
Qwen2 model of Qwen2.5-0.5B's published shape from ``transformers.Qwen2Config`` (24 layers,
hidden 896, 14 heads / 2 KV heads, intermediate 4,864, vocabulary 151,936, tied embeddings,
rope theta 1e6; random weights, normal with std 0.02; no hub) with the demo tokenizer (its 768
tokens are the first rows of the embedding; the others are never fed, but every scored position
computes all 151,936 logits). It is cached under ``.rayeval/bench-vocab/`` (or ``--model_dir``).

Four request types, one task each, then all four together:

* multiple choice -- ``demo_mc``; loglikelihood -- ``demo_cloze``;
* rolling loglikelihood -- ``vocab_rolling``: ``demo_rolling``'s config over documents of about
  ``--rolling_tokens`` (2,000) tokens drawn from the demo corpus, written into the work
  directory (``demo_rolling``'s own stories are 5-405 tokens: too short to matter);
* generation -- ``demo_gen_short`` (at most 12 new tokens).

Each is evaluated with ``lm_eval.simple_evaluate`` (``--limit`` documents, zero-shot, samples
logged) by:

* **lm-eval hf** (``batch_size=4``, CPU) in a subprocess of its own per task set, so that its
  memory is its alone: its peak RSS (``VmHWM``) and peak private memory (``RssAnon``, sampled
  from the driver) from ``/proc``; start-up (imports and model load) apart from the evaluation;
* **rayeval** at each ``RxG`` of ``--layouts`` (``RayEvalLM``, ``batch_size="auto"``, the
  default shard strategy: tensor parallelism for qwen2 at G > 1, ``--cpus_per_rank`` threads,
  by default this machine's cores shared out between the ranks): one engine per layout, the
  task sets evaluated in turn on it, start-up (rank placement and model load) timed apart. A
  driver thread (``rank_memory.RankSampler``) samples every rank's ``RssAnon`` per task set;
  the figures are above the **empty rank** (an idle actor that imported what a rank imports),
  as in bench_memory.py. The task sets run in the order above on the same ranks, so a task
  set's figure may include memory its predecessors' allocator kept.

Every rayeval answer is compared, per sample, with lm-eval hf's (``rayeval.service.parity``'s
``Distance``): in float32 each log-prob within 1e-4 (two ulps past 1024) and every greedy flag
and generation equal, else the script says so and exits 1; in bf16 the differences are reported
only (lm-eval hf's own answers move by more than that between batch sizes).

Targets (issue 54), judged on the figures above: rolling scoring's private memory per rank at 1x1
<= 0.6 GB; at 1x2 every request type's per-rank private memory <= 0.6x of 1x1's; the evaluation
of all four together (start-up apart) <= 0.7x lm-eval hf's wall time at 1x1 and <= 0.45x at 1x2.
GB are 10^9 bytes.

Usage::

    .venv/bin/python benchmarks/bench_vocab.py                            # the full shape, fp32
    .venv/bin/python benchmarks/bench_vocab.py --layers 2 --limit 2       # a quick run
    .venv/bin/python benchmarks/bench_vocab.py --dtype bfloat16 --json out/vocab-bf16.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import format_table, parse_layout, set_environment  # noqa: E402
from benchmarks.rank_memory import RankSampler, read_status  # noqa: E402

GB = 1e9
#: Qwen2.5-0.5B's published shape (config.json of Qwen/Qwen2.5-0.5B), but for the context: the
#: 2,048 positions that make lm-eval's rolling windows (its max_length comes from the config).
QWEN25_05B = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4_864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2_048,
}
#: Request type -> task, in the order they run; ``all`` is the four together.
REQUEST_TASKS = {
    "multiple choice": ["demo_mc"],
    "loglikelihood": ["demo_cloze"],
    "generation": ["demo_gen_short"],
    "rolling": ["vocab_rolling"],
}
ALL = "all four"
#: With ``--no_together``: the four task sets' figures added up in place of ``ALL``'s.
SUM = "sum of four"
HF = "hf"


# ------------------------------------------------------------------------------------ assets
def model_dir_for(args: argparse.Namespace) -> Path:
    """``--model_dir``, or the cache folder of this ``--layers`` count."""
    if args.model_dir:
        return Path(args.model_dir)
    return REPO_ROOT / ".rayeval" / "bench-vocab" / f"qwen2.5-0.5b-shape-{args.layers}l"


def build_model(out_dir: Path, layers: int, tokenizer_dir: Path) -> None:
    """Save a random-weight float32 Qwen2 of :data:`QWEN25_05B`'s shape and the demo tokenizer."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.model_max_length = QWEN25_05B["max_position_embeddings"]
    config = transformers.Qwen2Config(
        **{**QWEN25_05B, "num_hidden_layers": layers},
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def rolling_documents(tokenizer_dir: Path, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` documents of about ``tokens`` tokens each: demo corpus lines drawn at random."""
    import transformers

    from rayeval.service.demo.tiny_model import load_corpus

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = load_corpus()
    lengths = [len(tokenizer(line)["input_ids"]) + 1 for line in lines]  # + the newline
    draw = random.Random(seed)
    documents = []
    for _ in range(count):
        picked, total = [], 0
        while True:
            index = draw.randrange(len(lines))
            if total + lengths[index] > tokens:
                break
            picked.append(lines[index])
            total += lengths[index]
        documents.append("\n".join(picked))
    return documents


def write_tasks(work_dir: Path, tokenizer_dir: Path, args: argparse.Namespace) -> Path:
    """The demo tasks and ``vocab_rolling`` (long documents) in ``work_dir/tasks``."""
    import yaml

    from rayeval.service.demo.tasks import task_configs, write_demo_tasks

    tasks_dir = write_demo_tasks(work_dir / "tasks")
    data = {
        split: rolling_documents(tokenizer_dir, count, args.rolling_tokens, seed)
        for split, count, seed in (("train", 2, 1), ("test", max(args.limit, 1), 0))
    }
    files = {}
    for split, documents in data.items():
        files[split] = work_dir / f"vocab_rolling_{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    config = task_configs()["demo_rolling"]
    config["task"] = "vocab_rolling"
    config["dataset_kwargs"] = {"data_files": {k: str(v) for k, v in files.items()}}
    (tasks_dir / "vocab_rolling.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return tasks_dir


# ------------------------------------------------------------------------------ lm-eval hf
@dataclass
class Run:
    """One task set's evaluation by one layout (``hf`` or ``RxG``)."""

    seconds: float
    results: dict[str, Any]
    #: hf: the process's peak RssAnon; rayeval: per rank, the peak RssAnon above the empty rank.
    private: list[float]
    vm_hwm: float | None = None  # hf only: the process's VmHWM
    #: rayeval: per rank, the peak RssAnon above the rank's own after load (the weights apart
    #: where they are private: bf16 converted from the float32 checkpoint, or sharded slices).
    above_load: list[float] | None = None


@dataclass
class Layout:
    """Every task set's run by one layout, and its start-up seconds."""

    name: str
    startup_s: float = 0.0
    runs: dict[str, Run] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


def hf_child(spec_path: str) -> int:
    """In the subprocess: load lm-eval hf, evaluate the task set, write figures and results."""
    spec = json.loads(Path(spec_path).read_text())
    set_environment(local_ray=False)
    started = time.perf_counter()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=spec["model_dir"], dtype=spec["dtype"], batch_size=4, device="cpu")
    loaded = time.perf_counter()
    after_load = read_status(os.getpid())
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=spec["tasks"],
        limit=spec["limit"],
        bootstrap_iters=0,
        log_samples=True,
        task_manager=TaskManager(include_defaults=False, include_path=spec["tasks_dir"]),
    )
    finished = time.perf_counter()
    assert results is not None
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "startup_s": loaded - started,
                "eval_s": finished - loaded,
                "after_load": after_load,
                "status": read_status(os.getpid()),
                "results": plain(results),
            },
            default=str,
        )
    )
    return 0


def plain(results: dict[str, Any]) -> dict[str, Any]:
    """The samples and metrics of ``results`` as JSON gives them back (lists for tuples)."""
    kept = {key: results[key] for key in ("samples", "results", "groups") if key in results}
    return json.loads(json.dumps(kept, default=str))


def run_hf(tasks: list[str], args: argparse.Namespace, paths: dict[str, Path]) -> Layout:
    """lm-eval hf on ``tasks`` in a subprocess, its RssAnon sampled from here."""
    out = paths["work"] / "hf-out.json"
    spec = paths["work"] / "hf-spec.json"
    spec.write_text(
        json.dumps(
            {
                "model_dir": str(paths["model"]),
                "tasks_dir": str(paths["tasks"]),
                "dtype": args.dtype,
                "tasks": tasks,
                "limit": args.limit,
                "out": str(out),
            }
        )
    )
    child = subprocess.Popen([sys.executable, __file__, "--hf_child", str(spec)])
    peak = 0
    while child.poll() is None:
        figures = read_status(child.pid)
        if figures is not None:
            peak = max(peak, figures["RssAnon"])
        time.sleep(args.interval_ms / 1000)
    if child.returncode != 0:
        raise RuntimeError(f"lm-eval hf on {tasks} exited with {child.returncode}")
    figures = json.loads(out.read_text())
    peak = max(peak, figures["status"]["RssAnon"])
    layout = Layout(HF, startup_s=figures["startup_s"])
    layout.runs["-"] = Run(
        figures["eval_s"], figures["results"], [peak / GB], figures["status"]["VmHWM"] / GB
    )
    layout.notes["private_after_load_gb"] = figures["after_load"]["RssAnon"] / GB
    return layout


# --------------------------------------------------------------------------------- rayeval
def run_rayeval(
    layout_name: str, task_sets: dict[str, list[str]], args: argparse.Namespace, paths: dict
) -> Layout:
    """One engine at ``layout_name``; every task set evaluated on it in turn."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from rayeval.service.engine.lm import RayEvalLM

    replicas, shards = parse_layout(layout_name)
    world = replicas * shards
    cpus = args.cpus_per_rank or max(1, (os.cpu_count() or 1) // world)
    name = f"bench-vocab-{layout_name}-{os.getpid()}"
    layout = Layout(layout_name)
    task_manager = TaskManager(include_defaults=False, include_path=str(paths["tasks"]))
    started = time.perf_counter()
    with (
        RankSampler(name, args.interval_ms / 1000) as sampler,
        RayEvalLM(
            pretrained=str(paths["model"]),
            num_replicas=replicas,
            shard_size=shards,
            cpus_per_rank=cpus,
            dtype=args.dtype,
            batch_size="auto",
            name=name,
        ) as lm,
    ):
        lm.engine.load_reports  # noqa: B018 - waits until every rank has loaded
        layout.startup_s = time.perf_counter() - started
        sampler.sample()
        loaded = {rank.name: rank.last_anon for rank in sampler.ranks.values()}
        for label, tasks in task_sets.items():
            sampler.phase = label
            began = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                limit=args.limit,
                bootstrap_iters=0,
                log_samples=True,
                task_manager=task_manager,
            )
            seconds = time.perf_counter() - began
            sampler.sample()
            assert results is not None
            ranks = sorted(sampler.ranks.values(), key=lambda r: r.name)
            peaks = [r.peak_anon.get(label, 0) for r in ranks]
            private = [(peak - args.empty["RssAnon"]) / GB for peak in peaks]
            above = [(peak - loaded[r.name]) / GB for peak, r in zip(peaks, ranks, strict=True)]
            layout.runs[label] = Run(seconds, plain(results), private, above_load=above)
        layout.notes = {
            "cpus_per_rank": cpus,
            "strategy": lm.engine.model_info()["rayeval_layout"]["shard_strategy"],
            "after_load_gb": [
                (r.peak_anon.get("load", 0) - args.empty["RssAnon"]) / GB for r in ranks
            ],
            "vm_hwm_gb": [r.vm_hwm / GB for r in ranks],
        }
    return layout


def measure_empty_rank(model_dir: Path) -> dict[str, int]:
    """bench_memory.py's baseline: an idle actor that imported what a rank imports."""
    from benchmarks.bench_memory import measure_empty_rank as measure

    return measure(model_dir)


# -------------------------------------------------------------------------------- judging
def compare(hf: dict[str, Any], ours: dict[str, Any], dtype: str) -> tuple[float, bool, str]:
    """The largest log-prob difference, whether it is within float32's bound, and a summary."""
    from rayeval.service.parity import Distance

    distance = Distance.between(hf, ours)
    holds = not (distance.past_bound or distance.greedy or distance.generations)
    summary = (
        f"logprob {distance.logprob:.2g}, past bound {distance.past_bound}, "
        f"is_greedy {distance.greedy}, generations {distance.generations}"
    )
    return distance.logprob, holds or dtype != "float32", summary


def gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


@dataclass
class Report:
    """Every layout's runs per task set, keyed ``[label][layout]``."""

    runs: dict[str, dict[str, Run]]
    startup: dict[str, float]
    parity: dict[str, dict[str, str]]
    parity_holds: bool


def print_tables(report: Report, layouts: list[str]) -> list[list[str]]:
    """The wall time and memory tables; the targets table's rows are returned."""
    ours = [name for name in layouts if name != HF]
    headers = ["request type", "hf s"]
    for name in ours:
        headers += [f"{name} s", f"{name}/hf"]
    headers += ["hf VmHWM", "hf private"]
    for name in ours:
        headers += [f"{name} private"]
    headers += [f"{name}/1x1" for name in ours if name != "1x1" and "1x1" in ours]
    headers += ["max |dlogprob|"]
    rows = []
    for label, by_layout in report.runs.items():
        hf = by_layout.get(HF)
        row = [label, f"{hf.seconds:.1f}" if hf else "n/a"]
        for name in ours:
            run = by_layout[name]
            row += [f"{run.seconds:.1f}", ratio(run.seconds, hf.seconds if hf else None)]
        row += [gb(hf.vm_hwm) if hf else "n/a", gb(hf.private[0]) if hf else "n/a"]
        for name in ours:
            row += ["/".join(gb(p) for p in by_layout[name].private)]
        one = max(by_layout["1x1"].private) if "1x1" in by_layout else None
        for name in ours:
            if name != "1x1" and one is not None:
                row += [ratio(max(by_layout[name].private), one)]
        row += [report.parity.get(label, {}).get("max", "n/a")]
        rows.append(row)
    print("Evaluation wall time (start-up apart), seconds; memory in GB (10^9 bytes):")
    print("hf: its process's peak; rayeval: each rank's peak RssAnon above the empty rank")
    print(format_table(headers, rows))
    print()
    above = [
        [label, *("/".join(gb(p) for p in by_layout[name].above_load or []) for name in ours)]
        for label, by_layout in report.runs.items()
    ]
    print("rayeval: each rank's peak RssAnon above its own after load (the weights apart), GB")
    print(format_table(["request type", *ours], above))
    print()
    print(
        "start-up: "
        + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report.startup.items())
        + "  (hf: imports and model load per task set, averaged; rayeval: placement and load)"
    )
    return target_rows(report, ours)


def target_rows(report: Report, ours: list[str]) -> list[list[str]]:
    """Issue 54's targets at this run's figures: target, figure, met."""
    rows = []

    def add(what: str, value: float | None, limit: float, unit: str) -> None:
        if value is None:
            rows.append([what, "n/a", "not measured"])
            return
        rows.append([what, f"{value:.2f}{unit}", "met" if value <= limit else "NOT met"])

    runs = report.runs
    one = {label: max(r["1x1"].private) for label, r in runs.items() if "1x1" in r}
    add("rolling private per rank, 1x1 <= 0.6 GB", one.get("rolling"), 0.6, " GB")
    if "1x2" in ours:
        for label, r in runs.items():
            if label in one and one[label] > 0:
                value = max(r["1x2"].private) / one[label]
                add(f"{label}: 1x2 private <= 0.6x 1x1", value, 0.6, "x")
    together = ALL if ALL in runs else SUM
    hf_all = runs.get(together, {}).get(HF)
    for name, limit in (("1x1", 0.7), ("1x2", 0.45)):
        run = runs.get(together, {}).get(name)
        value = run.seconds / hf_all.seconds if run and hf_all else None
        add(f"{together}: wall {name} <= {limit}x hf", value, limit, "x")
    return rows


# ----------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--layouts`` as a list."""
    parser = argparse.ArgumentParser(description="Qwen2.5-0.5B's shape beside lm-eval hf.")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24; fewer: quick)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--limit", type=int, default=6, help="documents per task (6)")
    parser.add_argument("--layouts", default="hf,1x1,1x2", help="hf and RxG layouts")
    parser.add_argument(
        "--rolling_tokens", type=int, default=2000, help="tokens per rolling document (2000)"
    )
    parser.add_argument(
        "--no_together", action="store_true", help="skip the run of all four task sets at once"
    )
    parser.add_argument(
        "--cpus_per_rank", type=int, default=None, help="threads per rank (cores / ranks)"
    )
    parser.add_argument("--interval_ms", type=float, default=10.0, help="sampling interval (10)")
    parser.add_argument("--num_cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--model_dir", default=None, help="the model's folder (built if empty)")
    parser.add_argument("--json", default=None, help="also write every figure as JSON here")
    parser.add_argument("--hf_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for name in args.layouts:
        if name != HF:
            parse_layout(name)
    return args


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """The model (built once) and the task folder; their paths."""
    from rayeval.service.demo import ensure_demo_assets

    demo = ensure_demo_assets()
    model = model_dir_for(args)
    if not (model / "config.json").is_file():
        started = time.perf_counter()
        build_model(model, args.layers, demo.model_dir)
        print(f"built {model} in {time.perf_counter() - started:.1f} s")
    return {"model": model, "tasks": write_tasks(work, demo.model_dir, args), "work": work}


def measure(args: argparse.Namespace, paths: dict[str, Path]) -> Report:
    """Every layout on every task set; the per-sample comparison with hf."""
    import ray

    task_sets = dict(REQUEST_TASKS)
    if not args.no_together:
        task_sets[ALL] = [t for tasks in REQUEST_TASKS.values() for t in tasks]
    runs: dict[str, dict[str, Run]] = {label: {} for label in task_sets}
    startup: dict[str, float] = {}
    if HF in args.layouts:
        seconds = []
        for label, tasks in task_sets.items():
            layout = run_hf(tasks, args, paths)
            runs[label][HF] = layout.runs["-"]
            seconds.append(layout.startup_s)
        startup[HF] = sum(seconds) / len(seconds)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        args.empty = measure_empty_rank(paths["model"])
        for name in args.layouts:
            if name == HF:
                continue
            layout = run_rayeval(name, task_sets, args, paths)
            startup[name] = layout.startup_s
            print(f"{name}: {layout.notes}")
            for label, run in layout.runs.items():
                runs[label][name] = run
    finally:
        ray.shutdown()
    if args.no_together:
        runs[SUM] = summed(runs)
    parity: dict[str, dict[str, str]] = {}
    holds = True
    for label, by_layout in runs.items():
        if HF not in by_layout or label == SUM:
            continue
        worst = 0.0
        for name, run in by_layout.items():
            if name == HF:
                continue
            diff, ok, summary = compare(by_layout[HF].results, run.results, args.dtype)
            worst = max(worst, diff)
            holds &= ok
            parity.setdefault(label, {})[name] = summary
        parity[label]["max"] = f"{worst:.2g}"
    return Report(runs, startup, parity, holds)


def summed(runs: dict[str, dict[str, Run]]) -> dict[str, Run]:
    """Per layout, the four task sets' wall times added and their memory's maximum (no results:
    ``--no_together`` evaluates the four only one at a time)."""
    layouts = set.intersection(*(set(by_layout) for by_layout in runs.values()))
    total = {}
    for name in layouts:
        parts = [by_layout[name] for by_layout in runs.values()]
        private = [max(ranks) for ranks in zip(*(p.private for p in parts), strict=True)]
        hwm = [p.vm_hwm for p in parts if p.vm_hwm is not None]
        above = None
        if all(p.above_load for p in parts):
            above = [max(ranks) for ranks in zip(*(p.above_load for p in parts), strict=True)]
        total[name] = Run(sum(p.seconds for p in parts), {}, private, max(hwm, default=None), above)
    return total


def write_json(args: argparse.Namespace, report: Report, targets: list[list[str]]) -> None:
    """Every figure (not the results) and the arguments as JSON in ``--json``."""
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    figures = {
        label: {
            name: {
                "seconds": run.seconds,
                "private_gb": run.private,
                "above_load_gb": run.above_load,
                "vm_hwm_gb": run.vm_hwm,
            }
            for name, run in by_layout.items()
        }
        for label, by_layout in report.runs.items()
    }
    Path(args.json).write_text(
        json.dumps(
            {
                "runs": figures,
                "startup_s": report.startup,
                "parity": report.parity,
                "targets": targets,
                "args": {k: v for k, v in vars(args).items() if k != "empty"},
                "empty_rank": args.empty,
            },
            indent=2,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Build (or reuse) the model, run every layout; 1 if a float32 answer differs from hf's."""
    args = parse_args(argv)
    if args.hf_child:
        return hf_child(args.hf_child)
    set_environment(local_ray=True)  # the local, single-user Ray below
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-vocab-") as work:
        paths = prepare(args, Path(work))
        print(
            f"model: Qwen2 of Qwen2.5-0.5B's shape, {args.layers} layers, vocabulary 151,936, "
            f"{args.dtype}, random weights ({paths['model']})\n"
            f"tasks: {', '.join(f'{k} {v[0]}' for k, v in REQUEST_TASKS.items())}; "
            f"limit {args.limit}, rolling documents of ~{args.rolling_tokens} tokens\n"
            f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}\n"
        )
        report = measure(args, paths)
    print(f"empty rank: RssAnon {args.empty['RssAnon'] / GB:.2f} GB (subtracted from rayeval's)\n")
    targets = print_tables(report, args.layouts)
    print()
    print(format_table(["target (issue 54)", "figure", ""], targets))
    print()
    for label, by_layout in report.parity.items():
        for name, summary in by_layout.items():
            if name != "max":
                print(f"parity {label} {name} vs hf: {summary}")
    if not report.parity_holds:
        print("rayeval's answers DIFFER from lm-eval hf's beyond float32's bound")
    if args.json:
        write_json(args, report, targets)
    return 0 if report.parity_holds else 1


if __name__ == "__main__":
    sys.exit(main())
