"""Running lm-eval's own HF backend and rayeval side by side, and comparing them sample by sample.

Fidelity (DESIGN invariant 1): in float32, per request |delta logprob| <= 1e-4 (two float32
ulps past 1024: :func:`logprob_tolerance`), identical is_greedy, identical greedy generations,
identical metrics. In bf16 and fp16, rayeval is held to
lm-eval hf's own spread between batch sizes on this machine and samples (:class:`HfSpread`): bit
for bit by every measure in which lm-eval hf does not move, and never further from lm-eval hf
than lm-eval hf is from itself in those it does (on a CPU with AVX2 and no AVX-512 its bf16
answers move with its batch size).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from rayeval.service.parity import SPREAD_BATCH_SIZES, Spread, assert_same_results
from rayeval.service.result_files import read_outputs

__all__ = ["assert_same_results", "read_outputs"]  # the product's, as the tests have used them


def evaluate(model: Any, task_manager: Any, tasks: list[str], **kwargs: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with samples logged and a fixed seed."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=task_manager, log_samples=True, **kwargs
    )


def hf_reference(
    model_dir: Any,
    task_manager: Any,
    tasks: list[str],
    dtype: str = "float32",
    batch_size: int = 4,
    model_args: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """lm-eval's own ``hf`` backend on the CPU (fp32 unless ``dtype``; ``model_args`` adds
    ``peft=`` or ``delta=``): the reference every result must match."""
    return evaluate(
        "hf",
        task_manager,
        tasks,
        model_args={"pretrained": str(model_dir), "dtype": dtype, **(model_args or {})},
        device="cpu",
        batch_size=batch_size,
        **kwargs,
    )


class HfSpread(Spread):
    """:class:`~rayeval.service.parity.Spread` with the tests' assertion."""

    def assert_holds(self, ours: dict[str, Any], what: str) -> None:
        """``ours`` is no further from lm-eval hf, by any measure, than lm-eval hf is from itself
        between its batch sizes (:meth:`Spread.judge`). The figures go to the session's summary
        (:data:`SPREADS`) and the test's output."""
        judgement = self.judge(ours)
        line = (
            f"{self.label}, {what}: lm-eval hf's spread over batch sizes {self.batch_sizes} "
            f"{judgement.figures('spread')}; rayeval's distance to the nearest "
            f"{judgement.figures('nearest')}"
        )
        SPREADS.append(line)
        print(line)
        assert judgement.holds, (
            f"{what} is further from lm-eval hf than lm-eval hf is from itself: "
            f"{judgement.beyond} (at {', '.join(judgement.where[:8])})"
        )


#: One line per spread check in this session, printed in pytest's closing summary.
SPREADS: list[str] = []
_SPREAD_CACHE: dict[str, HfSpread] = {}


def hf_spread(
    model_dir: Any,
    task_manager: Any,
    tasks: list[str],
    dtype: str,
    model_args: dict[str, str] | None = None,
    **kwargs: Any,
) -> HfSpread:
    """lm-eval hf at :data:`SPREAD_BATCH_SIZES` on the same model and samples (computed once per
    test session)."""
    args = {
        "model_dir": str(model_dir),
        "tasks": tasks,
        "dtype": dtype,
        "model_args": model_args or {},
        **kwargs,
    }
    key = json.dumps(args, sort_keys=True, default=str)
    if key not in _SPREAD_CACHE:
        runs = tuple(
            hf_reference(model_dir, task_manager, tasks, dtype, size, model_args, **kwargs)
            for size in SPREAD_BATCH_SIZES
        )
        extra = "".join(f",{k}" for k in sorted(model_args or {}))
        label = f"{Path(model_dir).name}{extra} {dtype}"
        _SPREAD_CACHE[key] = HfSpread(label, dtype, SPREAD_BATCH_SIZES, runs)
    return _SPREAD_CACHE[key]


def half_precision_parity(cases: list[tuple[Any, ...]], ids: list[str]) -> list[Any]:
    """``cases`` as pytest parameters, those in bf16 or fp16 (a ``"bfloat16"`` or ``"float16"``
    among their values) marked ``parity``: the ones whose answers move with the CPU's kernels,
    which ``make test-avx2`` runs again with the kernels capped."""
    import pytest

    half = {"bfloat16", "float16"}
    return [
        pytest.param(*case, id=name, marks=[pytest.mark.parity] if half & set(case) else [])
        for case, name in zip(cases, ids, strict=True)
    ]


def demo_cli_args(demo: Any) -> list[str]:
    """Flags shared by ``lm_eval run`` and ``rayeval run`` in the output-file comparisons."""
    return [
        "--model", "hf",
        "--model_args", f"pretrained={demo.model_dir},dtype=float32",
        "--include_path", str(demo.tasks_dir),
        "--tasks", "demo_gen_short,demo_mc",
        "--limit", "4", "--num_fewshot", "2", "--gen_kwargs", "max_gen_toks=5",
        "--seed", "7", "--log_samples",
    ]  # fmt: skip


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process we started (it shuts down what it started); if it outlives the wait,
    SIGKILL its whole process group."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def kill_processes_naming(marker: str) -> None:
    """Kill, by pid, every process whose command line names ``marker`` (a test's own temp dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def run_lm_eval_cli(argv: list[str]) -> None:
    """lm-eval's own ``lm_eval run`` command line, in this process."""
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    cli.execute(cli._parser.parse_args(argv))


def gated_tasks_dir(tasks_dir: Path, out: Path, gate: str) -> Path:
    """A copy of the demo tasks in ``out`` whose ``demo_mc`` ``acc_norm`` is aggregated by
    ``gate`` (the source of a module defining ``mean_when_open(items)``): a test holds an
    evaluation at its metrics until it lets it go."""
    import shutil

    import yaml

    shutil.copytree(tasks_dir, out, dirs_exist_ok=True)
    (out / "gate.py").write_text(gate)
    config = yaml.safe_load((out / "demo_mc.yaml").read_text())
    (metric,) = [m for m in config["metric_list"] if m["metric"] == "acc_norm"]
    metric["aggregation"] = "GATE"
    text = yaml.safe_dump(config).replace("GATE", "!function gate.mean_when_open")
    (out / "demo_mc.yaml").write_text(text)
    return out
