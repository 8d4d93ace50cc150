"""The rehearsal's evaluations: ``rayeval run`` per layout on the cluster, and lm-eval's reference.

:class:`LayoutSpec` is a layout as given on the command line; :func:`evaluate` runs one from the
head's namespace and reads where its ranks ran; :func:`check_layout` checks that it used both
nodes; :func:`reference` and :func:`same_as_reference` compare its results with lm-eval's own
``hf`` backend.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.netns.cleanup import stop_groups
from deploy.netns.nodes import Cluster, RehearsalError, in_ns
from rayeval.service.parity import assert_same_results
from rayeval.service.result_files import read_outputs

logger = logging.getLogger(__name__)

#: Seconds for one evaluation.
EVAL_TIMEOUT_S = 600.0
#: One rank in ``rayeval run``'s ``ranks:`` line.
RANK_ENTRY = re.compile(
    r"r(?P<replica>\d+)\.s(?P<shard>\d+) on (?P<ip>\S+) \(node (?P<node>\w+), pid (?P<pid>\d+)\)"
)


@dataclass(frozen=True)
class LayoutSpec:
    """``RxG`` or ``RxG:placement`` as given on the command line."""

    replicas: int
    shard_size: int
    placement: str = "auto"

    @classmethod
    def parse(cls, text: str) -> LayoutSpec:
        shape, _, placement = text.partition(":")
        try:
            replicas, shard_size = (int(part) for part in shape.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a layout: write RxG or RxG:placement, e.g. 1x2:spread"
            ) from None
        return cls(replicas, shard_size, placement or "auto")

    @property
    def name(self) -> str:
        shape = f"{self.replicas}x{self.shard_size}"
        return shape if self.placement == "auto" else f"{shape}:{self.placement}"


def lm_eval_args(model_dir: str, tasks_dir: str, tasks: str, limit: int) -> list[str]:
    """The options rayeval and lm-eval's reference run share (lm-eval's own flags)."""
    return [
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=float32",
        "--include_path",
        tasks_dir,
        "--tasks",
        tasks,
        "--limit",
        str(limit),
        "--num_fewshot",
        "2",
        "--gen_kwargs",
        "max_gen_toks=5",
        "--seed",
        "7",
        "--log_samples",
    ]


def evaluate(
    cluster: Cluster, env: dict[str, str], layout: LayoutSpec, shared: list[str], out: Path
) -> dict[str, Any]:
    """``rayeval run`` on the cluster from the head's namespace; where its ranks ran."""
    rayeval = str(Path(sys.executable).with_name("rayeval"))
    argv = [
        rayeval,
        "run",
        "--address",
        cluster.address,
        *shared,
        "--device",
        "cpu",
        "--batch_size",
        "auto",
        "--num_replicas",
        str(layout.replicas),
        "--shard_size",
        str(layout.shard_size),
        "--placement",
        layout.placement,
        "--output_path",
        str(out),
    ]
    log = cluster.work_dir / f"driver-{layout.name.replace(':', '-')}.log"
    command = in_ns(cluster.head_ns, argv)
    logger.info("$ %s  > %s", shlex.join(command), log)
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        cluster.processes["driver"] = process.pid
        cluster.save()
        try:
            process.wait(timeout=EVAL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_groups([process.pid])
            raise RehearsalError(
                f"rayeval run {layout.name} outlasted {EVAL_TIMEOUT_S:g}s; see {log}"
            ) from None
        finally:
            cluster.processes.pop("driver", None)
            cluster.save()
    text = log.read_text(errors="replace")
    if process.returncode != 0:
        raise RehearsalError(f"rayeval run {layout.name} failed; {log}:\n{text[-3000:]}")
    ranks = parse_ranks(text)
    if len(ranks) != layout.replicas * layout.shard_size:
        raise RehearsalError(f"rayeval run {layout.name} reported ranks {ranks}; see {log}")
    return {"ranks": ranks, "seconds": round(time.monotonic() - started, 1), "log": str(log)}


def parse_ranks(output: str) -> list[dict[str, Any]]:
    """``rayeval run``'s ``ranks: r0.s0 on 10.77.0.1 (node 1a2b3c4d, pid 12); ...`` line."""
    lines = [line for line in output.splitlines() if line.startswith("ranks: ")]
    if not lines:
        return []
    return [
        {
            "replica": int(match["replica"]),
            "shard_rank": int(match["shard"]),
            "ip": match["ip"],
            "node": match["node"],
            "pid": int(match["pid"]),
        }
        for match in RANK_ENTRY.finditer(lines[-1])
    ]


def check_layout(cluster: Cluster, layout: LayoutSpec, ranks: list[dict[str, Any]]) -> None:
    """Both nodes ran ranks, and a lone replica asked to spread spans both."""
    used = {rank["ip"] for rank in ranks}
    if used != {cluster.head_ip, cluster.worker_ip}:
        raise RehearsalError(f"layout {layout.name} ran on {sorted(used)}, not on both nodes")
    spans = {rank["ip"] for rank in ranks if rank["replica"] == 0}
    if layout.placement == "spread" and layout.replicas == 1 and len(spans) != 2:
        raise RehearsalError(f"layout {layout.name}: the replica did not span the nodes")


def reference(shared: list[str], out: Path, env: dict[str, str], log: Path) -> None:
    """lm-eval's own ``hf`` backend, in this (the root) namespace, on the CPU in fp32."""
    lm_eval = str(Path(sys.executable).with_name("lm_eval"))
    command = [
        lm_eval,
        "run",
        *shared,
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(out),
    ]
    logger.info("$ %s  > %s", shlex.join(command), log)
    with log.open("wb") as sink:
        done = subprocess.run(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=EVAL_TIMEOUT_S
        )
    if done.returncode != 0:
        raise RehearsalError(f"lm_eval run failed; see {log}")


def same_as_reference(ref: Path, ours: Path) -> None:
    """Per-sample results and metrics equal (|delta logprob| <= 1e-4, as the tests hold them)."""

    _, ref_results, ref_samples = read_outputs(ref)
    _, our_results, our_samples = read_outputs(ours)
    try:
        assert_same_results(
            {"results": ref_results["results"], "samples": ref_samples},
            {"results": our_results["results"], "samples": our_samples},
        )
    except AssertionError as exc:
        raise RehearsalError(f"{ours} differs from lm-eval's hf backend: {exc}") from None
