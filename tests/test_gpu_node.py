"""What a first run on a GPU node needs, checked without a GPU: the demo stays on the CPU, CPU
ranks see no GPU and GPU ranks get their allocator setting, the interface pin covers NCCL, kept
GPU ranks empty the CUDA cache, and a CPU build of torch asked for CUDA names the one install
command (the same as the GPU check's). What needs a GPU itself (NCCL bound to the rank's device,
the allocator setting taking effect) is `make gpu-check`'s: nothing here mocks Ray or
torch.distributed."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rayeval.actors.batches import ModelSpec, RankOptions
from rayeval.actors.layout import DeviceKind, RankCoord
from rayeval.actors.process import (
    CUDA_ALLOC_CONF,
    INSTALL_CUDA_TORCH,
    pin_socket_interfaces,
    rank_environment,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ the demo on CPU
def test_the_served_demo_evaluation_runs_on_the_cpu() -> None:
    from rayeval.api.cli.demo import demo_body
    from rayeval.service.vocabulary.config import EvaluationConfig

    body = demo_body("/models/tiny")
    assert body["device"] == "cpu"
    assert body["model_args"] == {"pretrained": "/models/tiny", "dtype": "float32"}
    config = EvaluationConfig.model_validate(body)
    assert config.device == "cpu"
    assert (config.parallelism.num_replicas, config.parallelism.shard_size) == (2, 1)


def _demo_cli_command() -> list[str]:
    """``make demo-cli``'s ``rayeval run`` arguments, with the Makefile's variables filled in."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo-cli:", 1)[1].split("\n\n", 1)[0]
    line = recipe.replace("\\\n", " ").split("rayeval run", 1)[1].split("\n", 1)[0]
    line = re.sub(r"\$\((\w+)\)", lambda m: f"/tmp/{m.group(1).lower()}", line)
    return ["run", *shlex.split(line)]


def test_make_demo_cli_runs_on_the_cpu() -> None:
    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args

    argv = _demo_cli_command()
    assert argv[argv.index("--device") + 1] == "cpu", argv
    config, _ = config_from_args(build_parser().parse_args(argv))
    assert config.device == "cpu"
    assert (config.parallelism.num_replicas, config.parallelism.shard_size) == (2, 1)


# ------------------------------------------------------------------------ ranks' environments
def test_cpu_ranks_see_no_gpu_and_gpu_ranks_keep_ray_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cpu = rank_environment(DeviceKind.CPU)
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cpu
    gpu = rank_environment(DeviceKind.CUDA)
    assert "CUDA_VISIBLE_DEVICES" not in gpu  # Ray sets it to the rank's one GPU
    assert gpu["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert rank_environment(DeviceKind.CUDA)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch's newer name
    gpu = rank_environment(DeviceKind.CUDA)
    assert gpu["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in gpu


def test_the_interface_pin_sets_gloo_s_and_nccl_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    interfaces = {
        "lo": [SimpleNamespace(address="127.0.0.1")],
        "eth1": [SimpleNamespace(address="10.0.0.7")],
    }
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        # setenv first, so that the undo restores this process's own state: the pin writes
        # os.environ itself, and a fake interface left there breaks every later gloo group.
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    pin_socket_interfaces("10.0.0.7")
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "eth1"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # a user's own value is kept
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    pin_socket_interfaces("10.0.0.7")
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth1", "ib0")


# --------------------------------------------------------------------------------- the ranks
def _worker(device: DeviceKind) -> Any:
    """A rank object as Ray would build it (its constructor only: nothing is loaded)."""
    from rayeval.actors.worker import ShardWorker

    return ShardWorker(ModelSpec(pretrained="/m"), RankCoord(0, 1, 1), RankOptions(2, device))


def test_kept_gpu_ranks_empty_the_cache_between_evaluations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    cpu = _worker(DeviceKind.CPU)
    cpu._rank = object()
    cpu.begin_evaluation(7)
    assert emptied == []
    gpu = _worker(DeviceKind.CUDA)
    gpu._rank = object()
    gpu.begin_evaluation(7)
    assert emptied == [True]


def test_a_cpu_torch_asked_for_cuda_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from rayeval.actors.errors import ModelLoadError

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    worker = _worker(DeviceKind.CUDA)
    with pytest.raises(ModelLoadError) as info:
        worker._select_device()
    message = str(info.value)
    assert INSTALL_CUDA_TORCH in message and "--device cpu" in message, message


def test_the_gpu_check_names_the_same_install_command() -> None:
    """benchmarks/gpu_check.py imports nothing of the product's: its copy must stay the same."""
    tree = ast.parse((ROOT / "benchmarks" / "gpu_check.py").read_text())
    values = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "INSTALL_CUDA_TORCH" for t in node.targets)
    ]
    assert values == [INSTALL_CUDA_TORCH]
    assert INSTALL_CUDA_TORCH in (ROOT / "README.md").read_text()
