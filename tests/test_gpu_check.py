"""The GPU pack and the GPU check (``benchmarks/gpu_pack.py``, ``benchmarks/gpu_check.py``),
rehearsed here so that they work the first time a GPU machine is lent.

The lent machine has no network, 64 MiB for the working tree and what it carries, and a Python
with torch, transformers, accelerate, peft and a few more, but no ray, lm-eval, datasets or
pydantic. The rehearsal builds an interpreter like that (this Python's base interpreter, with
only the lent machine's packages linked in from this venv), builds the pack for this Python,
installs only the pack with ``--no-index --no-deps --target``, and runs the check with tiny
sizes on the CPU to its last line: ``ray.init`` from the trimmed wheel (token auth on, as Ray
sets it), lm-eval hf's reference rows, rayeval at 1x1 in float32 and bf16, the speed rows. The
scripts run as subprocesses (tests never import ``benchmarks/``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "benchmarks" / "gpu_check.py"
PACK = REPO / "benchmarks" / "gpu_pack.py"
#: What the lent machine's Python has (the issue, as last read), with what these require.
LENT = (
    "torch", "triton", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "numpy",
    "pandas", "pyarrow", "scipy", "httpx", "pyyaml", "tqdm", "rich", "psutil", "pytest", "pip",
)  # fmt: skip
#: What it lacks, though something it has may name them.
LACKS = (
    "ray", "lm-eval", "datasets", "evaluate", "pydantic", "pydantic-core", "pydantic-settings",
    "fastapi", "uvicorn", "sqlalchemy",
)  # fmt: skip
PACK_LIMIT_MIB = 48
CARRY_LIMIT_MIB = 64
STEPS = [
    "env", "model", "hf float32", "hf bfloat16 A", "hf bfloat16 B", "hf spread", "hf speed",
    "hf speed float32", "ray start", "rayeval float32", "rayeval speed float32", "ray start",
    "rayeval bfloat16", "rayeval speed", "memory", "mfu", "verdict",
]  # fmt: skip


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def lent_distributions() -> dict[str, importlib.metadata.Distribution]:
    """The lent machine's distributions as found in this venv: :data:`LENT` and what they
    require (no extras), never one of :data:`LACKS`."""
    installed = {_name(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [_name(name) for name in LENT]
    while todo:
        name = todo.pop()
        if name in found or name in LACKS or name not in installed:
            continue
        found[name] = installed[name]
        for text in installed[name].requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_name(requirement.name))
    return found


def build_lent_python(root: Path) -> Path:
    """An interpreter like the lent machine's: this base Python in a venv without pip, whose
    site holds links to the lent distributions' files only; its ``python3``."""
    site = root / "machine-site"
    site.mkdir(parents=True)
    for dist in lent_distributions().values():
        for top in {str(f).split("/")[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    env_dir = root / "machine"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python3"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "lent-machine.pth").write_text(f"{site}\n")
    return python


def _run(command: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def _clean_env() -> dict[str, str]:
    """This environment, without what would point the subprocesses at this venv's packages or
    at a Ray cluster; Ray's token auth as Ray sets it (the product must work with it on)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE"):
        env.pop(key, None)
    return env


def _installed_files(target: Path) -> set[str]:
    """The files of the packed packages under ``target`` (what pip adds about itself aside)."""
    found = set()
    for path in target.rglob("*"):
        relative = path.relative_to(target)
        if path.is_dir() or relative.parts[0] in ("bin", "rayeval") or "__pycache__" in str(path):
            continue
        if relative.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            found.add(f"{relative} {path.stat().st_mode & 0o111:o}")
    return found


def _tracked_bytes() -> int:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum(
        (REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file()
    )


def build_pack(out: Path, env: dict[str, str], version: str) -> dict[str, Any]:
    """The pack for Python ``version``, as ``make gpu-pack`` builds it for the lent machine's;
    its manifest, checked against the files and the limits."""
    command = [sys.executable, str(PACK), "build", "--python-version", version, "--out", str(out)]
    built = _run(command, env, 300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    wheels = sorted(out.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) == manifest["bytes"]
    assert {w.name for w in wheels} == {w["file"] for w in manifest["wheels"]}
    assert manifest["bytes"] <= PACK_LIMIT_MIB * 2**20, manifest["mib"]
    assert manifest["bytes"] + _tracked_bytes() <= CARRY_LIMIT_MIB * 2**20
    ray_wheel = next(w for w in manifest["wheels"] if w["distribution"] == "ray")
    assert "ray/jars/" in ray_wheel["removed"] and len(ray_wheel["stripped"]) == 3
    return manifest


def check_lines(lines: list[dict[str, Any]], target: Path) -> None:
    """Every step's line, in order, none an error; the figures each promises."""
    assert [line["step"] for line in lines] == STEPS
    assert not [line for line in lines if "error" in line]
    by_step = {line["step"]: line for line in lines}
    env_line = lines[0]
    assert env_line["usable"] is True and env_line["problems"] == []
    assert env_line["versions"]["torch"] == importlib.metadata.version("torch")
    assert env_line["versions"]["transformers"] == importlib.metadata.version("transformers")
    assert all(Path(p).is_relative_to(target) for p in env_line["paths"].values())
    assert by_step["model"]["parameters"] > by_step["model"]["flop_parameters"] > 0
    f32 = by_step["rayeval float32"]
    assert f32["passed"] is True and f32["samples"] > 0 and f32["max_abs_dlogprob"] <= 1e-4
    bf16 = by_step["rayeval bfloat16"]
    assert bf16["passed"] is True and bf16["samples"] == f32["samples"]
    assert bf16["unexplained_flip_count"] == 0 and bf16["beyond_bound_count"] == 0
    for name in ("hf speed", "rayeval speed", "hf speed float32", "rayeval speed float32"):
        speed = by_step[name]
        assert speed["decode_tok_s"] > 0 and len(speed["decode_s"]) == 3, name
        if "float32" not in name:
            assert speed["score_tok_s"] > 0 and len(speed["score_s"]) == 3, name
    continuous, static = by_step["rayeval speed float32"], by_step["rayeval speed"]
    assert (continuous["batching"], static["batching"]) == ("continuous", "static")
    assert continuous["same_generations_as_hf"] == static["same_generations_as_hf"] == "4/4"
    assert "device_peak_mib" in by_step["memory"] and "prefill_mfu" in by_step["mfu"]
    assert by_step["verdict"]["passed"] is True


@pytest.mark.e2e
def test_the_pack_installs_on_a_machine_like_the_lent_one_and_the_check_runs_to_its_end(
    tmp_path: Path,
) -> None:
    env = _clean_env()
    build_pack(tmp_path / "pack-lent", env, "3.12")  # make gpu-pack's: the lent machine's Python
    pack = tmp_path / "pack"
    build_pack(pack, env, f"{sys.version_info.major}.{sys.version_info.minor}")  # this one's

    python = build_lent_python(tmp_path)
    probe = (  # the machine's packages are there, the pack's are not
        "import importlib.util, torch, transformers, accelerate, peft\n"
        "found = [m for m in ('ray', 'lm_eval', 'pydantic', 'datasets')\n"
        "         if importlib.util.find_spec(m)]\n"
        "assert not found, found"
    )
    done = _run([str(python), "-c", probe], env, 120)
    assert done.returncode == 0, done.stdout + done.stderr

    target = tmp_path / "site"
    command = [str(python), str(PACK), "install", "--pack", str(pack), "--target", str(target)]
    installed = _run(command, env, 300)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert not (target / "ray" / "jars").exists()
    unpacked = tmp_path / "unpacked"  # what install does where the machine has no pip
    command = [*command[:-1], str(unpacked), "--unpack"]
    assert _run(command, env, 300).returncode == 0
    assert _installed_files(unpacked) == _installed_files(target)

    out = tmp_path / "gpu-check.jsonl"
    command = [str(python), str(CHECK), "--tiny", "--out", str(out), "--work_dir",
               str(tmp_path / "work")]  # fmt: skip
    ran = _run(command, env | {"PYTHONPATH": str(target)}, 600)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    check_lines(_lines(out), target)


@pytest.mark.unit
def test_a_hung_step_costs_its_line_and_the_check_says_why_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.jsonl"
    done = _run(
        [
            sys.executable,
            str(CHECK),
            "--tiny",
            "--out",
            str(out),
            "--work_dir",
            str(tmp_path / "work"),
            "--hang",
            "env",
            "--hang_timeout_s",
            "1",
        ],
        _clean_env(),
        120,
    )
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    lines = _lines(out)
    assert [line["step"] for line in lines] == ["env", "verdict"]
    assert lines[0]["error"] == "timeout after 1 s"
    assert lines[1]["passed"] is False and lines[1]["failed"] == ["env/env"]
    assert "rayeval cannot use this machine's torch" in done.stderr
    assert "timeout after 1 s" in done.stderr


@pytest.mark.unit
def test_cuda_asked_of_a_cpu_torch_names_the_install_command(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    out = tmp_path / "gpu-check.jsonl"
    done = _run(
        [sys.executable, str(CHECK), "--device", "cuda", "--out", str(out)], dict(os.environ), 120
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--index-url https://download.pytorch.org/whl/cu" in done.stderr
    assert "pip install torch==" in done.stderr
    first = _lines(out)[0]
    assert first["step"] == "env" and first["usable"] is False
    assert first["versions"]["torch"] == torch.__version__
