"""The GPU check: rayeval's GPU path beside lm-eval's own ``hf`` backend, in one short run.

Prepared for the day a GPU machine is lent (docs/performance-notes.md, "GPU check (not yet run on a
GPU)"). It is sized to take a few minutes on one GPU (under 8; estimated, not yet measured)
and does only this:

1. builds a Llama of ~0.8B parameters with random weights (hidden 2048, 16 blocks, the demo
   tokenizer's vocabulary; ``llama_model.build_model``, fp32 on disk, reused from
   ``--model_dir``). The head's EOS row is zeroed so that no greedy answer stops early: every
   answer has exactly ``--new_tokens`` tokens;
2. evaluates ``demo_mc``, ``demo_rolling`` and ``demo_gen_short`` (``--limit`` documents each,
   1-shot) with lm-eval's ``hf`` and with rayeval's ``RayEvalLM`` at 1x1, both bf16 on ``cuda``,
   and compares every logged sample (**parity**, below);
3. times, on the same loaded models, ``loglikelihood`` over ``--prefill_requests`` contexts of
   ``--prefill_len`` tokens (**score tok/s**: input tokens / seconds of the call) and
   ``generate_until`` over ``--prompts`` prompts of 40-100 tokens, greedy (**decode tok/s**:
   generated tokens / seconds of the call; rayeval batches continuously, hf in static batches of
   ``--hf_batch_size``), with each rayeval row's ratio to hf;
4. reports memory and prefill MFU. ``hf max allocated``: ``torch.cuda.max_memory_allocated`` of
   the hf row (in this process; a rank's allocator cannot be read from the driver). ``rank
   allocated``: the most device memory a rank held after a micro-batch (the engine's progress
   reports). ``device peak``: every row, device memory in use (all processes) sampled every 20 ms
   above what was in use when the row began: contexts and allocator caches included. **MFU** =
   2 x parameters outside the input embedding x score tokens / score seconds / peak dense bf16
   FLOP/s (by device name: H100 SXM and H200 989 TFLOP/s, H100 NVL 835, H100 PCIe 756, A100 312;
   else ``--peak_tflops``); attention's own FLOPs are left out, and hf computes the head at every
   position where rayeval computes it where scored, so it is useful work per second;
5. runs 1x2 (the default strategy: tensor parallelism for Llama, over NCCL) and 2x1 where there
   are two GPUs or more, else prints a line saying they were skipped;
6. writes every figure as JSON (``--json``; default ``$OUT/gpu-check.json`` where ``OUT`` is set,
   else ``.rayeval/gpu-check.json``) and exits with status 1 when parity fails.

**Parity** (DESIGN invariant 1): every sample's prompt, greedy flag and generated text and every
metric equal hf's, and every log-probability within tolerance: on the CPU bit for bit; on a GPU
within ``--logprob_rtol`` x |value| or ``--logprob_atol`` (default 0.02 and 0.05: a few bf16
steps, since hf and rayeval batch differently and CUDA picks kernels by shape), the largest
difference measured and reported; perplexities (as their logarithm) and bits per byte, which
are functions of the summed log-probabilities, within ``--logprob_rtol`` too. Random weights make
near ties: a greedy token or a choice that flips is listed with its sample, for a person to
judge. Rows of two or more GPUs must also equal 1x1 bit for bit (invariant 2). A row that fails
to run is recorded with its error and fails the check.

``--tiny`` runs the same steps on the CPU with a tiny model in well under a minute (what
tests/test_gpu_check.py runs, so the script cannot rot). Without the CUDA build of torch the
script says how to install it and exits with status 2.

Usage::

    make gpu-check                                           # = the line below
    .venv/bin/python benchmarks/gpu_check.py                 # one GPU or more
    .venv/bin/python benchmarks/gpu_check.py --tiny --json /tmp/gpu-check.json   # CPU
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
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.agreement import leaves  # noqa: E402
from benchmarks.bench_generate import build_requests  # noqa: E402
from benchmarks.common import (  # noqa: E402
    format_table,
    make_task_manager,
    parse_layout,
    set_environment,
)
from benchmarks.engine_runs import evaluate  # noqa: E402
from benchmarks.llama_model import build_model  # noqa: E402

MIB = 2**20
TASKS = ["demo_mc", "demo_rolling", "demo_gen_short"]
HF = "lm-eval hf"
INSTALL_CUDA_TORCH = (
    ".venv/bin/pip install torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
)
#: Metrics that are continuous functions of log-probabilities: within the log-prob tolerance.
#: Every other metric (acc, acc_norm, exact_match, ...) must be equal.
CONTINUOUS_METRICS = ("perplexity", "bits_per_byte")
#: Dense bf16 TFLOP/s by device name (NVIDIA datasheets); the first name contained wins.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
#: The GPU run's sizes, and --tiny's; a flag given on the command line wins.
SIZES = {
    "gpu": {"hidden": 2048, "intermediate": 5632, "layers": 16, "heads": 16, "limit": 20,
            "prompts": 128, "new_tokens": 128, "prefill_requests": 256, "prefill_len": 512,
            "hf_batch_size": 64},
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "limit": 4,
             "prompts": 8, "new_tokens": 16, "prefill_requests": 16, "prefill_len": 64,
             "hf_batch_size": 8},
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the size preset's values where a flag was not given."""
    parser = argparse.ArgumentParser(description="rayeval's GPU path beside lm-eval hf.")
    add = parser.add_argument
    add("--tiny", action="store_true", help="tiny model and workload, on the CPU unless --device")
    add("--device", choices=("cpu", "cuda"), default=None, help="cuda (cpu with --tiny)")
    add("--dtype", default="bfloat16", help="model dtype of every row (bfloat16)")
    add("--layouts", default="1x1,1x2,2x1", help="rayeval layouts RxG; beyond the GPUs: skipped")
    add("--model_dir", default=None, help="build the model here, or reuse the one built there")
    add("--json", dest="json_out", default=None, help="the report (default $OUT or .rayeval)")
    add("--peak_tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (MFU)")
    add("--logprob_rtol", type=float, default=None, help="parity: 0.02 on cuda, 0 on cpu")
    add("--logprob_atol", type=float, default=None, help="parity: 0.05 on cuda, 0 on cpu")
    add("--num_fewshot", type=int, default=1, help="few-shot examples of the parity tasks (1)")
    add("--max_batch_tokens", type=int, default=None, help="rayeval's budget (engine default)")
    add("--vocab", type=int, default=None, help="vocabulary (default: the demo tokenizer's)")
    for name, value in SIZES["gpu"].items():
        add(f"--{name}", type=int, default=None, help=f"{value} (--tiny: {SIZES['tiny'][name]})")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    for name, value in SIZES["tiny" if args.tiny else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    bounded = args.device == "cuda"  # on the CPU, bf16 answers are bit-identical (DESIGN)
    if args.logprob_rtol is None:
        args.logprob_rtol = 0.02 if bounded else 0.0
    if args.logprob_atol is None:
        args.logprob_atol = 0.05 if bounded else 0.0
    try:
        args.layouts = [parse_layout(item) for item in args.layouts.split(",") if item.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    args.tasks = list(TASKS)
    return args


def check_device(args: argparse.Namespace) -> None:
    """Exit with status 2, naming the install command, where ``cuda`` is asked of a CPU torch."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write(
            f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU here). "
            f"Install the CUDA build of torch:\n  {INSTALL_CUDA_TORCH}\nor run on the CPU with "
            "--tiny.\n"
        )
        raise SystemExit(2)


def default_json_path() -> Path:
    """``$OUT/gpu-check.json`` where ``OUT`` is set (the device machine's folder), else under
    ``.rayeval``."""
    out = os.environ.get("OUT")
    return Path(out) / "gpu-check.json" if out else REPO_ROOT / ".rayeval" / "gpu-check.json"


# ----------------------------------------------------------------------------- the model
def prepare_model(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """Build the random-weight Llama (or reuse a finished build); its directory and figures."""
    from rayeval.service.demo import ensure_demo_assets

    tokenizer_dir = ensure_demo_assets().model_dir
    args.vocab = args.vocab or _vocab_of(tokenizer_dir)
    shape = f"h{args.hidden}-i{args.intermediate}-l{args.layers}-n{args.heads}-v{args.vocab}"
    model_dir = Path(args.model_dir or REPO_ROOT / ".rayeval" / "gpu-check" / f"model-{shape}")
    done = model_dir / ".complete"
    if args.model_dir and (model_dir / "config.json").is_file() and not done.is_file():
        raise SystemExit(
            f"{model_dir} holds a model this script did not finish building (no .complete): "
            "remove it or give another --model_dir"
        )
    started = time.perf_counter()
    if not done.is_file() or done.read_text() != shape:
        done.unlink(missing_ok=True)
        build_model(model_dir, args, tokenizer_dir)
        _zero_eos_row(model_dir)
        done.write_text(shape)
    figures = {"dir": str(model_dir), "build_s": time.perf_counter() - started}
    return model_dir, figures | _parameter_counts(model_dir)


def _vocab_of(tokenizer_dir: Path) -> int:
    import transformers

    return len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))


def _zero_eos_row(model_dir: Path) -> None:
    """Zero the EOS row of the (untied) head, in place: its logit is then 0 while the others
    scatter around 0, so greedy decoding never picks it and every answer runs to max_gen_toks
    (with random weights about one step in ``vocab`` would otherwise end an answer)."""
    import transformers

    eos = transformers.AutoConfig.from_pretrained(model_dir).eos_token_id
    index = model_dir / "model.safetensors.index.json"
    name = "model.safetensors"
    if index.is_file():
        name = json.loads(index.read_text())["weight_map"]["lm_head.weight"]
    with (model_dir / name).open("r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))["lm_head.weight"]
        assert entry["dtype"] == "F32", entry  # build_model saves float32
        row_bytes = entry["shape"][1] * 4
        f.seek(8 + header_len + entry["data_offsets"][0] + eos * row_bytes)
        f.write(bytes(row_bytes))


def _parameter_counts(model_dir: Path) -> dict[str, int]:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {
        "parameters": total,
        "flop_parameters": total - embedding,  # the input embedding is a lookup, not a product
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
    }


# ----------------------------------------------------------------------------- the workload
@dataclass
class Workload:
    """The timed requests, the same for every row, and their token counts."""

    score: list[Any]
    generate: list[Any]
    score_tokens: int
    decode_tokens: int


def build_workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    """bench_generate.py's requests; score tokens as lm-eval feeds them (context + continuation
    but the last token), decode tokens exactly prompts x new tokens (no answer stops early)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    generate, score = build_requests(tokenizer, args)
    fed = sum(
        len(tokenizer(context + continuation, add_special_tokens=False)["input_ids"]) - 1
        for context, continuation in (request.args for request in score)
    )
    return Workload(score, generate, fed, args.prompts * args.new_tokens)


# ----------------------------------------------------------------------------- memory
class DeviceMemory:
    """Device memory in use (``torch.cuda.mem_get_info``: every process) sampled by a thread,
    per device, above what was in use when sampling began. Nothing on the CPU."""

    def __init__(self, devices: int, interval_s: float = 0.02) -> None:
        self._devices = range(devices)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._base = [self._used(d) for d in self._devices]
        self._peak = list(self._base)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _used(device: int) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            for d in self._devices:
                self._peak[d] = max(self._peak[d], self._used(d))

    def stop(self) -> list[float]:
        """Peak MiB above the start, per device."""
        self._stop.set()
        self._thread.join()
        return [(peak - base) / MIB for peak, base in zip(self._peak, self._base, strict=True)]


# ----------------------------------------------------------------------------- rows
@dataclass
class Context:
    """What every row shares."""

    args: argparse.Namespace
    task_manager: Any
    workload: Workload
    gpus: int


@dataclass
class Row:
    """One way of running the model, and what it measured."""

    name: str
    layout: str | None = None
    load_s: float = 0.0
    parity_eval_s: float = 0.0
    score_s: float = 0.0
    decode_s: float = 0.0
    score_tok_s: float | None = None
    decode_tok_s: float | None = None
    prefill_mfu: float | None = None
    memory_mib: dict[str, Any] = field(default_factory=dict)
    load_reports: list[dict[str, Any]] | None = None
    engine_stats: dict[str, Any] | None = None
    error: str | None = None
    results: dict[str, Any] | None = field(default=None, repr=False)
    answers: dict[str, list[Any]] = field(default_factory=dict, repr=False)


#: Loads a row's LM; returns it and what releases it (and reads the row's last figures).
Opener = Callable[[], tuple[Any, Callable[[], None]]]


def open_hf(row: Row, model_dir: Path, args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    """lm-eval's hf backend in this process, as ``simple_evaluate(model="hf", ...)`` makes it."""
    import torch
    from lm_eval.api.registry import get_model

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lm = get_model("hf").create_from_arg_obj(
        {"pretrained": str(model_dir), "dtype": args.dtype},
        {"batch_size": args.hf_batch_size, "max_batch_size": None, "device": args.device},
    )

    def close() -> None:  # run_row has dropped the LM: its weights go here
        if args.device == "cuda":
            row.memory_mib["hf_max_allocated"] = torch.cuda.max_memory_allocated() / MIB
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    return lm, close


def open_rayeval(
    row: Row, model_dir: Path, args: argparse.Namespace, layout: tuple[int, int]
) -> tuple[Any, Callable[[], None]]:
    """rayeval's LM at ``layout``; its ranks' device memory after each reported step is kept."""
    from rayeval.service.engine.lm import RayEvalLM

    held: list[float] = []

    def on_progress(progress: Any) -> None:
        held.extend(r.device_mib for ranks in progress.rank_memory.values() for r in ranks)

    lm = RayEvalLM(
        pretrained=str(model_dir),
        num_replicas=layout[0],
        shard_size=layout[1],
        batch_size="auto",
        max_batch_tokens=args.max_batch_tokens,
        device=args.device,
        dtype=args.dtype,
        on_progress=on_progress,
    )
    try:
        row.load_reports = [asdict(r) for r in lm.engine.load_reports]  # waits for every rank
    except BaseException:
        lm.close()  # the next row needs these GPUs
        raise

    def close() -> None:
        row.engine_stats = {phase: stats.report() for phase, stats in lm.engine.stats.items()}
        if held and args.device == "cuda":
            row.memory_mib["rank_allocated"] = max(held)
        lm.close()

    return lm, close


def run_row(row: Row, opener: Opener, ctx: Context) -> Row:
    """Load, evaluate the parity tasks, time the workload, release; an error is recorded."""
    print(f"running {row.name} ...", file=sys.stderr, flush=True)
    sampler = DeviceMemory(ctx.gpus) if ctx.args.device == "cuda" else None
    lm: Any = None
    close: Callable[[], None] | None = None
    try:
        started = time.perf_counter()
        lm, close = opener()
        row.load_s = time.perf_counter() - started
        _measure(row, lm, ctx)
    except Exception:
        _failed(row)
    finally:
        lm = None  # hf: the last reference, so that close() frees the weights
        try:
            if close is not None:
                close()
        except Exception:
            _failed(row)
        if sampler is not None:
            row.memory_mib["device_peak"] = sampler.stop()
    return row


def _measure(row: Row, lm: Any, ctx: Context) -> None:
    started = time.perf_counter()
    row.results = evaluate(lm, ctx.args, ctx.task_manager)
    row.parity_eval_s = time.perf_counter() - started
    started = time.perf_counter()
    scores = lm.loglikelihood(ctx.workload.score, disable_tqdm=True)
    row.score_s = time.perf_counter() - started
    started = time.perf_counter()
    row.answers["generate"] = lm.generate_until(ctx.workload.generate, disable_tqdm=True)
    row.decode_s = time.perf_counter() - started
    row.answers["score"] = [logprob for logprob, _ in scores]


def _failed(row: Row) -> None:
    error = traceback.format_exc(limit=-8)
    row.error = f"{row.error}\n{error}" if row.error else error
    print(f"{row.name} FAILED:\n{error}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- parity
@dataclass
class Parity:
    """How one row's results compare with a reference row's."""

    against: str
    rtol: float
    atol: float
    samples: int = 0
    logprobs: int = 0
    logprobs_differing: int = 0
    beyond_tolerance: int = 0
    max_abs_dlogprob: float = 0.0
    max_rel_dlogprob: float = 0.0
    discrete_diffs: int = 0
    metric_diffs: dict[str, list[float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        failures = self.beyond_tolerance + self.discrete_diffs + len(self.metric_diffs)
        return self.samples > 0 and failures == 0 and not self.problems

    def add(self, a: Any, b: Any, where: str) -> None:
        """One leaf of a response: a log-probability, or a flag or text that must be equal."""
        if isinstance(a, float) and isinstance(b, float):
            self.logprobs += 1
            diff, size = abs(a - b), max(abs(a), abs(b))
            self.logprobs_differing += diff != 0
            self.max_abs_dlogprob = max(self.max_abs_dlogprob, diff)
            self.max_rel_dlogprob = max(self.max_rel_dlogprob, diff / size if diff else 0.0)
            if diff > max(self.atol, self.rtol * size):
                self.beyond_tolerance += 1
                self._example(f"{where}: log-prob {a!r} vs {b!r}")
        elif a != b:
            self.differ(where, a, b)

    def differ(self, where: str, a: Any, b: Any) -> None:
        """A flag, text or per-sample metric (acc, exact_match) that differs."""
        self.discrete_diffs += 1
        self._example(f"{where}: {a!r} vs {b!r}")

    def _example(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)


def compare(reference: Row, row: Row, rtol: float, atol: float) -> Parity:
    """Every logged sample and every metric of ``row`` against ``reference``."""
    parity = Parity(reference.name, rtol, atol)
    if reference.results is None or row.results is None:
        parity.problems.append("no results (the row failed)")
        return parity
    _compare_samples(parity, reference.results["samples"], row.results["samples"])
    _compare_metrics(parity, reference.results, row.results)
    return parity


def _compare_samples(parity: Parity, reference: dict[str, Any], ours: dict[str, Any]) -> None:
    if set(reference) != set(ours):
        parity.problems.append(f"task sets differ: {sorted(set(reference) ^ set(ours))}")
    for task in sorted(set(reference) & set(ours)):
        by_doc = {sample["doc_id"]: sample for sample in ours[task]}
        for sample in reference[task]:
            where = f"{task}/{sample['doc_id']}"
            other = by_doc.get(sample["doc_id"])
            if other is None or other["arguments"] != sample["arguments"]:
                parity.problems.append(f"{where}: {'missing' if other is None else 'prompts'}")
                continue
            parity.samples += 1
            for a, b in leaves(sample["resps"], other["resps"]):
                parity.add(a, b, where)
            for metric in sample.get("metrics", []):  # a flipped choice shows here
                continuous = any(name in metric for name in CONTINUOUS_METRICS)
                if not continuous and sample.get(metric) != other.get(metric):
                    parity.differ(f"{where} {metric}", sample.get(metric), other.get(metric))


def _compare_metrics(parity: Parity, reference: dict[str, Any], ours: dict[str, Any]) -> None:
    for section in ("results", "groups"):
        for name, metrics in reference.get(section, {}).items():
            for key, value in metrics.items():
                if "_stderr" in key or isinstance(value, bool | str) or value is None:
                    continue
                other = ours.get(section, {}).get(name, {}).get(key)
                if not isinstance(other, int | float) or isinstance(other, bool):
                    parity.problems.append(f"{section}/{name}/{key} missing")
                elif not _metric_close(key, value, other, parity.rtol):
                    parity.metric_diffs[f"{name}/{key}"] = [value, other]


def _metric_close(key: str, a: float, b: float, rtol: float) -> bool:
    """Equal; or, for a metric that is a continuous function of log-probabilities, within
    ``rtol`` (a perplexity as its logarithm, which is linear in the summed log-probabilities)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if not any(name in key for name in CONTINUOUS_METRICS):
        return False
    if "perplexity" in key and a > 0 and b > 0:
        a, b = math.log(a), math.log(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def workload_agreement(reference: Row, row: Row) -> dict[str, Any]:
    """The timed requests' answers against the reference's (reported, not part of the verdict)."""
    ours, theirs = row.answers, reference.answers
    if "generate" not in ours or "generate" not in theirs:
        return {}
    same = sum(a == b for a, b in zip(ours["generate"], theirs["generate"], strict=True))
    deltas = [abs(a - b) for a, b in zip(ours["score"], theirs["score"], strict=True)]
    return {
        "same_generations": f"{same}/{len(theirs['generate'])}",
        "max_abs_dlogprob": max(deltas, default=0.0),
    }


# ----------------------------------------------------------------------------- figures
def peak_tflops(args: argparse.Namespace, device_name: str) -> float | None:
    """``--peak_tflops``, else the table's figure for the device's name, else None."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    return next((tf for name, tf in PEAK_BF16_TFLOPS if name in device_name), None)


def add_rates(row: Row, workload: Workload, flop_parameters: int, peak: float | None) -> None:
    """Score and decode tokens/s, and prefill MFU where the peak FLOP/s is known."""
    if row.score_s > 0:
        row.score_tok_s = workload.score_tokens / row.score_s
        if peak:
            row.prefill_mfu = 2 * flop_parameters * row.score_tok_s / (peak * 1e12)
    if row.decode_s > 0:
        row.decode_tok_s = workload.decode_tokens / row.decode_s


def ratios(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Each rayeval row's score and decode tokens/s over the hf row's (above 1: faster)."""
    hf = rows[0]

    def over(ours: float | None, theirs: float | None) -> float | None:
        return ours / theirs if ours and theirs else None

    return {
        row.name: {
            "score": over(row.score_tok_s, hf.score_tok_s),
            "decode": over(row.decode_tok_s, hf.decode_tok_s),
        }
        for row in rows[1:]
    }


def describe_machine(args: argparse.Namespace) -> dict[str, Any]:
    """The device (name, count), its peak bf16 TFLOP/s and the versions that matter."""
    import lm_eval
    import ray
    import torch
    import transformers

    cuda = args.device == "cuda"
    count = torch.cuda.device_count() if cuda else 0
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or 'cpu'})"
    return {
        "device": {"name": name, "count": count, "kind": args.device, "cpu_cores": os.cpu_count()},
        "peak_bf16_tflops": peak_tflops(args, name) if cuda else args.peak_tflops,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__,
            "ray": ray.__version__,
            "python": platform.python_version(),
        },
    }


# ----------------------------------------------------------------------------- the run
def runnable_layouts(
    args: argparse.Namespace, gpus: int
) -> tuple[list[tuple[int, int]], list[str]]:
    """The layouts this machine can run, and a line for each it cannot."""
    capacity = gpus if args.device == "cuda" else 1
    kept, skipped = [], []
    for replicas, shards in args.layouts:
        if replicas * shards <= capacity:
            kept.append((replicas, shards))
        else:
            where = f"{gpus} GPU(s) here" if args.device == "cuda" else "the CPU run checks 1x1"
            skipped.append(f"{replicas}x{shards} skipped: needs {replicas * shards} GPUs, {where}")
    return kept, skipped


def run_rows(ctx: Context, model_dir: Path, layouts: list[tuple[int, int]]) -> list[Row]:
    """The hf row, then every rayeval layout, on one local Ray."""
    import ray

    args = ctx.args
    gpus = {"num_gpus": ctx.gpus} if args.device == "cuda" else {}
    largest = max((r * g for r, g in layouts), default=1)
    ray.init(
        num_cpus=max(os.cpu_count() or 1, largest),
        include_dashboard=False,
        log_to_driver=False,
        **gpus,
    )
    try:
        hf = Row(HF)
        rows = [run_row(hf, partial(open_hf, hf, model_dir, args), ctx)]
        for layout in layouts:
            row = Row(f"rayeval {layout[0]}x{layout[1]}", f"{layout[0]}x{layout[1]}")
            rows.append(run_row(row, partial(open_rayeval, row, model_dir, args, layout), ctx))
    finally:
        ray.shutdown()
    return rows


def check_parity(rows: list[Row], args: argparse.Namespace) -> dict[str, Parity]:
    """Every rayeval row against hf (within tolerance); rows beyond one GPU also against 1x1,
    bit for bit."""
    hf = rows[0]
    checks = {row.name: compare(hf, row, args.logprob_rtol, args.logprob_atol) for row in rows[1:]}
    one = next((row for row in rows if row.layout == "1x1"), None)
    for row in rows[1:]:
        if one is not None and row is not one:
            checks[f"{row.name} vs 1x1"] = compare(one, row, 0.0, 0.0)
    return checks


def _cells(row: Row, rate: dict[str, float | None]) -> list[str]:
    """One row of the summary table."""

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return [
        row.name,
        f"{row.load_s:.1f}",
        f"{row.parity_eval_s:.1f}",
        number(row.score_tok_s, ",.0f"),
        number(rate.get("score"), ".2f"),
        number(row.decode_tok_s, ",.1f"),
        number(rate.get("decode"), ".2f"),
        number(row.prefill_mfu, ".1%"),
        "/".join(f"{mib:,.0f}" for mib in row.memory_mib.get("device_peak", [])) or "-",
        "FAILED" if row.error else "-",
    ]


def print_summary(rows: list[Row], checks: dict[str, Parity], skipped: list[str]) -> None:
    """The rows side by side, the layouts skipped, and each parity check with its first
    differences."""
    headers = ["row", "load s", "eval s", "score tok/s", "vs hf", "decode tok/s", "vs hf",
               "MFU", "device peak MiB", "error"]  # fmt: skip
    rates = [{}, *ratios(rows).values()]
    print(format_table(headers, [_cells(r, rate) for r, rate in zip(rows, rates, strict=True)]))
    print("vs hf: this row's tokens/s over the hf row's (above 1: rayeval is faster)")
    for line in skipped:
        print(line)
    for name, parity in checks.items():
        print(
            f"parity {name} against {parity.against}: {'PASS' if parity.passed else 'FAIL'} "
            f"({parity.samples} samples, {parity.logprobs_differing}/{parity.logprobs} log-probs "
            f"differ, max |d| {parity.max_abs_dlogprob:.3g} (relative "
            f"{parity.max_rel_dlogprob:.3g}), {parity.discrete_diffs} flags/texts/sample metrics "
            f"differ, metrics differ: {sorted(parity.metric_diffs) or 'none'})"
        )
        for text in parity.problems[:5] + parity.examples:
            print(f"    {text}")


def report(
    ctx: Context,
    machine: dict[str, Any],
    model: dict[str, Any],
    rows: list[Row],
    checks: dict[str, Parity],
) -> dict[str, Any]:
    """Every figure, as the JSON report holds it (``passed``, ``seconds`` are added by main)."""
    args = ctx.args
    sizes = ("prompts", "new_tokens", "prefill_requests", "prefill_len", "hf_batch_size")
    return {
        **machine,
        "model": model,
        "dtype": args.dtype,
        "tasks": {"names": args.tasks, "limit": args.limit, "num_fewshot": args.num_fewshot},
        "workload": {name: getattr(args, name) for name in sizes}
        | {"score_tokens": ctx.workload.score_tokens, "decode_tokens": ctx.workload.decode_tokens},
        "rows": [
            {k: v for k, v in vars(row).items() if k not in ("results", "answers")}
            | {"workload_agreement": workload_agreement(rows[0], row) if i else {}}
            for i, row in enumerate(rows)
        ],
        "ratios": ratios(rows),
        "parity": {name: asdict(p) | {"passed": p.passed} for name, p in checks.items()},
        "argv": sys.argv,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when parity holds, 1 when it does not (2: no CUDA where asked)."""
    started = time.perf_counter()
    args = parse_args(argv)
    set_environment(local_ray=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    check_device(args)
    from rayeval.service.demo import ensure_demo_assets

    machine = describe_machine(args)
    model_dir, model = prepare_model(args)
    task_manager = make_task_manager(args.tasks, str(ensure_demo_assets().tasks_dir))
    gpus = machine["device"]["count"]
    ctx = Context(args, task_manager, build_workload(model_dir, args), gpus)
    layouts, skipped = runnable_layouts(args, gpus)
    rows = run_rows(ctx, model_dir, layouts)
    for row in rows:
        add_rates(row, ctx.workload, model["flop_parameters"], machine["peak_bf16_tflops"])
    checks = check_parity(rows, args)
    print_summary(rows, checks, skipped)
    passed = bool(checks) and all(p.passed for p in checks.values())
    passed = passed and not any(row.error for row in rows)
    figures = {"passed": passed, **report(ctx, machine, model, rows, checks), "skipped": skipped}
    figures["seconds"] = time.perf_counter() - started
    out = Path(args.json_out) if args.json_out else default_json_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(f"\nGPU check {'PASSED' if passed else 'FAILED'} in {figures['seconds']:.0f} s: {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
