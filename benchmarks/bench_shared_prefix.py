"""Model work per task shape: tokens fed to the model and LM time, lm-eval hf vs rayeval, one run.

Each task shape of :mod:`rayeval.service.demo.shaped` (hellaswag-, 10-shot ARC-, 5-shot MMLU-,
wikitext- and generation-shaped) is evaluated on its own, by lm-eval's own ``hf`` backend
(``batch_size`` 16, as ``lm_eval --model hf --batch_size 16``) and by rayeval (``batch_size
auto``, shared prefixes on; ``--no_share`` for off) in each layout asked for, all loaded at once
in this process and run in turn, shape by shape (``--repeat N``: N such rounds, and the fastest
LM time of each). Per shape and backend it prints:

* ``fed`` -- tokens at the model's input, counted by a forward pre-hook on the input embeddings
  (every call: every forward, every ``generate`` step, padding and rayeval's dummy micro-batches
  included; for rayeval summed over every rank, read from the ranks after each shape);
* ``real`` -- those tokens that are not padding. rayeval pads with the tokenizer's pad id;
  lm-eval pads score rows on the right with id 0 and generation rows on the left with the pad id.
  The demo tokenizer never produces either id from text, so ``real`` = positions whose id is not
  the pad id, minus each lm-eval score row's trailing zeros;
* ``LM s`` -- seconds inside the LM's request methods for that shape (tokenisation, batching,
  dispatch, compute), as bench_engine.py times them;
* the ratios rayeval / hf for ``fed`` and hf / rayeval for ``LM s``; the largest |dlogprob| of
  any sample; and whether every sample agrees with hf (|dlogprob| <= 1e-4, or two float32 ulps
  of a whole-document sum above 1024 in magnitude; same ``is_greedy`` and generations).

The ``mix`` line sums every shape. The default model is the bundled tiny Llama with its window
raised to 2048 positions (rotary positions: the weights are unchanged), so that few-shot prompts
fit as they do on real models. Usage::

    .venv/bin/python benchmarks/bench_shared_prefix.py --hf_threads 1
    .venv/bin/python benchmarks/bench_shared_prefix.py --hf_threads 1 --hidden 512 --repeat 3
    .venv/bin/python benchmarks/bench_shared_prefix.py --device cuda --model /path/to/model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.agreement import compare  # noqa: E402
from benchmarks.common import (  # noqa: E402
    PhaseTimer,
    format_table,
    make_task_manager,
    parse_layout,
    set_environment,
)

WINDOW = 2048


class HfTokenCounter:
    """Counts what lm-eval's hf model is fed, at its input embeddings."""

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.fed = 0
        self.real = 0
        self._pad = pad_token_id
        model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, _module: Any, args: tuple[Any, ...]) -> None:
        ids = args[0]
        self.fed += ids.numel()
        for row in ids.tolist():
            while row and row[-1] == 0:  # lm-eval's right padding of score rows
                row.pop()
            self.real += sum(1 for token in row if token != self._pad)

    def snapshot(self) -> dict[str, int]:
        """Tokens fed so far, and how many of them were not padding."""
        return {"fed": self.fed, "real": self.real}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--layouts`` as ``(R, G)`` pairs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="1x1", help="rayeval layouts RxG (default 1x1)")
    parser.add_argument("--docs", type=int, default=40, help="documents per shape (default 40)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="model (default: tiny Llama, 2048 window)")
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="instead: a randomly initialised Llama of this width with the demo tokenizer "
        "(compute-bound timings; log-probs still compared with hf)",
    )
    parser.add_argument("--layers", type=int, default=4, help="layers of the --hidden model")
    parser.add_argument("--batch_size", type=int, default=16, help="hf rows per batch")
    parser.add_argument("--max_batch_tokens", type=int, default=None)
    parser.add_argument("--hf_threads", type=int, default=None, help="torch threads of hf")
    parser.add_argument("--no_share", action="store_true", help="rayeval without sharing")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every shape on every backend, interleaved; LM s is the fastest round's "
        "(default 1)",
    )
    parser.add_argument(
        "--shapes", default=None, help="comma-separated subset of the shapes (default: all)"
    )
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    args.layouts = [parse_layout(item) for item in args.layouts.split(",") if item.strip()]
    return args


def wide_demo_model(out: Path, hidden: int | None, layers: int) -> str:
    """The bundled tiny Llama (or a random one ``hidden`` wide) with a ``WINDOW`` window."""
    import torch
    import transformers

    from rayeval.service.demo import ensure_demo_assets

    model_dir = out / "model"
    shutil.copytree(ensure_demo_assets().model_dir, model_dir)
    if hidden is not None:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        config.hidden_size, config.intermediate_size = hidden, 4 * hidden
        config.num_hidden_layers, config.num_attention_heads = layers, max(1, hidden // 64)
        config.num_key_value_heads = config.num_attention_heads
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = WINDOW
    config_path.write_text(json.dumps(config, indent=2))
    return str(model_dir)


class Backend:
    """One row of the table: an LM, how to read its token counts, and its timed calls."""

    def __init__(self, name: str, lm: Any, counts: Any) -> None:
        self.name, self.lm, self.counts = name, lm, counts
        self.timer = PhaseTimer(lm)
        self.figures: dict[str, dict[str, Any]] = {}

    def evaluate(self, shape: str, task_manager: Any) -> None:
        """Evaluate one shape; keep the first results and tokens, and the fastest LM time."""
        import lm_eval

        before = dict(self.counts())
        seconds = sum(p.seconds for p in self.timer.phases.values())
        results = lm_eval.simple_evaluate(
            model=self.lm,
            tasks=[shape],
            task_manager=task_manager,
            log_samples=True,
            bootstrap_iters=0,
        )
        after = self.counts()
        lm_s = sum(p.seconds for p in self.timer.phases.values()) - seconds
        fed = after["fed"] - before.get("fed", 0)
        known = self.figures.get(shape)
        if known is None:
            real = after["real"] - before.get("real", 0)
            self.figures[shape] = {"results": results, "fed": fed, "real": real, "lm_s": lm_s}
            return
        if fed != known["fed"]:
            raise RuntimeError(f"{self.name}/{shape}: a repeat fed the model other tokens")
        known["lm_s"] = min(known["lm_s"], lm_s)


def run_interleaved(
    backends: list[Backend], shapes: list[str], task_manager: Any, repeat: int
) -> None:
    """Every shape on every backend in turn, ``repeat`` rounds.

    Interleaved, so that a slow moment of a shared machine falls on both sides of a ratio rather
    than on one backend's whole row; the fastest of the rounds is kept for each.
    """
    for round_ in range(repeat):
        for shape in shapes:
            for backend in backends:
                print(f"round {round_ + 1}: {backend.name} on {shape}", file=sys.stderr, flush=True)
                backend.evaluate(shape, task_manager)


def select_shapes(args: argparse.Namespace, work: Path) -> tuple[list[str], Any]:
    """The shapes asked for, their task YAMLs written under ``work``, datasets prepared.

    Returns the shapes and the task manager. Raises SystemExit naming the known shapes when
    ``--shapes`` names another.
    """
    from lm_eval.tasks import get_task_dict

    from rayeval.service.demo.shaped import SHAPED_TASKS, write_shaped_tasks

    tasks_dir = write_shaped_tasks(work / "tasks", docs=args.docs)
    shapes = list(SHAPED_TASKS)
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            raise SystemExit(f"unknown --shapes {sorted(unknown)}: choose from {shapes}")
        shapes = [shape for shape in shapes if shape in args.shapes.split(",")]
    task_manager = make_task_manager(shapes, str(tasks_dir))
    get_task_dict(shapes, task_manager)  # datasets prepared before any row
    return shapes, task_manager


def hf_backend(args: argparse.Namespace, model_dir: str) -> Backend:
    """lm-eval's own ``hf`` model in this process, its input tokens counted."""
    from lm_eval.api.registry import get_model

    hf = get_model("hf").create_from_arg_obj(
        {"pretrained": model_dir, "dtype": args.dtype},
        {"batch_size": args.batch_size, "max_batch_size": None, "device": args.device},
    )
    counter = HfTokenCounter(hf.model, hf.tokenizer.pad_token_id)
    return Backend("lm-eval hf", hf, counter.snapshot)


def run_with_rayeval(
    args: argparse.Namespace,
    model_dir: str,
    backends: list[Backend],
    shapes: list[str],
    task_manager: Any,
) -> None:
    """Start Ray and every layout beside ``backends``, then run every shape on all of them."""
    import ray

    from rayeval.service.engine.lm import RayEvalLM

    # Every layout's ranks stay up beside hf's model (idle ranks cost no CPU).
    cpus = sum(r * g for r, g in args.layouts)
    ray.init(num_cpus=max(os.cpu_count() or 1, cpus), log_to_driver=False)
    try:
        with contextlib.ExitStack() as stack:
            for replicas, shards in args.layouts:
                lm = stack.enter_context(
                    RayEvalLM(
                        pretrained=model_dir,
                        num_replicas=replicas,
                        shard_size=shards,
                        batch_size="auto",
                        max_batch_tokens=args.max_batch_tokens,
                        device=args.device,
                        dtype=args.dtype,
                        share_prefixes=not args.no_share,
                    )
                )
                lm.engine.load_reports  # noqa: B018 -- loading stays out of every shape's time
                name = f"rayeval {replicas}x{shards}"
                backends.append(
                    Backend(name, lm, lambda lm=lm: asdict(lm.engine.input_token_counts()))
                )
            run_interleaved(backends, shapes, task_manager, args.repeat)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run every shape on every backend and print the table; 1 if a float32 row differs."""
    args = parse_args(argv)
    set_environment(local_ray=not os.environ.get("RAY_ADDRESS"))
    import lm_eval
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    try:
        model_dir = args.model or wide_demo_model(work, args.hidden, args.layers)
        shapes, task_manager = select_shapes(args, work)
        if args.hf_threads:
            torch.set_num_threads(args.hf_threads)
        backends = [hf_backend(args, model_dir)]
        run_with_rayeval(args, model_dir, backends, shapes, task_manager)
        rows = {backend.name: backend.figures for backend in backends}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    return report(args, rows, shapes, model_dir, lm_eval.__version__, torch.__version__)


#: The columns of the table :func:`report` prints.
COLUMNS = ["shape", "row", "fed", "real", "fed vs hf", "LM s", "LM vs hf", "max |dlp|", "agrees"]
KEPT = ("fed", "real", "lm_s")


def _agreement(
    name: str, shape: str, mine: dict[str, Any], base: dict[str, Any], failed: list[str]
) -> tuple[str, str]:
    """("yes"/"NO", largest |dlogprob|) against hf, blank for hf itself; records a failure."""
    if name == "lm-eval hf":
        return "", ""
    agreement = compare(base["results"], mine["results"])
    if agreement.ok():
        return "yes", f"{agreement.max_logprob_diff:.1e}"
    failed.append(
        f"{name}/{shape} (max |dlogprob| {agreement.max_logprob_diff:.2e} "
        f"at {agreement.max_logprob_pair}, {agreement.beyond_tolerance} beyond "
        "tolerance, "
        f"{agreement.discrete_diffs} discrete differences, "
        f"{agreement.samples} samples; {'; '.join(agreement.problems[:3])})"
    )
    return "NO", f"{agreement.max_logprob_diff:.1e}"


def _cells(
    shape: str, name: str, mine: dict[str, Any], base: dict[str, Any], worst: str, agree: str
) -> list[str]:
    return [
        shape, name, f"{mine['fed']:,}", f"{mine['real']:,}",
        f"{mine['fed'] / base['fed']:.2f}x" if base["fed"] else "n/a",
        f"{mine['lm_s']:.2f}",
        f"{base['lm_s'] / mine['lm_s']:.2f}x" if mine["lm_s"] else "n/a",
        worst,
        agree,
    ]  # fmt: skip


def _backend_rows(
    name: str,
    figures: dict[str, dict[str, Any]],
    hf: dict[str, dict[str, Any]],
    shapes: list[str],
    failed: list[str],
) -> tuple[list[list[str]], dict[str, Any]]:
    """One backend's table rows (every shape, then the ``mix`` of them) and its JSON summary."""
    totals: dict[str, Any] = {"fed": 0, "real": 0, "lm_s": 0.0}
    hf_totals: dict[str, Any] = {"fed": 0, "real": 0, "lm_s": 0.0}
    table, summary = [], {}
    for shape in shapes:
        mine, base = figures[shape], hf[shape]
        for key in totals:
            totals[key] += mine[key]
            hf_totals[key] += base[key]
        agree, worst = _agreement(name, shape, mine, base, failed)
        table.append(_cells(shape, name, mine, base, worst, agree))
        summary[shape] = {k: v for k, v in mine.items() if k in KEPT}
    table.append(_cells("mix", name, totals, hf_totals, "", ""))
    summary["mix"] = dict(totals)
    return table, summary


def report(
    args: argparse.Namespace,
    rows: dict[str, dict[str, dict[str, Any]]],
    shapes: list[str],
    model_dir: str,
    lm_eval_version: str,
    torch_version: str,
) -> int:
    """Print the run's description and the table; write ``--json``; return the exit status."""
    hf = rows["lm-eval hf"]
    print(
        f"\nmodel {model_dir} ({args.dtype}, {args.device}); {args.docs} docs per shape; "
        f"LM s: fastest of {args.repeat}"
    )
    print(
        f"machine: {os.cpu_count()} CPU cores, {platform.platform()}; hf torch threads "
        f"{args.hf_threads or 'default'}; torch {torch_version}, lm-eval {lm_eval_version}"
    )
    print("load average: {:.1f} {:.1f} {:.1f}\n".format(*os.getloadavg()))
    table: list[list[str]] = []
    failed: list[str] = []
    summary: dict[str, Any] = {}
    for name, figures in rows.items():
        backend_table, summary[name] = _backend_rows(name, figures, hf, shapes, failed)
        table += backend_table
    table.sort(key=lambda r: ([*shapes, "mix"].index(r[0]), r[1] != "lm-eval hf"))
    print(format_table(COLUMNS, table))
    verdict = f"DIFFER from hf: {', '.join(failed)}" if failed else "every shape agrees with hf"
    print(f"\n{verdict}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": summary, "verdict": verdict}, indent=2))
    return 1 if failed and args.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
