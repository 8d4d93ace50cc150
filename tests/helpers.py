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
import math
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOGPROB_TOL = 1e-4
#: lm-eval hf's batch sizes whose answers bound rayeval's in bf16 and fp16: a request alone (MKL
#: and oneDNN take other kernels for 1-3 rows) and two full batches.
SPREAD_BATCH_SIZES = (1, 4, 16)


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


@dataclass(frozen=True)
class Distance:
    """How far two evaluations' per-sample results and metrics are apart, measure by measure:
    the largest log-prob difference of any request, the number of requests whose ``is_greedy``
    or generation differs, and each metric's difference."""

    logprob: float = 0.0
    greedy: int = 0
    generations: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def measures(self) -> dict[str, float]:
        """Every measure by name: ``logprob``, ``is_greedy``, ``generations``, ``metric:NAME``."""
        named = {"logprob": self.logprob, "is_greedy": self.greedy, "generations": self.generations}
        return named | {f"metric:{key}": value for key, value in self.metrics.items()}

    @classmethod
    def between(cls, a: dict[str, Any], b: dict[str, Any]) -> Distance:
        """The distance between two evaluations of the same samples (prompts checked equal),
        as ``simple_evaluate`` returns them (log-probs as floats, flags as bools)."""
        logprob, greedy, generations = 0.0, 0, 0
        for where, x, y in _paired_atoms(a, b):
            if isinstance(x, bool):
                greedy += x != y
            elif isinstance(x, float):
                logprob = max(logprob, abs(x - y))
            elif isinstance(x, str):
                generations += x != y
            else:
                assert x == y, f"{where}: {x!r} != {y!r}"
        metrics = {}
        for key, x, y in _paired_metrics(a, b):
            if isinstance(x, float) and isinstance(y, float):
                metrics[key] = 0.0 if x == y or (math.isnan(x) and math.isnan(y)) else abs(x - y)
            else:
                assert x == y, f"{key}: {x!r} != {y!r}"
        return cls(logprob, greedy, generations, metrics)


@dataclass(frozen=True)
class HfSpread:
    """lm-eval hf's own answers on one model and samples at several batch sizes, and how far
    they are apart (the largest distance between two of them, per measure)."""

    label: str
    batch_sizes: tuple[int, ...]
    runs: tuple[dict[str, Any], ...]

    def spread(self) -> dict[str, float]:
        """Per measure, the most any two batch sizes' answers differ."""
        spread: dict[str, float] = {}
        for i, a in enumerate(self.runs):
            for b in self.runs[i + 1 :]:
                for name, value in Distance.between(a, b).measures().items():
                    spread[name] = max(spread.get(name, 0.0), value)
        return spread

    def assert_holds(self, ours: dict[str, Any], what: str) -> None:
        """``ours`` is no further from lm-eval hf, by any measure, than lm-eval hf is from itself
        between its batch sizes: per measure, its distance to the nearest of lm-eval hf's runs is
        at most their spread, so where that spread is zero it is bit for bit. The figures go to
        the session's summary (:data:`SPREADS`) and the test's output."""
        spread = self.spread()
        distances = [Distance.between(run, ours).measures() for run in self.runs]
        nearest = {name: min(d[name] for d in distances) for name in spread}
        beyond = {
            name: f"{value} > {spread[name]}"
            for name, value in nearest.items()
            if value > spread[name]
        }
        line = (
            f"{self.label}, {what}: lm-eval hf's spread over batch sizes {self.batch_sizes} "
            f"{_figures(spread)}; rayeval's distance to the nearest {_figures(nearest)}"
        )
        SPREADS.append(line)
        print(line)
        assert not beyond, (
            f"{what} is further from lm-eval hf than lm-eval hf is from itself: {beyond}"
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
        _SPREAD_CACHE[key] = HfSpread(label, SPREAD_BATCH_SIZES, runs)
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


def _figures(measures: dict[str, float]) -> str:
    metrics = [v for k, v in measures.items() if k.startswith("metric:")]
    return (
        f"(logprob {measures['logprob']:g}, is_greedy {measures['is_greedy']:g}, "
        f"generations {measures['generations']:g}, metrics {max(metrics, default=0.0):g})"
    )


def _atoms(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _atoms(item, f"{where}[{i}]")
    else:
        yield where, value


def _paired_atoms(a: dict[str, Any], b: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """Each response's atoms (log-prob, flag, generation) side by side, sample by sample, once
    the two have the same tasks, doc ids, prompts and response shapes (asserted)."""
    assert set(a["samples"]) == set(b["samples"]), "different task sets"
    for task, samples in a["samples"].items():
        others = {s["doc_id"]: s for s in b["samples"][task]}
        assert {s["doc_id"] for s in samples} == others.keys(), f"{task}: different doc ids"
        for sample in samples:
            other = others[sample["doc_id"]]
            where = f"{task}/{sample['doc_id']}"
            assert sample["arguments"] == other["arguments"], f"{where}: prompts differ"
            x, y = list(_atoms(sample["resps"], where)), list(_atoms(other["resps"], where))
            assert [w for w, _ in x] == [w for w, _ in y], (
                f"{where}: {sample['resps']} vs {other['resps']}"
            )
            for (w, u), (_, v) in zip(x, y, strict=True):
                assert type(u) is type(v), f"{w}: {u!r} vs {v!r}"
                yield w, u, v


def _paired_metrics(a: dict[str, Any], b: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    for section in ("results", "groups"):
        for name, metrics in a.get(section, {}).items():
            for key, value in metrics.items():
                yield f"{section}/{name}/{key}", value, b[section][name][key]


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


def read_outputs(out: Path) -> tuple[str, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """What ``lm_eval run --output_path out --log_samples`` wrote: model dir, results, samples."""
    (model_dir,) = out.iterdir()
    (results_file,) = model_dir.glob("results_*.json")
    samples = {}
    for path in model_dir.glob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return model_dir.name, json.loads(results_file.read_text()), samples


def assert_same_results(
    reference: dict[str, Any], ours: dict[str, Any], exact: bool = False
) -> None:
    """Per-sample responses and every metric agree (``exact``: bit-identical responses)."""
    compared = 0
    for where, ref, other in _paired_atoms(reference, ours):
        _assert_same_atom(ref, other, where, exact)
        compared += 1
    assert compared > 0
    for key, value, other in _paired_metrics(reference, ours):
        if isinstance(value, float) and not exact:
            assert math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-6), (
                f"{key}: {value} != {other}"
            )
        else:
            assert value == other, f"{key}: {value!r} != {other!r}"


def _assert_same_atom(ref: Any, ours: Any, where: str, exact: bool) -> None:
    """One log-prob, flag or generation of a response, as :func:`assert_same_results` holds it."""
    # lm-eval's samples JSONL stores log-probs as strings: compare them as numbers.
    number = _number(ref) if isinstance(ref, str) and ref != ours and not exact else None
    if number is not None:
        other = _number(ours)
        assert other is not None, f"{where}: {ref!r} != {ours!r}"
        assert abs(number - other) <= logprob_tolerance(number), f"{where}: {ref!r} != {ours!r}"
    elif isinstance(ref, float) and not exact:
        assert abs(ref - ours) <= logprob_tolerance(ref), f"{where}: logprob {ref} vs {ours}"
    else:
        assert ref == ours, f"{where}: {ref!r} != {ours!r}"


def _number(text: str) -> float | None:
    """``text`` as a number (a log-prob in lm-eval's samples JSONL), or None (a generation)."""
    try:
        return float(text)
    except ValueError:
        return None


def logprob_tolerance(value: float) -> float:
    """How far a float32 log-prob may be from lm-eval hf's (DESIGN invariant 1): 1e-4, or two
    float32 ulps of the value where that is more (past 1024 in magnitude, as whole-document
    rolling sums are: one ulp of 2180 is 2.4e-4)."""
    import numpy as np

    if abs(value) <= 1024:
        return LOGPROB_TOL
    return max(LOGPROB_TOL, 2 * float(np.spacing(np.float32(abs(value)))))


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
