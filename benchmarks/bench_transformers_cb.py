"""transformers' own continuous batching on the varied-length workload, against lm-eval hf.

transformers 5 ships a continuous-batching engine (``model.generate_batch``,
``ContinuousBatchingManager``: a FIFO scheduler over a paged KV cache, every step one packed
``[1, tokens]`` forward of the decoding rows and the prefill chunks that fit the token budget).
lm-eval's hf backend does not use it. This script runs the 360 requests of
:mod:`varied_workload` three ways, in one process, on the same model:

* ``lm-eval hf`` -- ``simple_evaluate`` with lm-eval's hf backend, ``--batch`` rows per batch;
* ``generate_batch sN`` -- ``model.generate_batch`` with at most N requests per step
  (``max_requests_per_batch``), greedy, ``max_new_tokens`` 96. It has no stop strings: every
  request runs to the end-of-sequence token or 96 tokens, and the text is cut afterwards at
  lm-eval's stop strings (``until`` and the EOS text), as lm-eval cuts its own;
* ``manager+cancel sN`` -- the same manager, requests added before its loop starts (so the first
  step sees all of them), each streamed token by token and cancelled as soon as its decoded text
  holds a stop string: stop strings emulated from outside the engine.

Per row: wall seconds of the generation (manager start and stop included), the model's forward
calls (steps), the positions fed to its input embeddings, the tokens generated, the seconds inside
the model's forward, and the overhead per step ((wall - forward) / steps: scheduling, batch
tensors, logits processing, Python); and whether each request's kept text equals lm-eval hf's.
Timings are only meaningful with the machine to itself; the load average is printed.

Usage::

    .venv/bin/python benchmarks/bench_transformers_cb.py --slots 16,64 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import format_table as _table  # noqa: E402
from benchmarks.common import make_task_manager, set_environment  # noqa: E402
from benchmarks.varied_bench import ForwardTimer, InputCounter, run_hf  # noqa: E402
from benchmarks.varied_workload import (  # noqa: E402
    MAX_GEN_TOKS,
    UNTIL,
    VARIED_TASK,
    build_varied_model,
    write_varied_task,
)


@dataclass
class CbFigures:
    """One row of the table."""

    name: str
    wall_s: float = 0.0
    steps: int = 0
    fed: int = 0
    generated: int = 0
    forward_s: float = 0.0
    same: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def overhead_ms(self) -> float:
        return 1000 * (self.wall_s - self.forward_s) / max(1, self.steps)


def kept_text(tokenizer: Any, tokens: list[int]) -> str:
    """The text lm-eval keeps of a generation: decoded, cut at the first of each stop string."""
    text = tokenizer.decode(tokens)
    for stop in [*UNTIL, tokenizer.eos_token]:
        text = text.split(stop)[0]
    return text


def _configs(slots: int, args: argparse.Namespace, model: Any) -> tuple[Any, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=MAX_GEN_TOKS,
        do_sample=False,
        eos_token_id=model.config.eos_token_id,  # unset, the manager disables EOS
        pad_token_id=model.config.pad_token_id,
    )
    # On CPU the cache is otherwise sized from free host memory (90% of it).
    batching = ContinuousBatchingConfig(
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=slots,
        allow_block_sharing=False,
        seed=0,
    )
    return generation, batching


def _load(model_dir: Path) -> tuple[Any, InputCounter, ForwardTimer]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, InputCounter(model), ForwardTimer(model)


def run_generate_batch(model_dir: Path, inputs: list[list[int]], slots: int, args: Any) -> Any:
    """``model.generate_batch``: every request to EOS or 96 tokens, cut afterwards."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, counter, timer = _load(model_dir)
    generation, batching = _configs(slots, args, model)
    started = time.perf_counter()
    outputs = model.generate_batch(
        inputs, generation_config=generation, continuous_batching_config=batching, warmup=False
    )
    figures = CbFigures(f"generate_batch s{slots}", wall_s=time.perf_counter() - started)
    results = list(outputs.values())
    if len(results) != len(inputs):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(inputs)} requests")
    figures.texts = [kept_text(tokenizer, r.generated_tokens) for r in results]
    figures.generated = sum(len(r.generated_tokens) for r in results)
    figures.steps, figures.fed = counter.counts["calls"], counter.counts["fed"]
    figures.forward_s = timer.seconds
    return figures


def run_with_cancel(model_dir: Path, inputs: list[list[int]], slots: int, args: Any) -> Any:
    """The manager with every request streamed and cancelled at its first stop string."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, counter, timer = _load(model_dir)
    generation, batching = _configs(slots, args, model)
    started = time.perf_counter()
    manager = model.init_continuous_batching(generation, batching)
    ids = manager.add_requests(inputs, max_new_tokens=MAX_GEN_TOKS, streaming=True)
    manager.start()
    texts: dict[str, str] = {}
    generated = 0
    deadline = time.monotonic() + args.timeout_s
    try:
        while len(texts) < len(ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(texts)} requests unfinished after the timeout")
            result = manager.get_result(timeout=1)
            if result is None or result.request_id in texts:
                continue
            text = tokenizer.decode(result.generated_tokens)
            stopped = any(stop in text for stop in [*UNTIL, tokenizer.eos_token])
            if stopped or result.is_finished():
                if not result.is_finished():
                    manager.cancel_request(result.request_id)
                texts[result.request_id] = kept_text(tokenizer, result.generated_tokens)
                generated += len(result.generated_tokens)
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    figures = CbFigures(f"manager+cancel s{slots}", wall_s=time.perf_counter() - started)
    figures.texts = [texts[i] for i in ids]
    figures.generated = generated
    figures.steps, figures.fed = counter.counts["calls"], counter.counts["fed"]
    figures.forward_s = timer.seconds
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", default="16,64", help="max_requests_per_batch values (16,64)")
    parser.add_argument("--batch", type=int, default=16, help="lm-eval hf rows per batch (16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, every row (1)")
    parser.add_argument("--max_batch_tokens", type=int, default=512, help="CB token budget/step")
    parser.add_argument("--num_blocks", type=int, default=128, help="CB cache blocks (256 tokens)")
    parser.add_argument("--no_cancel", action="store_true", help="skip the manager+cancel rows")
    parser.add_argument("--timeout_s", type=float, default=900.0, help="per manager run")
    parser.add_argument("--model_dir", default=None, help="build (or reuse) the model here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    args.slots = [int(s) for s in args.slots.split(",") if s.strip()]
    args.cores, args.hf_threads = args.threads, args.threads  # for run_hf
    args.device, args.dtype = "cpu", "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=True)
    import torch
    import transformers
    from lm_eval.tasks import get_task_dict

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-cb-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not (model_dir / "config.json").is_file():
        build_varied_model(model_dir, seed=args.seed)
    task_manager = make_task_manager([VARIED_TASK], str(write_varied_task(work / "tasks")))
    get_task_dict([VARIED_TASK], task_manager)
    hf, _needed = run_hf(model_dir, task_manager, args)
    docs = sorted(hf.answers)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    inputs = [tokenizer(hf.contexts[d], add_special_tokens=False)["input_ids"] for d in docs]
    reference = CbFigures("lm-eval hf", hf.generate_s, hf.calls, hf.fed, 0, hf.forward_s)
    reference.texts = [hf.answers[d] for d in docs]
    rows = [reference]
    for slots in args.slots:
        rows.append(run_generate_batch(model_dir, inputs, slots, args))
        if not args.no_cancel:
            rows.append(run_with_cancel(model_dir, inputs, slots, args))
    table = []
    for row in rows:
        row.same = sum(a == b for a, b in zip(row.texts, reference.texts, strict=True))
        table.append([
            row.name, f"{row.wall_s:.1f}", f"{reference.wall_s / row.wall_s:.2f}x",
            f"{row.steps:,}", f"{row.fed:,}", f"{row.generated:,}" if row.generated else "-",
            f"{row.forward_s:.1f}", f"{row.overhead_ms:.2f}", f"{row.same}/{len(docs)}",
        ])  # fmt: skip
    print(
        f"{VARIED_TASK}: {len(docs)} requests; torch threads {args.threads}; transformers "
        f"{transformers.__version__}; CB max_batch_tokens {args.max_batch_tokens}, "
        f"{args.num_blocks} blocks; load average "
        "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    )
    headers = ["row", "wall s", "vs hf", "steps", "fed", "generated", "forward s",
               "overhead ms/step", "same as hf"]  # fmt: skip
    print(_table(headers, table))
    print("hf wall s: its generate_until call; steps: forward calls; generated: tokens returned")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows]))
    return 0 if all(row.same == len(docs) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
