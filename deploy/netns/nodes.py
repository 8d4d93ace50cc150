"""The rehearsal's two nodes: names and addresses, commands, network namespaces, ``ray start``.

:class:`Cluster` holds one rehearsal's names, addresses and recorded processes (what
``state.json`` holds); the functions make the two namespaces and their veth link and start a Ray
node in each. Every command is logged before it runs.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class RehearsalError(RuntimeError):
    """A step failed; the message says which and where its log is."""


@dataclass
class Cluster:
    """Names, addresses and recorded processes of one rehearsal (what ``state.json`` holds)."""

    prefix: str
    subnet: str
    work_dir: Path
    port: int = 6379
    processes: dict[str, int] = field(default_factory=dict)

    @property
    def head_ns(self) -> str:
        return f"{self.prefix}-head"

    @property
    def worker_ns(self) -> str:
        return f"{self.prefix}-work"

    @property
    def links(self) -> tuple[str, str]:
        """The veth pair's two ends (head side, worker side); names fit Linux's 15 characters."""
        return f"{self.prefix}-h", f"{self.prefix}-w"

    @property
    def head_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def worker_ip(self) -> str:
        return f"{self.subnet}.2"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.work_dir / "state.json"

    def save(self) -> None:
        """Write ``state.json``, so that a later ``--teardown`` finds what this run made."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "prefix": self.prefix,
            "namespaces": [self.head_ns, self.worker_ns],
            "links": list(self.links),
            "processes": self.processes,
        }
        self.state_file.write_text(json.dumps(state, indent=1))


def run_logged(command: list[str], timeout_s: float = 60.0, check: bool = True) -> str:
    """Run a short command, log it, return its stdout."""
    logger.info("$ %s", shlex.join(command))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RehearsalError(f"`{shlex.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def in_ns(ns: str, command: list[str]) -> list[str]:
    """``command`` run inside the network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *command]


def preflight() -> None:
    """Refuse early, with the fix, where the rehearsal cannot run."""
    if os.geteuid() != 0:
        raise RehearsalError("network namespaces need root: run it with sudo (or as root)")
    if shutil.which("ip") is None:
        raise RehearsalError("`ip` (iproute2) is not installed: apt-get install iproute2")
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RehearsalError(f"`ip netns` does not work here: {done.stderr.strip()}")


def make_network(cluster: Cluster) -> None:
    """Two namespaces joined by a veth pair, one address each, loopback up."""
    head_link, worker_link = cluster.links
    for ns in (cluster.head_ns, cluster.worker_ns):
        run_logged(["ip", "netns", "add", ns])
    run_logged(
        [
            "ip",
            "link",
            "add",
            head_link,
            "netns",
            cluster.head_ns,
            "type",
            "veth",
            "peer",
            "name",
            worker_link,
            "netns",
            cluster.worker_ns,
        ]
    )
    for ns, link, ip in (
        (cluster.head_ns, head_link, cluster.head_ip),
        (cluster.worker_ns, worker_link, cluster.worker_ip),
    ):
        run_logged(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", link])
        run_logged(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_logged(["ip", "-n", ns, "link", "set", link, "up"])


def cluster_env(token: str | None) -> dict[str, str]:
    """The environment of every Ray process and driver of the rehearsal."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "GLOO_SOCKET")) and k != "RAY_TMPDIR"
    }
    if token is None:
        env["RAY_AUTH_MODE"] = "disabled"
    else:
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = token
    env.update(
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
        HF_DATASETS_OFFLINE=env.get("HF_DATASETS_OFFLINE", "1"),
        TOKENIZERS_PARALLELISM="false",
        # A loaded machine can take longer than Ray's defaults to start a node's agents.
        RAY_agent_register_timeout_ms="120000",
        RAY_worker_register_timeout_seconds="120",
    )
    return env


def start_node(
    cluster: Cluster, role: str, argv: list[str], env: dict[str, str], ns: str
) -> subprocess.Popen[bytes]:
    """``ray start ... --block`` in ``ns``, in its own process group, recorded before it runs."""
    log = cluster.work_dir / f"{role}.log"
    command = in_ns(ns, argv)
    logger.info("$ %s  > %s", shlex.join(command), log)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.processes[role] = process.pid  # its pid is its process group's id
    cluster.save()
    return process


def ray_start(cluster: Cluster, head: bool, num_cpus: int) -> list[str]:
    """The ``ray start`` command line of the head or of the worker node."""
    ray = str(Path(sys.executable).with_name("ray"))
    common = [f"--num-cpus={num_cpus}", "--disable-usage-stats", "--block"]
    if head:
        return [
            ray,
            "start",
            "--head",
            f"--node-ip-address={cluster.head_ip}",
            f"--port={cluster.port}",
            f"--temp-dir={cluster.work_dir / 'h'}",
            "--include-dashboard=false",
            *common,
        ]
    return [
        ray,
        "start",
        f"--address={cluster.address}",
        f"--node-ip-address={cluster.worker_ip}",
        f"--temp-dir={cluster.work_dir / 'w'}",
        *common,
    ]


def wait_running(process: subprocess.Popen[bytes], log: Path, probe: Any) -> Any:
    """``probe()``, failing at once with the node's log if its ``ray start`` already exited."""
    if process.poll() is not None:
        tail = log.read_text(errors="replace")[-3000:]
        raise RehearsalError(f"ray start exited with {process.returncode}; {log}:\n{tail}")
    return probe()
