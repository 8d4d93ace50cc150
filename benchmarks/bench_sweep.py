"""A checkpoint sweep against one evaluation per checkpoint, in one run: seconds per checkpoint.

Saves N checkpoints of one model as ``torch.distributed.checkpoint`` directories (the trained
tiny demo Llama, or with ``--hidden``/``--layers`` a larger random-weight Llama on the demo
tokenizer; each step its own seeded noise), then evaluates the same tasks three ways, each in its
own processes, as a user would:

1. **sweep** — one ``rayeval run --checkpoints DIR/step-*``: ranks start once and swap weights;
2. **rayeval run** — one ``rayeval run --model_args ...,checkpoint=DIR/step-K`` per checkpoint;
3. **lm_eval** — what it takes today: merge each checkpoint into a safetensors copy (DCP's
   ``dcp_to_torch_save``, then ``save_pretrained``; timed apart) and one
   ``lm_eval run --model hf`` per merged copy.

It prints seconds per checkpoint side by side (wall time of each process; the sweep's first
checkpoint carries the process start, Ray and the ranks), and the sweep's own breakdown per
checkpoint from its ``sweep.json``: swap (the driver's check and every rank reading its slices),
the slowest rank's read, the ranks' compute, and the rest (lm-eval's per-evaluation work:
filters, metrics, its environment report, files). Every checkpoint's metrics must agree between
the three (float32; exit status 1 otherwise).

With ``--adapters``, the checkpoints are those of one LoRA run on the model instead (PEFT
on the CPU, seconds; ``checkpoint-<step>/`` with a ``trainer_state.json``, as a trainer saves
them): the sweep keeps the base loaded and swaps only the adapter; the second row is one
``rayeval run --model_args ...,peft=DIR/checkpoint-K`` per checkpoint (the base loaded each
time) and the third one ``lm_eval run --model hf --model_args ...,peft=...`` each (no merge).

Usage: ``python benchmarks/bench_sweep.py [--checkpoints 3] [--tasks demo] [--limit 8]
[--hidden 1024 --layers 8] [--shard_size 1] [--adapters] [--rest] [--json out.json]``

With ``--rest``, a fourth row: the same sweep submitted to ``rayeval serve`` (``"sweep":
{"checkpoints": [...]}``), timed by when each checkpoint shows in ``GET /evaluations/{id}/sweep``;
its served results must agree too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rest_sweep import rest_sweep

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the local Ray each process starts
BIN = Path(sys.executable).parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints (3)")
    parser.add_argument("--tasks", default="demo", help="lm-eval tasks (demo)")
    parser.add_argument("--limit", type=float, default=8, help="documents per task (8)")
    parser.add_argument("--num_fewshot", type=int, default=1, help="few-shot examples (1)")
    parser.add_argument("--hidden", type=int, default=None, help="random Llama's hidden size")
    parser.add_argument("--layers", type=int, default=8, help="random Llama's blocks (8)")
    parser.add_argument("--shard_size", type=int, default=1, help="G of the rayeval rows (1)")
    parser.add_argument(
        "--bootstrap_iters",
        type=int,
        default=100000,
        help="stderr bootstrap of the rayeval rows (lm-eval's default, 100000; lm_eval's own "
        "command line cannot change it)",
    )
    parser.add_argument("--skip_lm_eval", action="store_true", help="no lm_eval row")
    parser.add_argument(
        "--adapters", action="store_true", help="checkpoints of a LoRA run instead (peft=)"
    )
    parser.add_argument(
        "--rest", action="store_true", help="also the sweep through `rayeval serve` (REST)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args(argv)


def build_model(out: Path, args: argparse.Namespace) -> tuple[Path, Any]:
    """The model directory (config, tokenizer) and its weights: the demo Llama, or a random one."""
    import torch
    import transformers

    from rayeval.service.demo import ensure_demo_assets

    demo = ensure_demo_assets().model_dir
    if args.hidden is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
        return demo, model
    config = transformers.AutoConfig.from_pretrained(demo)
    config.hidden_size, config.num_hidden_layers = args.hidden, args.layers
    config.intermediate_size = args.hidden * 8 // 3 // 64 * 64
    config.num_attention_heads, config.num_key_value_heads = args.hidden // 64, args.hidden // 128
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.save_pretrained(out)
    transformers.GenerationConfig.from_pretrained(demo).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(demo).save_pretrained(out)
    if args.adapters:  # the LoRA run trains on the saved weights
        model.save_pretrained(out)
    return out, model


def save_checkpoints(model: Any, run: Path, count: int) -> list[Path]:
    """``count`` DCP checkpoints of ``model`` plus seeded noise (one-process saves)."""
    import torch
    import torch.distributed.checkpoint as dcp

    paths = []
    for index in range(count):
        step = 100 * (index + 1)
        generator = torch.Generator().manual_seed(step)
        state = {
            name: tensor + 0.05 * tensor.std() * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()
        }
        dcp.save(state, checkpoint_id=str(run / f"step-{step}"), no_dist=True)
        paths.append(run / f"step-{step}")
    return paths


def save_adapters(model_dir: Path, run: Path, count: int) -> list[Path]:
    """``count`` checkpoints of one LoRA run on ``model_dir`` (every 2 steps, as a trainer saves
    them: ``checkpoint-<step>/`` with ``adapter_*`` files and a ``trainer_state.json``). The
    same seed and data order make the run to step 2k a prefix of the run to step 2k + 2."""
    from rayeval.service.demo.make_data import DATA_DIR
    from tests.lora_run import corpus_texts, train_lora

    paths = []
    for index in range(count):
        step = 2 * (index + 1)
        out = train_lora(model_dir, run / f"checkpoint-{step}", corpus_texts(DATA_DIR), steps=step)
        (out / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        paths.append(out)
    return paths


def merge(checkpoint: Path, model_dir: Path, out: Path) -> float:
    """Merge a DCP checkpoint into a safetensors model directory; seconds it took."""
    import torch
    import transformers
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(checkpoint), str(out.with_suffix(".pt")))
    state = torch.load(out.with_suffix(".pt"), weights_only=True)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    transformers.GenerationConfig.from_pretrained(model_dir).save_pretrained(out)
    out.with_suffix(".pt").unlink()
    return time.monotonic() - started


def lm_eval_row(
    args: argparse.Namespace, path: Path, model_dir: Path, root: Path
) -> tuple[float, float]:
    """``lm_eval run`` on one checkpoint: merged first (DCP), or with ``peft=`` (an adapter,
    applied by lm-eval itself); the seconds of the merge and of the run."""
    from rayeval.service.demo import ensure_demo_assets

    if args.adapters:
        merge_s, model_args = 0.0, f"pretrained={model_dir},dtype=float32,peft={path}"
    else:
        merged = root / "merged" / path.name
        merge_s = merge(path, model_dir, merged)
        model_args = f"pretrained={merged},dtype=float32"
    include = ensure_demo_assets().tasks_dir
    run_s = timed(
        [str(BIN / "lm_eval"), "run", "--model", "hf", "--device", "cpu", "--batch_size", "8",
         "--model_args", model_args, *task_flags(args, root / "lm_eval" / path.name, include)]
    )  # fmt: skip
    return merge_s, run_s


def timed(command: list[str]) -> float:
    """Run ``command`` to the end; its wall seconds (a failure stops the benchmark)."""
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}")
    return time.monotonic() - started


def task_flags(args: argparse.Namespace, out: Path, include: Path) -> list[str]:
    return ["--include_path", str(include), "--tasks", args.tasks, "--limit", f"{args.limit:g}",
            "--num_fewshot", str(args.num_fewshot), "--seed", "7",
            "--output_path", str(out)]  # fmt: skip


def metrics(out: Path) -> dict[str, Any]:
    """The ``results`` of the one results file under ``out``."""
    (path,) = out.glob("*/results_*.json")
    return json.loads(path.read_text())["results"]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Every metric equal within float32 noise (stderrs aside: rows may bootstrap differently)."""
    for task, entries in a.items():
        for key, value in entries.items():
            if "_stderr," in key:
                continue
            other = b.get(task, {}).get(key)
            if isinstance(value, float) and isinstance(other, float):
                if not math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-6):
                    return False
            elif value != other:
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rayeval.service.demo import ensure_demo_assets

    include = ensure_demo_assets().tasks_dir
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-sweep-") as tmp:
        root = Path(tmp)
        model_dir, model = build_model(root / "model", args)
        size_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        if args.adapters:
            paths, every = save_adapters(model_dir, root / "run", args.checkpoints), "checkpoint-*"
        else:
            paths, every = save_checkpoints(model, root / "run", args.checkpoints), "step-*"
        del model
        arg = "peft" if args.adapters else "checkpoint"
        base = f"pretrained={model_dir},dtype=float32"
        layout = [
            "--shard_size",
            str(args.shard_size),
            "--bootstrap_iters",
            str(args.bootstrap_iters),
        ]
        rayeval = [str(BIN / "rayeval"), "run", "--model", "hf", *layout]

        sweep_s = timed(
            [*rayeval, "--model_args", base, "--checkpoints", str(root / "run" / every),
             *task_flags(args, root / "sweep", include)]
        )  # fmt: skip
        summary = json.loads((root / "sweep" / "sweep.json").read_text())["checkpoints"]
        rows: list[dict[str, Any]] = []
        ok = True
        for path, record in zip(paths, summary, strict=True):
            out = root / "one" / path.name
            run_s = timed([*rayeval, "--model_args", f"{base},{arg}={path}",
                           *task_flags(args, out, include)])  # fmt: skip
            row = {"checkpoint": path.name, "sweep": record["seconds"], "rayeval_run_s": run_s}
            ok &= same(metrics(root / "sweep" / path.name), metrics(out))
            if not args.skip_lm_eval:
                row["merge_s"], row["lm_eval_s"] = lm_eval_row(args, path, model_dir, root)
                ok &= same(metrics(root / "lm_eval" / path.name), metrics(out))
            rows.append(row)
        if args.rest:
            rest = rest_sweep(root, model_dir, include, args, _rest_body(model_dir, args))
            for row, served in zip(rows, rest["rows"], strict=True):
                row["rest"] = served
                ok &= same(metrics(root / "sweep" / row["checkpoint"]),
                           rest["results"][served["label"]]["results"])  # fmt: skip
    print_table(rows, sweep_s, size_mb, args)
    if args.json is not None:
        args.json.write_text(json.dumps({"sweep_s": sweep_s, "rows": rows}, indent=2))
    if not ok:
        print("RESULTS DIFFER between the rows", file=sys.stderr)
    return 0 if ok else 1


def _rest_body(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The REST body of the same evaluation as the command-line rows."""
    return {
        "model_args": {"pretrained": str(model_dir), "dtype": "float32"},
        "tasks": args.tasks.split(","),
        "limit": args.limit,
        "num_fewshot": args.num_fewshot,
        "seed": 7,
        "bootstrap_iters": args.bootstrap_iters,
        "parallelism": {"num_replicas": 1, "shard_size": args.shard_size},
    }


def print_table(
    rows: list[dict[str, Any]], sweep_s: float, size_mb: float, args: argparse.Namespace
) -> None:
    n = len(rows)
    kind = "LoRA adapter" if args.adapters else "DCP"
    print(
        f"model {size_mb:.1f} MB fp32, {n} {kind} checkpoints, tasks {args.tasks}, limit "
        f"{args.limit:g}, G={args.shard_size}: seconds per checkpoint"
    )
    header = ["checkpoint", "sweep", "rayeval run", "merge", "lm_eval", "|", "swap", "read"]
    print("".join(f"{h:>12}" for h in [*header, "compute", "rest"]))
    for row in rows:
        s = row["sweep"]
        rest = s["total"] - s["swap"] - s.get("compute", 0.0)
        cells = [row["checkpoint"], s["total"], row["rayeval_run_s"], row.get("merge_s", "-"),
                 row.get("lm_eval_s", "-"), "|", s["swap"], s.get("read", 0.0),
                 s.get("compute", 0.0), rest]  # fmt: skip
        print("".join(f"{c:>12.2f}" if isinstance(c, float) else f"{c:>12}" for c in cells))
    further = rows[1:]
    if further:
        mean = sum(r["sweep"]["total"] for r in further) / len(further)
        read = sum(r["sweep"].get("read", 0.0) for r in further) / len(further)
        beyond = sum(r["sweep"]["total"] - r["sweep"]["evaluate"] for r in further) / len(further)
        print(
            f"sweep process: {sweep_s:.2f}s in all ({sweep_s / n:.2f}s per checkpoint); after "
            f"the first, {mean:.2f}s per checkpoint, of which {read:.2f}s reading weights and "
            f"{beyond:.2f}s beyond its evaluation (swap and files)"
        )
    if rows and "rest" in rows[0]:
        gaps = ", ".join(f"{r['rest']['gap_s']:.2f}s" for r in rows)
        further = [r["rest"]["seconds"]["total"] for r in rows[1:]]
        print(
            f"REST sweep (rayeval serve): each checkpoint listed by GET /sweep after {gaps} "
            f"(from the submission, then from the one before); the runner's own figures after "
            f"the first: {', '.join(f'{t:.2f}s' for t in further)}"
        )
    total_run = sum(r["rayeval_run_s"] for r in rows)
    print(f"{n} rayeval runs: {total_run:.2f}s in all ({total_run / n:.2f}s per checkpoint)")
    if rows and "lm_eval_s" in rows[0]:
        total = sum(r["lm_eval_s"] + r["merge_s"] for r in rows)
        print(f"{n} merges + lm_eval runs: {total:.2f}s in all ({total / n:.2f}s per checkpoint)")


if __name__ == "__main__":
    sys.exit(main())
