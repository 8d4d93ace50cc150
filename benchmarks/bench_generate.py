"""Generation and prefill speed of the ways to shard a replica, beside lm-eval's hf, in one run.

One process builds a Llama of a few hundred MB with random weights (fp32; the model
:func:`bench_memory.build_model` builds), then runs the same requests several ways and prints
them side by side:

* ``lm-eval hf`` — lm-eval's ``HFLM`` in this process (torch threads: every core);
* ``1x1 c1`` — rayeval, one rank with one core (what each rank of a sharded replica gets);
* ``1x1 cN`` — rayeval, one rank with every core (``--cpus_per_rank N``);
* ``1x2 fsdp`` — two ranks of one core, FSDP2 (each rank generates its own micro-batch);
* ``1x2 default`` — two ranks of one core, the default ``shard_strategy`` (``auto``: tensor
  parallelism for this model);
* ``1x2 default gloo`` — the default again with ``--shm_collectives false``: the TP ranks'
  all-reduces over gloo's sockets instead of shared memory;
* ``1x2 fsdp wW`` — FSDP again with micro-batches of ``W`` rows (``--fsdp_widths``): decode
  tokens/s against batch width, since each decode step's all-gathers serve the whole batch.

Requests (the same for every row, built from the demo corpus with the model's tokenizer):

* ``generate_until``: ``--prompts`` prompts of 40-100 tokens, greedy, exactly
  ``--new_tokens`` new tokens each (no stop sequence but EOS), ``--batch`` rows per batch.
  **decode tok/s** = prompts x new tokens / seconds of the ``generate_until`` call.
* ``loglikelihood``: ``--prefill_requests`` contexts of ``--prefill_len`` tokens with an 8-token
  continuation, ``--batch`` rows per batch. **prefill tok/s** = input tokens / seconds of the
  ``loglikelihood`` call.

Both are wall times of the LM call (driver tokenisation and dispatch included), measured after
the model is loaded. Every row's generations are compared with the hf row's (``same gen``:
identical texts / all) and its log-probs (``max|dlogprob|``); the exit status is 1 when a float32
row differs (any generation, or a log-prob by more than 1e-4). Timings are only meaningful with
the machine to itself: run it under ``flock -x /tmp/rayeval-cpu.lock`` on shared machines.

``--workload varied`` runs instead, on the same rows, a generation workload whose greedy answers
need 2 to 96 tokens (a tiny model it trains in well under a minute, 360 requests through an
lm-eval task) and counts the decode row-steps each row computes (:mod:`benchmarks.varied_bench`).

Usage::

    .venv/bin/python benchmarks/bench_generate.py                     # ~240M-parameter Llama
    .venv/bin/python benchmarks/bench_generate.py --layers 12 --json out/generate.json
    .venv/bin/python benchmarks/bench_generate.py --workload varied --only "1x1 c1,1x2 default"
    # GPU machine (CUDA torch): NCCL, bf16, one GPU per rank
    .venv/bin/python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --rows gpu
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_memory import add_model_arguments, build_model, model_figures  # noqa: E402
from benchmarks.common import set_environment  # noqa: E402

MIB = 1024 * 1024
LOGPROB_TOL = 1e-4


@dataclass(frozen=True)
class RowSpec:
    """One way of running the requests."""

    name: str
    shard_size: int = 1
    cpus_per_rank: int = 1
    strategy: str = "auto"
    batch: int | None = None  # rows per micro-batch; None: --batch
    hf: bool = False
    gloo: bool = False  # the ranks' collectives on gloo even where shared memory would serve
    static: bool = False  # generate in static batches (continuous batching off)


@dataclass
class RowFigures:
    name: str
    load_s: float = 0.0
    generate_s: float = 0.0
    prefill_s: float = 0.0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    strategy: str | None = None
    batch: int = 0
    same_generations: int = 0
    max_dlogprob: float = 0.0
    generations: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def row_specs(args: argparse.Namespace) -> list[RowSpec]:
    cores = args.cores
    rows = [RowSpec("lm-eval hf", hf=True)]
    if args.device == "cuda":
        rows += [
            RowSpec("1x1", 1),
            RowSpec("1x2 fsdp", 2, strategy="fsdp"),
            RowSpec("1x2 tp", 2, strategy="tp"),
        ]
    else:
        rows += [
            RowSpec("1x1 c1", 1, 1),
            RowSpec(f"1x1 c{cores}", 1, cores),
            RowSpec("1x2 fsdp", 2, 1, "fsdp"),
            RowSpec("1x2 default", 2, 1, "auto"),
            RowSpec("1x2 default gloo", 2, 1, "auto", gloo=True),
            RowSpec("1x1 c1 static", 1, 1, static=True),
            RowSpec("1x2 default static", 2, 1, "auto", static=True),
        ]
    rows += [RowSpec(f"1x2 fsdp w{w}", 2, 1, "fsdp", batch=w) for w in args.fsdp_widths]
    if args.only:
        unknown = set(args.only) - {row.name for row in rows}
        if unknown:
            raise SystemExit(f"--only: no row {sorted(unknown)}; rows: {[r.name for r in rows]}")
        rows = [row for row in rows if row.hf or row.name in args.only]  # hf: the reference
    return rows


def build_requests(tokenizer: Any, args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The generate_until and loglikelihood Instances (the same for every row)."""
    import random

    from lm_eval.api.instance import Instance

    from rayeval.service.demo.tiny_model import load_corpus

    ids: list[int] = []
    for text in load_corpus():
        ids += tokenizer(text + "\n", add_special_tokens=False)["input_ids"]
    rng = random.Random(0)

    def text_of(length: int) -> str:
        start = rng.randrange(0, len(ids) - length)
        return tokenizer.decode(ids[start : start + length])

    gen_kwargs = {"until": [], "max_gen_toks": args.new_tokens, "do_sample": False}
    generate = [
        Instance("generate_until", {}, (text_of(rng.randint(40, 100)), dict(gen_kwargs)), i)
        for i in range(args.prompts)
    ]
    loglikelihood = []
    for i in range(args.prefill_requests):
        text = text_of(args.prefill_len + 8)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        context = tokenizer.decode(tokens[: args.prefill_len])
        continuation = tokenizer.decode(tokens[args.prefill_len :])
        loglikelihood.append(Instance("loglikelihood", {}, (context, continuation), i))
    return generate, loglikelihood


def run_row(
    spec: RowSpec, model_dir: Path, requests: tuple[list[Any], list[Any]], args: argparse.Namespace
) -> RowFigures:
    batch = spec.batch or args.batch
    figures = RowFigures(spec.name, batch=batch)
    generate, loglikelihood = requests
    started = time.perf_counter()
    if spec.hf:
        import torch
        from lm_eval.models.huggingface import HFLM

        cpu_threads = args.hf_threads or args.cores
        torch.set_num_threads(cpu_threads if args.device == "cpu" else torch.get_num_threads())
        lm: Any = HFLM(
            pretrained=str(model_dir), device=args.device, dtype=args.dtype, batch_size=batch
        )
        close = None
    else:
        from rayeval.service.engine.lm import RayEvalLM

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
        lm.engine.load_reports  # noqa: B018 - waits until every rank has loaded
        figures.strategy = lm.engine.shard_strategy.value if spec.shard_size > 1 else None
        close = lm.close
    figures.load_s = time.perf_counter() - started
    try:
        started = time.perf_counter()
        figures.generations = lm.generate_until(generate, disable_tqdm=True)
        figures.generate_s = time.perf_counter() - started
        started = time.perf_counter()
        figures.logprobs = [lp for lp, _ in lm.loglikelihood(loglikelihood, disable_tqdm=True)]
        figures.prefill_s = time.perf_counter() - started
    finally:
        if close is not None:
            close()
        del lm
    figures.decode_tok_s = len(generate) * args.new_tokens / figures.generate_s
    figures.prefill_tok_s = len(loglikelihood) * args.prefill_len / figures.prefill_s
    return figures


def print_table(rows: list[RowFigures], reference: RowFigures, prompts: int) -> None:
    by_name = {row.name: row for row in rows}
    fsdp = by_name.get("1x2 fsdp")
    single = by_name.get("1x1 c1")
    headers = [
        "row",
        "strategy",
        "batch",
        "load s",
        "generate s",
        "decode tok/s",
        "prefill tok/s",
        "vs hf",
        "vs 1x2 fsdp",
        "vs 1x1 c1",
        "same gen",
        "max|dlogprob|",
    ]
    lines = []
    for row in rows:
        lines.append(
            [
                row.name,
                row.strategy or "-",
                str(row.batch),
                f"{row.load_s:.1f}",
                f"{row.generate_s:.1f}",
                f"{row.decode_tok_s:.1f}",
                f"{row.prefill_tok_s:.0f}",
                f"{reference.generate_s / row.generate_s:.2f}x",
                f"{fsdp.generate_s / row.generate_s:.2f}x" if fsdp else "-",
                f"{single.generate_s / row.generate_s:.2f}x" if single else "-",
                f"{row.same_generations}/{prompts}",
                f"{row.max_dlogprob:.1e}",
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    print("vs columns: generate seconds of that row / of this row (above 1: this row is faster)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Generation and prefill speed per strategy.")
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=32, help="generate_until prompts (32)")
    parser.add_argument("--new_tokens", type=int, default=48, help="new tokens per prompt (48)")
    parser.add_argument("--batch", type=int, default=16, help="rows per batch, every row (16)")
    parser.add_argument(
        "--fsdp_widths", default="8", help="extra 1x2 FSDP rows at these batch widths (8)"
    )
    parser.add_argument("--prefill_requests", type=int, default=32, help="loglikelihood reqs")
    parser.add_argument("--prefill_len", type=int, default=128, help="context tokens (128)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="CPU cores")
    parser.add_argument(
        "--hf_threads", type=int, default=None, help="torch threads of the hf row (--cores)"
    )
    parser.add_argument("--num_cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--model_dir", default=None, help="build (or reuse) the model here")
    parser.add_argument(
        "--only", default="", help="comma-separated row names to run (the hf row always runs)"
    )
    parser.add_argument("--json", default=None, help="also write every figure as JSON here")
    parser.add_argument(
        "--workload",
        default="fixed",
        choices=["fixed", "varied"],
        help="fixed: the random model, fixed answer lengths (default); varied: a trained tiny "
        "model whose 360 greedy answers need 2-96 tokens, through an lm-eval task "
        "(benchmarks/varied_bench.py)",
    )
    parser.add_argument(
        "--rayeval_batch_size",
        default="auto",
        help="varied workload: rayeval's batch_size (auto); --batch is the hf row's",
    )
    parser.add_argument("--seed", type=int, default=0, help="varied workload: model, questions")
    args = parser.parse_args(argv)
    args.fsdp_widths = [int(w) for w in args.fsdp_widths.split(",") if w.strip()]
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=True)  # the local, single-user Ray below
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.workload == "varied":
        from benchmarks.varied_bench import main_varied

        return main_varied(args, row_specs(args))

    import ray
    import torch
    import transformers

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="bench-generate-"))
    if not (model_dir / "config.json").is_file():
        build_model(model_dir, args, assets.model_dir)
    sizes = model_figures(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    requests = build_requests(tokenizer, args)
    gpus = {"num_gpus": torch.cuda.device_count()} if args.device == "cuda" else {}
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, **gpus)
    try:
        print(
            f"model    Llama, {sizes['model'] / 4e6:.0f}M parameters, {args.layers} blocks, "
            f"{args.heads} heads, {sizes['model'] / MIB:,.0f} MiB in fp32, random weights\n"
            f"machine  {args.device}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, dtype {args.dtype}\n"
            f"requests {args.prompts} prompts x {args.new_tokens} new tokens (greedy); "
            f"{args.prefill_requests} loglikelihood x {args.prefill_len} tokens; "
            f"batch {args.batch}\n"
        )
        rows = [run_row(spec, model_dir, requests, args) for spec in row_specs(args)]
        reference = rows[0]
        for row in rows:
            row.same_generations = sum(
                a == b for a, b in zip(row.generations, reference.generations, strict=True)
            )
            row.max_dlogprob = max(
                abs(a - b) for a, b in zip(row.logprobs, reference.logprobs, strict=True)
            )
        print_table(rows, reference, args.prompts)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(
                json.dumps({"args": vars(args), "sizes": sizes, "rows": [asdict(r) for r in rows]})
            )
        if args.dtype != "float32":
            return 0
        agree = all(
            row.same_generations == args.prompts and row.max_dlogprob <= LOGPROB_TOL for row in rows
        )
        return 0 if agree else 1
    finally:
        ray.shutdown()
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
