"""Running lm-eval's own HF backend and rayeval side by side, and comparing them sample by sample.

Fidelity (DESIGN invariant 1): per request |delta logprob| <= 1e-4, identical is_greedy, identical
greedy generations, identical metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

LOGPROB_TOL = 1e-4


def evaluate(model: Any, task_manager: Any, tasks: list[str], **kwargs: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with samples logged and a fixed seed."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=task_manager, log_samples=True, **kwargs
    )


def hf_reference(
    model_dir: Any, task_manager: Any, tasks: list[str], dtype: str = "float32", **kwargs: Any
) -> dict[str, Any]:
    """lm-eval's own ``hf`` backend on the CPU (fp32 unless ``dtype``): the reference every
    result must match."""
    return evaluate(
        "hf",
        task_manager,
        tasks,
        model_args={"pretrained": str(model_dir), "dtype": dtype},
        device="cpu",
        batch_size=4,
        **kwargs,
    )


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
    assert set(reference["samples"]) == set(ours["samples"]), "different task sets"
    compared = 0
    for task, ref_samples in reference["samples"].items():
        ref_by_doc = {s["doc_id"]: s for s in ref_samples}
        our_by_doc = {s["doc_id"]: s for s in ours["samples"][task]}
        assert ref_by_doc.keys() == our_by_doc.keys(), f"{task}: different doc ids"
        for doc_id, ref in ref_by_doc.items():
            ours_sample = our_by_doc[doc_id]
            assert ref["arguments"] == ours_sample["arguments"], f"{task}/{doc_id}: prompts differ"
            _assert_same_response(ref["resps"], ours_sample["resps"], f"{task}/{doc_id}", exact)
            compared += 1
    assert compared > 0
    for section in ("results", "groups"):
        for name, metrics in reference.get(section, {}).items():
            for key, value in metrics.items():
                other = ours[section][name][key]
                if isinstance(value, float) and not exact:
                    assert math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-6), (
                        f"{section}/{name}/{key}: {value} != {other}"
                    )
                else:
                    assert value == other, f"{section}/{name}/{key}: {value!r} != {other!r}"


def _assert_same_response(ref: Any, ours: Any, where: str, exact: bool) -> None:
    if isinstance(ref, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ref) == len(ours), (
            f"{where}: {ref} vs {ours}"
        )
        for a, b in zip(ref, ours, strict=True):
            _assert_same_response(a, b, where, exact)
    elif isinstance(ref, str) and isinstance(ours, str) and ref != ours and not exact:
        # lm-eval's samples JSONL stores log-probs as strings: compare them as numbers.
        assert abs(float(ref) - float(ours)) <= LOGPROB_TOL, f"{where}: {ref!r} != {ours!r}"
    elif isinstance(ref, (bool, str)):
        assert ref == ours, f"{where}: {ref!r} != {ours!r}"
    elif isinstance(ref, float):
        if exact:
            assert ref == ours, f"{where}: {ref} != {ours}"
        else:
            assert abs(ref - ours) <= LOGPROB_TOL, f"{where}: logprob {ref} vs {ours}"
    else:
        assert ref == ours, f"{where}: {ref!r} != {ours!r}"


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
