"""The GPU check: rayeval's GPU path beside lm-eval's own ``hf`` backend, in one command of at
most 9 minutes that keeps every figure it measured.

Prepared for the day a GPU machine is lent: one H100 or H200, no network, 15 minutes of device
time, 10 per command. ``make gpu-pack`` builds the wheels that machine lacks
(``benchmarks/gpu_pack.py``); there, with its own ``python3``::

    python3 benchmarks/gpu_pack.py install --target /tmp/rayeval-site && \\
        PYTHONPATH=/tmp/rayeval-site python3 benchmarks/gpu_check.py

The report is JSON lines (``--out``; default ``$OUT/gpu-check.jsonl`` where ``OUT`` is set,
else ``.rayeval/gpu-check.jsonl``), one line per measurement, written and flushed as it goes,
so a timeout or a crash loses only what had not run. The phases run one after the other, each
in its own process with its own timeout (``gpu_steps.PHASE_TIMEOUT_S``), and each step inside
with its own (a hang costs its line, and the rest of its phase):

1. ``env``: versions of the machine's torch, transformers, accelerate, peft, tokenizers and
   safetensors against the project's ranges, the GPUs and their free memory, the pack's
   packages, and the private APIs rayeval uses. The first line; where the project cannot use
   the machine the check stops there, saying why (status 3; 2 where CUDA is asked of a torch
   that has none);
2. ``model``: a Llama of ~0.96B parameters with random weights and a 32,768-token byte-level
   BPE vocabulary, built from a config on the machine (no hub), fp32 on disk, reused from
   ``--work_dir``; the head's EOS row is zeroed so that every answer runs to its length;
3. ``hf-reference``: lm-eval hf's rows of ``demo_mc``, ``demo_rolling``, ``demo_gen_short``
   (``--limit`` documents, 1-shot): float32, and bf16 at two batch sizes
   (``--reference_batch_sizes``), before Ray starts; hf's own spread between the two;
4. ``hf-speed``: hf's scoring and decoding tokens/s in bf16 and its decoding in float32
   (warm-up excluded, ``--repeats`` runs, the median), and its ``max_memory_allocated``;
5. ``rayeval-float32``: Ray, then rayeval 1x1 in float32 against hf float32: every
   log-probability within 1e-4 (two float32 ulps above 1024), the same greedy flags and texts,
   the same metrics (the logic's parity); then its continuous-batching decode tokens/s beside
   hf's float32 static batches (continuous batching runs in float32 only);
6. ``rayeval-bfloat16``: rayeval 1x1 in bf16 against hf bf16 (batch size A): each sample no
   further than hf A's farthest sample from hf B plus 1e-4, a flip only where hf flips between
   its batch sizes; then scoring and decoding (static batches in bf16) tokens/s beside hf's,
   per-rank peak GPU memory, prefill MFU.

The last line is the verdict: ``passed`` when every step ran without error and every parity
held (status 0, else 1). ``--tiny`` runs the same phases on the CPU with a tiny model (what
tests/test_gpu_check.py rehearses, in an environment like the lent machine's).

Usage::

    make gpu-check                                         # the venv here (needs CUDA torch)
    .venv/bin/python benchmarks/gpu_check.py --tiny --out /tmp/gpu-check.jsonl   # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.gpu_steps import PHASE_TIMEOUT_S, PHASES, Phase, Report  # noqa: E402

INSTALL_CUDA_TORCH = (
    ".venv/bin/pip install torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
)
#: The whole check's budget: one device command may run 10 minutes, the install needs some.
BUDGET_S = 540
#: The GPU run's sizes, and --tiny's; a flag given on the command line wins.
SIZES = {
    "gpu": {"hidden": 2048, "intermediate": 5632, "layers": 16, "heads": 16, "vocab": 32768,
            "limit": 20, "prompts": 128, "new_tokens": 128, "prefill_requests": 256,
            "prefill_len": 512, "hf_batch_size": 64},
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "vocab": 2048,
             "limit": 4, "prompts": 4, "new_tokens": 8, "prefill_requests": 8,
             "prefill_len": 32, "hf_batch_size": 4},
}  # fmt: skip
#: Exit statuses.
PASSED, FAILED, NO_CUDA, UNUSABLE = 0, 1, 2, 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the size preset's values where a flag was not given."""
    parser = argparse.ArgumentParser(description="rayeval's GPU path beside lm-eval hf.")
    add = parser.add_argument
    add("--tiny", action="store_true", help="tiny model and workload, on the CPU unless --device")
    add("--device", choices=("cpu", "cuda"), default=None, help="cuda (cpu with --tiny)")
    add("--out", default=None, help="the JSON-lines report (default $OUT or .rayeval)")
    add("--work_dir", default=None, help="model, tasks, state (.rayeval/gpu-check)")
    add("--peak_tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (MFU)")
    add("--num_fewshot", type=int, default=1, help="few-shot examples of the parity tasks (1)")
    add("--reference_batch_sizes", default=None, help="hf's two bf16 batch sizes (16,3; tiny 4,2)")
    add("--repeats", type=int, default=3, help="timed runs after the warm-up (3)")
    add("--budget_s", type=float, default=BUDGET_S, help=f"the whole check's limit ({BUDGET_S})")
    add("--timeout_scale", type=float, default=None, help="x every timeout (1; tiny 3)")
    add("--phase", choices=list(PHASES), default=None, help=argparse.SUPPRESS)  # one phase's run
    add("--started", type=float, default=None, help=argparse.SUPPRESS)
    add("--hang", default=None, help=argparse.SUPPRESS)  # this step hangs (a rehearsal)
    add("--hang_timeout_s", type=float, default=2.0, help=argparse.SUPPRESS)
    for name, value in SIZES["gpu"].items():
        add(f"--{name}", type=int, default=None, help=f"{value} (--tiny: {SIZES['tiny'][name]})")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    for name, value in SIZES["tiny" if args.tiny else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    batches = args.reference_batch_sizes or ("4,2" if args.tiny else "16,3")
    args.reference_batch_sizes = [int(part) for part in batches.split(",")]
    if len(args.reference_batch_sizes) != 2 or len(set(args.reference_batch_sizes)) != 2:
        parser.error("--reference_batch_sizes takes two different sizes, e.g. 16,3")
    if args.timeout_scale is None:
        args.timeout_scale = 3.0 if args.tiny else 1.0
    args.work_dir = args.work_dir or str(REPO_ROOT / ".rayeval" / "gpu-check")
    args.out = args.out or str(default_out())
    return args


def default_out() -> Path:
    """``$OUT/gpu-check.jsonl`` where ``OUT`` is set (the device machine's folder), else under
    ``.rayeval``."""
    out = os.environ.get("OUT")
    return Path(out) / "gpu-check.jsonl" if out else REPO_ROOT / ".rayeval" / "gpu-check.jsonl"


def set_environment() -> None:
    """Offline Hugging Face (the ranks inherit it) and quiet tokenizers. Ray's token auth is
    left as Ray sets it: the product must work with it on."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------- one phase
def run_phase(args: argparse.Namespace) -> int:
    """This process runs one phase (``--phase``) and appends its lines."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.tiny and args.phase != "env":  # plumbing, not speed: one thread, as a 1x1 rank
        import torch

        torch.set_num_threads(1)
    state = Path(args.work_dir) / "state"
    state.mkdir(parents=True, exist_ok=True)
    report = Report(Path(args.out), args.phase, args.started)
    PHASES[args.phase][0](Phase(args, report, state))
    return 0


# ----------------------------------------------------------------------------- the check
def read_lines(path: Path) -> list[dict[str, Any]]:
    """The report's lines so far (a torn last line is left out)."""
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return lines


def spawn(args: argparse.Namespace, phase: str, argv: list[str], timeout_s: float) -> str | None:
    """Run ``phase`` in its own process (its own session, so that whatever it started, Ray's
    processes included, is ended with it); what went wrong, or None."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--phase",
        phase,
        "--started",
        str(args.started),
    ]
    child = subprocess.Popen(command, start_new_session=True)
    try:
        code = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    if code is None:
        return f"timeout after {timeout_s:.0f} s"
    return None if code == 0 else f"its process ended with status {code}"


def run_phases(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Every phase in order, each under its timeout and the whole budget; an exit status where
    the check must stop after ``env``."""
    out = Path(args.out)
    deadline = time.monotonic() + args.budget_s
    for phase, (_, steps) in PHASES.items():
        report = Report(out, phase, args.started)
        left = deadline - time.monotonic()
        if left < 5:
            for step in steps:
                report.emit(step, error=f"not run: the {args.budget_s:.0f} s budget is spent")
            continue
        problem = spawn(args, phase, argv, min(PHASE_TIMEOUT_S[phase] * args.timeout_scale, left))
        written = {line["step"] for line in read_lines(out) if line.get("phase") == phase}
        for step in steps:
            if step not in written:  # a crash, or the phase's timeout before the step's
                report.emit(step, error=f"no line: the {phase} phase {problem or 'wrote none'}")
        if phase == "env":
            status = env_verdict(read_lines(out))
            if status is not None:
                return status
    return None


def env_verdict(lines: list[dict[str, Any]]) -> int | None:
    """Stop with a clear message where the project cannot use this machine (None: go on)."""
    env = next((line for line in lines if line["step"] == "env"), {})
    if env.get("usable"):
        return None
    versions = env.get("versions", {})
    problems = env.get("problems") or [env.get("error", "the env step wrote nothing")]
    sys.stderr.write(
        f"rayeval cannot use this machine's torch {versions.get('torch')} and transformers "
        f"{versions.get('transformers')}:\n  " + "\n  ".join(problems) + "\n"
    )
    if any(str(p).startswith("no_cuda") for p in problems):
        sys.stderr.write(
            f"Install the CUDA build of torch:\n  {INSTALL_CUDA_TORCH}\nor run on the CPU with "
            "--tiny.\n"
        )
        return NO_CUDA
    return UNUSABLE


def verdict(args: argparse.Namespace, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Passed: every step wrote its line, none an error, every parity held."""
    failed = [
        f"{line['phase']}/{line['step']}"
        for line in lines
        if "error" in line or line.get("passed") is False
    ]
    return {"passed": not failed, "failed": failed, "lines": len(lines), "argv": sys.argv}


def main(argv: list[str] | None = None) -> int:
    """Run the check (or, with ``--phase``, one of its phases); see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    set_environment()
    if args.phase is not None:
        return run_phase(args)
    args.started = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    status = run_phases(args, argv)
    final = verdict(args, read_lines(out))
    final["seconds"] = round(time.time() - args.started, 1)
    Report(out, "verdict", args.started).emit("verdict", **final)
    if status is not None:
        return status
    print(
        f"\nGPU check {'PASSED' if final['passed'] else 'FAILED'} in {final['seconds']:.0f} s: "
        f"{out}" + (f" (failed: {', '.join(final['failed'])})" if final["failed"] else "")
    )
    return PASSED if final["passed"] else FAILED


if __name__ == "__main__":
    sys.exit(main())
