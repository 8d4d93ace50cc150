"""The GPU check (``benchmarks/gpu_check.py``) run on the CPU with ``--tiny``, so it cannot rot
before a GPU machine is lent.

The script runs as a subprocess (tests never import ``benchmarks/``), as ``make gpu-check`` runs
it, and its JSON report must hold every figure it promises and a parity that holds: bf16 at 1x1
is bit-identical to lm-eval's own ``hf`` on this CPU (DESIGN invariant 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
REPORT_KEYS = {
    "passed", "device", "peak_bf16_tflops", "versions", "model", "dtype", "tasks", "workload",
    "rows", "ratios", "parity", "skipped", "seconds", "argv",
}  # fmt: skip
ROW_KEYS = {
    "name", "load_s", "parity_eval_s", "score_s", "decode_s", "score_tok_s", "decode_tok_s",
    "prefill_mfu", "memory_mib", "load_reports", "error", "workload_agreement",
}  # fmt: skip


def _run(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.service
def test_tiny_gpu_check_reports_every_figure_and_parity(demo: Any, tmp_path: Path) -> None:
    env = {**os.environ, "RAYEVAL_DEMO_DIR": str(demo.model_dir.parent)}
    env.pop("RAY_ADDRESS", None)  # the script starts its own local Ray
    out = tmp_path / "report.json"
    done = _run(["--tiny", "--model_dir", str(tmp_path / "model"), "--json", str(out)], env, 300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())

    assert not REPORT_KEYS - set(report), REPORT_KEYS - set(report)
    assert report["passed"] is True
    assert report["dtype"] == "bfloat16"
    assert {"torch", "transformers", "lm_eval", "ray"} <= set(report["versions"])
    assert report["device"]["name"] and report["device"]["kind"] == "cpu"
    assert report["model"]["parameters"] > report["model"]["flop_parameters"] > 0
    assert [row["name"] for row in report["rows"]] == ["lm-eval hf", "rayeval 1x1"]
    for row in report["rows"]:
        assert not ROW_KEYS - set(row), (row["name"], ROW_KEYS - set(row))
        assert row["error"] is None, row["error"]
        assert row["score_tok_s"] > 0 and row["decode_tok_s"] > 0, row["name"]
    ours = report["rows"][1]
    assert ours["load_reports"] and ours["engine_stats"]
    assert ours["workload_agreement"]["same_generations"] == "8/8"
    assert report["ratios"]["rayeval 1x1"]["score"] > 0
    assert report["ratios"]["rayeval 1x1"]["decode"] > 0
    assert [line.split()[0] for line in report["skipped"]] == ["1x2", "2x1"]

    parity = report["parity"]
    assert list(parity) == ["rayeval 1x1"]
    one = parity["rayeval 1x1"]
    assert one["passed"] is True and one["against"] == "lm-eval hf"
    assert one["samples"] > 0 and one["logprobs"] > 0
    # bf16 on this CPU: bit for bit, not merely within a tolerance.
    assert (one["rtol"], one["atol"], one["logprobs_differing"]) == (0.0, 0.0, 0)
    assert one["discrete_diffs"] == 0 and one["metric_diffs"] == {} and one["problems"] == []


@pytest.mark.unit
def test_cuda_asked_of_a_cpu_torch_names_the_install_command() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    done = _run(["--device", "cuda"], dict(os.environ), 120)
    assert done.returncode == 2
    assert "--index-url https://download.pytorch.org/whl/cu" in done.stderr
    assert "pip install torch==" in done.stderr
