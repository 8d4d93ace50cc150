"""The GPU check's phases and their steps (``benchmarks/gpu_check.py`` runs each phase in its own
process; this module is what that process runs).

Each step writes one JSON line to the report and flushes it before the next begins, under its
own timeout: a step that overruns writes ``{"step": ..., "error": "timeout after N s"}`` and ends
its phase's process (a hang in CUDA or in a Ray wait cannot be interrupted otherwise); the check
goes on with the next phase. What a later phase needs (the model, lm-eval hf's reference rows,
hf's speed) is kept in the check's state folder.

Only the standard library is imported here at module level: the ``env`` phase must report a
missing or unusable package as a line, not die importing it.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
TASKS = ["demo_mc", "demo_rolling", "demo_gen_short"]
#: The exit status of a phase whose step overran its timeout.
TIMEOUT_EXIT = 124
#: The packages whose version the project pins (pyproject.toml) and the lent machine brings.
MACHINE_PACKAGES = ("torch", "transformers", "accelerate", "peft", "tokenizers", "safetensors")
#: What the pack brings (benchmarks/gpu_pack.py); missing here means it was not installed.
PACKED_IMPORTS = {
    "ray": "ray",
    "lm_eval": "lm-eval",
    "datasets": "datasets",
    "pydantic": "pydantic",
}
#: Dense bf16 TFLOP/s by device name (NVIDIA datasheets); the first name contained wins.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)


# ----------------------------------------------------------------------------- the report
class Report:
    """The JSON-lines report: one line per measurement, written and flushed as it goes."""

    def __init__(self, path: Path, phase: str, started: float) -> None:
        self.path = path
        self.phase = phase
        self.started = started  # time.time() when the check began
        self._lock = threading.Lock()

    def emit(self, step: str, **fields: Any) -> dict[str, Any]:
        """Append ``{"step": step, "phase": ..., "elapsed_s": ..., **fields}`` and flush."""
        line = {
            "step": step,
            "phase": self.phase,
            "elapsed_s": round(time.time() - self.started, 2),
            **fields,
        }
        text = json.dumps(line, default=str)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[{line['elapsed_s']:7.1f} s] {step}: {_summary(line)}", flush=True)
        return line


def _summary(line: dict[str, Any]) -> str:
    if "error" in line:
        return f"ERROR {str(line['error']).splitlines()[0][:300]}"
    keys = (
        "passed",
        "usable",
        "parameters",
        "vocab",
        "score_tok_s",
        "decode_tok_s",
        "max_abs_dlogprob",
        "prefill_mfu",
        "device_peak_mib",
        "seconds",
    )
    return ", ".join(f"{k}={line[k]}" for k in keys if k in line) or "done"


@dataclass
class Phase:
    """What the steps of one phase share."""

    args: argparse.Namespace
    report: Report
    state: Path
    held: dict[str, Any] = field(default_factory=dict)  # what one step hands to the next

    def read(self, name: str) -> Any:
        """A state file an earlier phase wrote.

        Raises:
            RuntimeError: it is not there (the step that writes it failed or did not run).
        """
        path = self.state / f"{name}.json"
        if not path.is_file():
            raise RuntimeError(f"{path.name} is missing: the step that writes it failed")
        return json.loads(path.read_text())

    def write(self, name: str, value: Any) -> None:
        """A state file for a later phase (plain JSON)."""
        (self.state / f"{name}.json").write_text(json.dumps(value, default=str))


def run_step(phase: Phase, name: str, timeout_s: float, step: Callable[[], dict[str, Any]]) -> bool:
    """Run ``step`` under a watchdog and write its line (its figures, or its error).

    On timeout the watchdog writes the timeout line, dumps every thread's stack to stderr and
    ends this process with :data:`TIMEOUT_EXIT` (the check goes on with its next phase).

    Returns:
        Whether the step succeeded.
    """
    timeout_s *= phase.args.timeout_scale
    if phase.args.hang == name:  # rehearses a hang (tests/test_gpu_check.py)
        timeout_s, step = phase.args.hang_timeout_s, _hang
    started = time.perf_counter()
    finished = threading.Event()
    lock = threading.Lock()

    def expire() -> None:
        with lock:
            if finished.is_set():
                return
            finished.set()
            phase.report.emit(name, error=f"timeout after {timeout_s:.0f} s")
        faulthandler.dump_traceback(file=sys.stderr)
        os._exit(TIMEOUT_EXIT)

    watchdog = threading.Timer(timeout_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        fields = step()
        error = None
    except Exception as exc:
        fields, error = {}, f"{type(exc).__name__}: {exc}"
        trace = traceback.format_exc(limit=-6)
        print(trace, file=sys.stderr, flush=True)
    finally:
        watchdog.cancel()
    with lock:
        if finished.is_set():  # the watchdog won the race
            return False
        finished.set()
        seconds = round(time.perf_counter() - started, 3)
        if error is not None:
            phase.report.emit(name, error=error, traceback=trace[-3000:], seconds=seconds)
            return False
        phase.report.emit(name, seconds=seconds, **fields)
        return True


def _hang() -> dict[str, Any]:
    threading.Event().wait()
    return {}


def skip(phase: Phase, names: list[str], why: str) -> None:
    """Lines for steps that cannot run (counted as failures by the verdict)."""
    for name in names:
        phase.report.emit(name, error=f"not run: {why}")


# ----------------------------------------------------------------------------- env
def env_step(args: argparse.Namespace) -> dict[str, Any]:
    """The machine's versions first, then the device and whether the project can use them."""
    import importlib.metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in MACHINE_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    problems = _pin_problems(versions)
    fields: dict[str, Any] = {"versions": versions}
    if versions["torch"]:
        fields["device"] = _device(args, problems)
        import torch

        versions["cuda"] = torch.version.cuda
    fields["paths"] = paths = {}
    for module, dist in PACKED_IMPORTS.items():
        try:
            imported = __import__(module)
            versions[dist], paths[dist] = imported.__version__, imported.__file__
        except Exception as exc:
            versions[dist] = None
            problems.append(
                f"{dist} cannot be imported ({exc}): install the pack "
                "(python3 benchmarks/gpu_pack.py install; docs/performance.md)"
            )
    if not problems:
        fields["private_api_warnings"] = _private_apis(problems)
    return fields | {"usable": not problems, "problems": problems}


def _pin_problems(versions: dict[str, str | None]) -> list[str]:
    """The machine's packages against pyproject.toml's ranges."""
    import tomllib

    from packaging.requirements import Requirement

    pins = {}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        requirement = Requirement(text)
        pins[requirement.name] = requirement.specifier
    problems = []
    for name in MACHINE_PACKAGES:
        version, wanted = versions.get(name), pins.get(name)
        if version is None:
            problems.append(f"{name} is not installed")
        elif wanted is not None and not wanted.contains(version, prereleases=True):
            problems.append(f"{name} {version} is outside the project's range {name}{wanted}")
    return problems


def _device(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    import torch

    if args.device != "cuda":
        return {"kind": "cpu", "name": platform.processor() or "cpu", "cpu_cores": os.cpu_count()}
    if not torch.cuda.is_available():
        problems.append(f"no_cuda: torch {torch.__version__} sees no CUDA device")
        return {"kind": "cuda", "count": 0}
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(
            {
                "name": torch.cuda.get_device_name(index),
                "free_mib": round(free / MIB),
                "total_mib": round(total / MIB),
            }
        )
    return {"kind": "cuda", "count": len(gpus), "gpus": gpus, "cpu_cores": os.cpu_count()}


def _private_apis(problems: list[str]) -> list[str]:
    from rayeval.actors.errors import ConfigError
    from rayeval.service.private_apis import check_private_apis

    try:
        return check_private_apis()
    except ConfigError as exc:
        problems.append(f"private APIs rayeval needs have moved: {exc}")
        return []


def phase_env(phase: Phase) -> None:
    """One line: versions, device and free memory, and whether the project can use them."""
    run_step(phase, "env", 60, lambda: env_step(phase.args))


# ----------------------------------------------------------------------------- the model
def model_shape(args: argparse.Namespace) -> str:
    return f"h{args.hidden}-i{args.intermediate}-l{args.layers}-n{args.heads}-v{args.vocab}"


def build_tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab`` tokens, trained on the demo corpus and a
    deterministic stream of pseudo-words (the corpus alone gives a few hundred merges)."""
    import random

    from rayeval.service.demo.tiny_model import load_corpus, train_tokenizer

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def words() -> str:
        return " ".join(
            "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(200)
        )

    lines = max(vocab // 10, 50)  # 3,200 lines of 200 words reach 32,768 tokens
    tokenizer = train_tokenizer(load_corpus() + [words() for _ in range(lines)], vocab)
    tokenizer.model_max_length = 2048
    return tokenizer


def build_model(args: argparse.Namespace, model_dir: Path) -> None:
    """A Llama with random weights from a config (no hub), saved in float32; the head's EOS row
    is zeroed so that no greedy answer stops early (its logit is then 0 while the others
    scatter around 0)."""
    import torch
    import transformers

    tokenizer = build_tokenizer(args.vocab)
    if len(tokenizer) != args.vocab:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, not {args.vocab}")
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    device = "cuda" if args.device == "cuda" else "cpu"  # random init is faster on the GPU
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def parameter_counts(model_dir: Path) -> dict[str, int]:
    """Parameters, those outside the input embedding (MFU's), hidden, layers, vocabulary."""
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


def model_step(phase: Phase) -> dict[str, Any]:
    """Build the model and the tasks (or reuse a finished build); its figures."""
    from rayeval.service.demo.tasks import write_demo_tasks

    args = phase.args
    model_dir = Path(args.work_dir) / f"model-{model_shape(args)}"
    done = model_dir / ".complete"
    reused = done.is_file() and done.read_text() == model_shape(args)
    if not reused:
        done.unlink(missing_ok=True)
        build_model(args, model_dir)
        done.write_text(model_shape(args))
    tasks_dir = write_demo_tasks(Path(args.work_dir) / "tasks")
    figures = {"dir": str(model_dir), "tasks_dir": str(tasks_dir), **parameter_counts(model_dir)}
    phase.write("model", figures)
    return figures | {"reused": reused}


def phase_model(phase: Phase) -> None:
    run_step(phase, "model", 90, lambda: model_step(phase))


# ----------------------------------------------------------------------------- rows
def task_manager(model: dict[str, Any]) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, include_path=model["tasks_dir"])


def evaluate(lm: Any, args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    """The parity tasks through ``lm_eval.simple_evaluate``, samples logged; kept as plain JSON
    (what a later phase reads back), so that every row is compared after the same round trip.
    """
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        bootstrap_iters=0,
        log_samples=True,
        task_manager=task_manager(model),
        device=args.device,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    kept = {key: results[key] for key in ("results", "groups", "samples") if key in results}
    return json.loads(json.dumps(kept, default=str))


def open_hf(args: argparse.Namespace, model: dict[str, Any], dtype: str, batch: int) -> Any:
    """lm-eval's hf backend in this process, as ``simple_evaluate(model="hf", ...)`` makes it."""
    from lm_eval.api.registry import get_model

    return get_model("hf").create_from_arg_obj(
        {"pretrained": model["dir"], "dtype": dtype},
        {"batch_size": batch, "max_batch_size": None, "device": args.device},
    )


def release(args: argparse.Namespace) -> None:
    """Free what the last LM held (its last reference must be gone)."""
    gc.collect()
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()


def hf_row_step(phase: Phase, name: str, dtype: str, batch: int) -> dict[str, Any]:
    """One lm-eval hf reference row: evaluated, kept in the state folder."""
    model = phase.read("model")
    started = time.perf_counter()
    lm = open_hf(phase.args, model, dtype, batch)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    results = evaluate(lm, phase.args, model)
    eval_s = time.perf_counter() - started
    del lm
    release(phase.args)
    phase.write(name, results)
    samples = sum(len(s) for s in results.get("samples", {}).values())
    return {
        "dtype": dtype,
        "batch_size": batch,
        "load_s": load_s,
        "eval_s": eval_s,
        "samples": samples,
        "results": results.get("results"),
    }


def phase_hf_reference(phase: Phase) -> None:
    """lm-eval hf's reference rows (before Ray starts): float32, and bf16 at two batch sizes,
    whose distance is the yardstick of rayeval's bf16 answers."""
    from benchmarks.gpu_parity import spread_figures

    first, second = phase.args.reference_batch_sizes
    run_step(phase, "hf float32", 60, lambda: hf_row_step(phase, "hf-float32", "float32", first))
    a = run_step(
        phase, "hf bfloat16 A", 40, lambda: hf_row_step(phase, "hf-bfloat16-a", "bfloat16", first)
    )
    b = run_step(
        phase, "hf bfloat16 B", 40, lambda: hf_row_step(phase, "hf-bfloat16-b", "bfloat16", second)
    )
    if a and b:
        run_step(
            phase,
            "hf spread",
            20,
            lambda: spread_figures(phase.read("hf-bfloat16-a"), phase.read("hf-bfloat16-b")),
        )
    else:
        skip(phase, ["hf spread"], "an hf bfloat16 row failed")


# ----------------------------------------------------------------------------- speed
@dataclass
class Workload:
    """The timed requests (built afresh for every repeat) and their token counts."""

    build: Callable[[], tuple[list[Any], list[Any]]]
    score_tokens: int
    decode_tokens: int


def workload(args: argparse.Namespace, model: dict[str, Any]) -> Workload:
    """bench_generate.py's requests: score tokens as lm-eval feeds them (context + continuation
    but the last token); decode tokens exactly prompts x new tokens (no answer stops early)."""
    import transformers

    from benchmarks.bench_generate import build_requests

    tokenizer = transformers.AutoTokenizer.from_pretrained(model["dir"])

    def build() -> tuple[list[Any], list[Any]]:
        return build_requests(tokenizer, args)

    _, score = build()
    fed = sum(
        len(tokenizer(context + continuation, add_special_tokens=False)["input_ids"]) - 1
        for context, continuation in (request.args for request in score)
    )
    return Workload(build, fed, args.prompts * args.new_tokens)


def timed_runs(lm: Any, load: Workload, args: argparse.Namespace, score: bool) -> dict[str, Any]:
    """A warm-up on the first ``--hf_batch_size`` requests of each kind (not counted), then
    ``--repeats`` timed runs of the whole workload (``score``: the loglikelihood requests too,
    else the generations only); tokens/s from the median run."""
    generate, requests = load.build()
    if score:
        lm.loglikelihood(requests[: args.hf_batch_size], disable_tqdm=True)
    lm.generate_until(generate[: args.hf_batch_size], disable_tqdm=True)
    figures: dict[str, Any] = {"decode_tokens": load.decode_tokens, "decode_s": []}
    if score:
        figures |= {"score_tokens": load.score_tokens, "score_s": []}
    answers: dict[str, list[Any]] = {}
    for _ in range(args.repeats):
        generate, requests = load.build()
        if score:
            started = time.perf_counter()
            answers["score"] = [lp for lp, _ in lm.loglikelihood(requests, disable_tqdm=True)]
            figures["score_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        answers["generate"] = lm.generate_until(generate, disable_tqdm=True)
        figures["decode_s"].append(time.perf_counter() - started)
    figures["decode_tok_s"] = load.decode_tokens / statistics.median(figures["decode_s"])
    if score:
        figures["score_tok_s"] = load.score_tokens / statistics.median(figures["score_s"])
    return figures | {"answers": answers}


def hf_speed_step(phase: Phase, dtype: str) -> dict[str, Any]:
    """lm-eval hf's tokens/s in ``dtype`` (bf16: scoring and decoding; float32: decoding, the
    row continuous batching is set beside), kept for the rayeval rows."""
    args = phase.args
    model = phase.read("model")
    load = workload(args, model)
    if args.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
    lm = open_hf(args, model, dtype, args.hf_batch_size)
    figures = timed_runs(lm, load, args, score=dtype != "float32")
    if args.device == "cuda":
        import torch

        figures["max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    del lm
    release(args)
    phase.write(f"hf-speed-{dtype}", figures)
    shown = {k: v for k, v in figures.items() if k != "answers"}
    return {"dtype": dtype, "batch_size": args.hf_batch_size, "batching": "static"} | shown


def phase_hf_speed(phase: Phase) -> None:
    """lm-eval hf's scoring and decoding tokens/s in bf16, and its decoding in float32 (the rows
    rayeval's are set beside)."""
    run_step(phase, "hf speed", 90, lambda: hf_speed_step(phase, "bfloat16"))
    run_step(phase, "hf speed float32", 90, lambda: hf_speed_step(phase, "float32"))


# ----------------------------------------------------------------------------- rayeval
def ray_start(phase: Phase) -> dict[str, Any]:
    """A local Ray (token auth as Ray sets it: the product must work with it on)."""
    import ray

    gpus = {}
    if phase.args.device == "cuda":
        import torch

        gpus = {"num_gpus": torch.cuda.device_count()}
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False, **gpus
    )
    return {
        "ray": ray.__version__,
        "auth_mode": os.environ.get("RAY_AUTH_MODE", "(Ray's default)"),
        "resources": ray.cluster_resources(),
    }


def open_rayeval(phase: Phase, dtype: str) -> Any:
    """rayeval's LM at 1x1; the ranks' reported device memory is kept in ``phase.held``."""
    from rayeval.service.engine.lm import RayEvalLM

    held: list[float] = phase.held.setdefault("rank_device_mib", [])

    def on_progress(progress: Any) -> None:
        held.extend(r.device_mib for ranks in progress.rank_memory.values() for r in ranks)

    lm = RayEvalLM(
        pretrained=phase.read("model")["dir"],
        num_replicas=1,
        shard_size=1,
        batch_size="auto",
        device=phase.args.device,
        dtype=dtype,
        on_progress=on_progress,
    )
    try:
        lm.engine.load_reports  # noqa: B018 - waits for every rank to load
    except BaseException:
        lm.close()
        raise
    return lm


def rayeval_parity_step(phase: Phase, dtype: str) -> dict[str, Any]:
    """rayeval 1x1 evaluated and judged: float32 against hf float32 (1e-4), bf16 against hf
    bf16 by hf's own spread between its batch sizes."""
    from benchmarks.gpu_parity import exact_verdict, spread_verdict

    started = time.perf_counter()
    lm = open_rayeval(phase, dtype)
    phase.held["lm"] = lm
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    ours = evaluate(lm, phase.args, phase.read("model"))
    eval_s = time.perf_counter() - started
    if dtype == "float32":
        verdict = exact_verdict(phase.read("hf-float32"), ours)
    else:
        verdict = spread_verdict(phase.read("hf-bfloat16-a"), phase.read("hf-bfloat16-b"), ours)
    return {"dtype": dtype, "load_s": load_s, "eval_s": eval_s, **verdict}


class DeviceMemory:
    """Device memory in use (``torch.cuda.mem_get_info``: every process) sampled by a thread,
    per device, above what was in use when sampling began; at 1x1 the one rank's GPU."""

    def __init__(self, devices: int, interval_s: float = 0.02) -> None:
        import torch

        self._used = lambda d: (lambda f, t: t - f)(*torch.cuda.mem_get_info(d))
        self._devices = range(devices)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._base = [self._used(d) for d in self._devices]
        self._peak = list(self._base)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            for d in self._devices:
                self._peak[d] = max(self._peak[d], self._used(d))

    def peak_mib(self) -> list[float]:
        """Peak MiB above the start, per device, so far."""
        return [(peak - base) / MIB for peak, base in zip(self._peak, self._base, strict=True)]


def rayeval_speed_step(phase: Phase, dtype: str) -> dict[str, Any]:
    """rayeval's tokens/s beside hf's in the same dtype: bf16 scoring and decoding (static
    batches: continuous batching runs in float32 only), float32 decoding (continuous batching).
    """
    args = phase.args
    lm = phase.held.get("lm")
    if lm is None:
        raise RuntimeError(f"no rayeval LM: the {dtype} parity step failed")
    load = workload(args, phase.read("model"))
    figures = timed_runs(lm, load, args, score=dtype != "float32")
    hf = phase.read(f"hf-speed-{dtype}")
    answers = figures.pop("answers")
    same = sum(a == b for a, b in zip(answers["generate"], hf["answers"]["generate"], strict=True))
    stats = {name: stats.report() for name, stats in lm.engine.stats.items()}
    generation = lm.engine.stats.get("generate_until")
    figures |= {
        "dtype": dtype,
        "batching": getattr(generation, "batching", None),
        "decode_vs_hf": figures["decode_tok_s"] / hf["decode_tok_s"],
        "same_generations_as_hf": f"{same}/{len(answers['generate'])}",
    }
    if "score" in answers:
        deltas = [abs(a - b) for a, b in zip(answers["score"], hf["answers"]["score"], strict=True)]
        figures |= {
            "score_vs_hf": figures["score_tok_s"] / hf["score_tok_s"],
            "max_abs_dlogprob_vs_hf": max(deltas, default=0.0),
        }
    phase.held["speed"] = figures
    return figures | {"engine_stats": stats}


def memory_step(phase: Phase) -> dict[str, Any]:
    """Per-rank peak GPU memory: the device's (every process, sampled) and the rank's tensors
    (reported after each micro-batch), beside hf's ``max_memory_allocated``."""
    sampler = phase.held.get("sampler")
    held = phase.held.get("rank_device_mib", [])
    hf = phase.read("hf-speed-bfloat16")
    return {
        "device_peak_mib": sampler.peak_mib() if sampler else None,
        "rank_allocated_mib": max(held) if held else None,
        "hf_max_allocated_mib": hf.get("max_allocated_mib"),
        "note": "device peak: all processes, above what was in use before rayeval loaded",
    }


def peak_tflops(args: argparse.Namespace) -> float | None:
    """``--peak_tflops``, else the table's figure for the GPU's name, else None."""
    if args.peak_tflops is not None or args.device != "cuda":
        return args.peak_tflops
    import torch

    name = torch.cuda.get_device_name(0)
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def mfu_step(phase: Phase) -> dict[str, Any]:
    """Prefill MFU = 2 x parameters outside the input embedding x score tokens/s / peak dense
    bf16 FLOP/s (attention's own FLOPs left out; hf computes the head at every position where
    rayeval computes it where scored, so it is useful work per second)."""
    flops = 2 * phase.read("model")["flop_parameters"]
    peak = peak_tflops(phase.args)
    ours, hf = phase.held.get("speed"), phase.read("hf-speed-bfloat16")
    if ours is None:
        raise RuntimeError("no rayeval speed: the speed step failed")

    def mfu(tok_s: float) -> float | None:
        return flops * tok_s / (peak * 1e12) if peak else None

    return {
        "peak_bf16_tflops": peak,
        "prefill_mfu": mfu(ours["score_tok_s"]),
        "hf_prefill_mfu": mfu(hf["score_tok_s"]),
    }


def phase_rayeval(phase: Phase, dtype: str) -> None:
    """Ray, then rayeval 1x1 in ``dtype`` against hf's rows, then its speed beside hf's (bf16:
    then memory and MFU)."""
    steps = PHASES[f"rayeval-{dtype}"][1]
    if not run_step(phase, "ray start", 45, lambda: ray_start(phase)):
        skip(phase, steps[1:], "Ray did not start")
        return
    if phase.args.device == "cuda" and dtype != "float32":
        import torch

        phase.held["sampler"] = DeviceMemory(torch.cuda.device_count())
    try:
        if not run_step(phase, steps[1], 75, lambda: rayeval_parity_step(phase, dtype)):
            skip(phase, steps[2:], f"the {dtype} parity step failed")
        elif not run_step(phase, steps[2], 90, lambda: rayeval_speed_step(phase, dtype)):
            skip(phase, steps[3:], "the speed step failed")
        elif dtype != "float32":
            run_step(phase, "memory", 10, lambda: memory_step(phase))
            run_step(phase, "mfu", 10, lambda: mfu_step(phase))
    finally:
        lm = phase.held.pop("lm", None)
        if lm is not None:
            lm.close()
        import ray

        ray.shutdown()


#: The phases in order, each run in its own process by gpu_check.py, and the steps each writes.
PHASES: dict[str, tuple[Callable[[Phase], None], list[str]]] = {
    "env": (phase_env, ["env"]),
    "model": (phase_model, ["model"]),
    "hf-reference": (phase_hf_reference,
                     ["hf float32", "hf bfloat16 A", "hf bfloat16 B", "hf spread"]),
    "hf-speed": (phase_hf_speed, ["hf speed", "hf speed float32"]),
    "rayeval-float32": (lambda p: phase_rayeval(p, "float32"),
                        ["ray start", "rayeval float32", "rayeval speed float32"]),
    "rayeval-bfloat16": (lambda p: phase_rayeval(p, "bfloat16"),
                         ["ray start", "rayeval bfloat16", "rayeval speed", "memory", "mfu"]),
}  # fmt: skip
#: Each phase's timeout: its steps' own, plus the process start and its imports.
PHASE_TIMEOUT_S = {
    "env": 90,
    "model": 120,
    "hf-reference": 180,
    "hf-speed": 210,
    "rayeval-float32": 240,
    "rayeval-bfloat16": 260,
}
