"""Rehearsal for a real cluster: a two-node Ray cluster on this machine, one node per network
namespace, each with its own address, and rayeval evaluations whose layouts need both nodes.

What it does (as root; Linux with ``ip netns``), printing every command it runs:

1. Removes what a previous run with the same ``--prefix`` left behind (processes, by the pids it
   recorded in ``<work dir>/state.json``; namespaces; links).
2. Makes two network namespaces, ``<prefix>-head`` and ``<prefix>-work``, joined by a veth pair:
   ``<subnet>.1`` and ``<subnet>.2``. Nothing else is reachable from them, so the cluster talks
   only over that link, as two machines would, and its ports cannot collide with anything on the
   host.
3. Starts a Ray head in the first (``ray start --head --node-ip-address <subnet>.1 --block``) and a
   worker node in the second (``ray start --address <subnet>.1:<port> --node-ip-address
   <subnet>.2 --block``), each with its own ``--temp-dir``. Token authentication is on, as Ray
   turns it on for a new cluster: a fresh token goes to every process as ``RAY_AUTH_TOKEN``
   (``~/.ray/auth_token`` is left alone), and a driver with a wrong token must be refused.
4. Runs ``rayeval run --address <subnet>.1:<port>`` in the head's namespace (the driver on the
   head, as ``ray job submit`` runs it) for each layout: by default ``2x1`` (replicas spread over
   the nodes) and ``1x2:spread`` (one replica whose two FSDP2 ranks are on different nodes, so
   every all-gather crosses the link). It checks, from what every rank actor reports, that the
   layout used both nodes' addresses.
5. Runs lm-eval's own ``hf`` backend on the same model, tasks and options (``--reference``), and
   checks that every layout's per-sample results and metrics equal it (``tests.helpers``).
6. Tears everything down — also on failure or Ctrl-C — by the recorded process groups, then by
   any process that names the work directory, then the namespaces (which take the link along).

``--report FILE`` writes what it saw as JSON; ``tests/test_netns.py`` runs this script. See
``deploy/README.md`` ("Rehearsal for a real cluster") for how each step maps to real nodes.

Usage (from the repository root, with the project's virtual environment)::

    sudo .venv/bin/python deploy/netns/rehearsal.py            # demo model and tasks
    sudo .venv/bin/python deploy/netns/rehearsal.py --teardown # remove leftovers only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file: the repository's packages (tests.helpers)
    sys.path.insert(0, str(REPO))

logger = logging.getLogger("rehearsal")

DEFAULT_LAYOUTS = ("2x1", "1x2:spread")
DEFAULT_TASKS = "demo_gen_short,demo_mc"
#: Seconds for one node to start, for both to be seen, for one evaluation.
NODE_TIMEOUT_S = 180.0
EVAL_TIMEOUT_S = 600.0
#: Seconds a process group has to exit after SIGTERM before it gets SIGKILL.
STOP_GRACE_S = 10.0
#: One rank in ``rayeval run``'s ``ranks:`` line.
RANK_ENTRY = re.compile(
    r"r(?P<replica>\d+)\.s(?P<shard>\d+) on (?P<ip>\S+) \(node (?P<node>\w+), pid (?P<pid>\d+)\)"
)


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
        self.work_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "prefix": self.prefix,
            "namespaces": [self.head_ns, self.worker_ns],
            "links": list(self.links),
            "processes": self.processes,
        }
        self.state_file.write_text(json.dumps(state, indent=1))


# ----------------------------------------------------------------------------- commands
def _run(command: list[str], timeout_s: float = 60.0, check: bool = True) -> str:
    """Run a short command, log it, return its stdout."""
    logger.info("$ %s", shlex.join(command))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RehearsalError(f"`{shlex.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def _in_ns(ns: str, command: list[str]) -> list[str]:
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
        _run(["ip", "netns", "add", ns])
    _run(["ip", "link", "add", head_link, "netns", cluster.head_ns, "type", "veth",
          "peer", "name", worker_link, "netns", cluster.worker_ns])  # fmt: skip
    for ns, link, ip in (
        (cluster.head_ns, head_link, cluster.head_ip),
        (cluster.worker_ns, worker_link, cluster.worker_ip),
    ):
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", link])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", link, "up"])


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
    command = _in_ns(ns, argv)
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
        return [ray, "start", "--head", f"--node-ip-address={cluster.head_ip}",
                f"--port={cluster.port}", f"--temp-dir={cluster.work_dir / 'h'}",
                "--include-dashboard=false", *common]  # fmt: skip
    return [ray, "start", f"--address={cluster.address}",
            f"--node-ip-address={cluster.worker_ip}", f"--temp-dir={cluster.work_dir / 'w'}",
            *common]  # fmt: skip


def helper(cluster: Cluster, ns: str, env: dict[str, str], *args: str, timeout_s: float) -> Any:
    """Run this script's internal ``_probe`` subcommand in ``ns``; return its JSON answer."""
    command = _in_ns(ns, [sys.executable, __file__, "_probe", *args])
    logger.info("$ %s", shlex.join(command))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s + 30)
    if done.returncode != 0:
        raise RehearsalError(f"{args[0]} failed: {done.stderr.strip()[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if args[0] == "refused":  # Ray's client logs why the GCS turned it away, on stderr
        why = [line for line in done.stderr.splitlines() if "Unauthenticated" in line]
        if not why and "token" not in answer.lower():
            raise RehearsalError(f"a driver was refused, but not for its token: {answer}")
        answer = why[-1].split("] ", 1)[-1] if why else answer
    return answer


def wait_running(process: subprocess.Popen[bytes], log: Path, probe: Any) -> Any:
    """``probe()``, failing at once with the node's log if its ``ray start`` already exited."""
    if process.poll() is not None:
        tail = log.read_text(errors="replace")[-3000:]
        raise RehearsalError(f"ray start exited with {process.returncode}; {log}:\n{tail}")
    return probe()


# ----------------------------------------------------------------------------- evaluations
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
        "--model", "hf",
        "--model_args", f"pretrained={model_dir},dtype=float32",
        "--include_path", tasks_dir,
        "--tasks", tasks,
        "--limit", str(limit), "--num_fewshot", "2", "--gen_kwargs", "max_gen_toks=5",
        "--seed", "7", "--log_samples",
    ]  # fmt: skip


def evaluate(
    cluster: Cluster, env: dict[str, str], layout: LayoutSpec, shared: list[str], out: Path
) -> dict[str, Any]:
    """``rayeval run`` on the cluster from the head's namespace; where its ranks ran."""
    rayeval = str(Path(sys.executable).with_name("rayeval"))
    argv = [rayeval, "run", "--address", cluster.address, *shared, "--device", "cpu",
            "--batch_size", "auto", "--num_replicas", str(layout.replicas),
            "--shard_size", str(layout.shard_size), "--placement", layout.placement,
            "--output_path", str(out)]  # fmt: skip
    log = cluster.work_dir / f"driver-{layout.name.replace(':', '-')}.log"
    command = _in_ns(cluster.head_ns, argv)
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
    command = [lm_eval, "run", *shared, "--device", "cpu", "--batch_size", "4",
               "--output_path", str(out)]  # fmt: skip
    logger.info("$ %s  > %s", shlex.join(command), log)
    with log.open("wb") as sink:
        done = subprocess.run(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=EVAL_TIMEOUT_S
        )
    if done.returncode != 0:
        raise RehearsalError(f"lm_eval run failed; see {log}")


def same_as_reference(ref: Path, ours: Path) -> None:
    """Per-sample results and metrics equal (tests.helpers: |delta logprob| <= 1e-4)."""
    from tests.helpers import assert_same_results, read_outputs

    _, ref_results, ref_samples = read_outputs(ref)
    _, our_results, our_samples = read_outputs(ours)
    try:
        assert_same_results(
            {"results": ref_results["results"], "samples": ref_samples},
            {"results": our_results["results"], "samples": our_samples},
        )
    except AssertionError as exc:
        raise RehearsalError(f"{ours} differs from lm-eval's hf backend: {exc}") from None


# ----------------------------------------------------------------------------- tear-down
def _owned_pids(cluster: Cluster) -> list[int]:
    """Processes whose command line names the rehearsal's Ray temp dirs or outputs: its nodes'
    processes, Ray's workers and the driver (never this process or what started it)."""
    markers = tuple(str(cluster.work_dir / part) for part in ("h", "w", "out"))
    ours = _ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if any(marker in cmdline for marker in markers):
                found.append(int(entry.name))
    return found


def _ancestors() -> set[int]:
    """This process and every process above it."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie, exited but not yet reaped by its
    parent, does not count)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    return False


def stop_groups(pgids: list[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM process groups we started (``ray start --block`` stops its node); SIGKILL what
    is left of them after ``grace_s``."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_group_alive(pgid) for pgid in pgids) and time.monotonic() < deadline:
        for pgid in pgids:  # reap our own children, or they stay as zombies of the group
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-pgid, os.WNOHANG)
        time.sleep(0.2)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def teardown(cluster: Cluster) -> None:
    """Remove everything a rehearsal with this prefix and work dir made; safe to repeat."""
    recorded: dict[str, int] = {}
    if cluster.state_file.exists():
        with contextlib.suppress(ValueError, OSError):
            recorded = json.loads(cluster.state_file.read_text()).get("processes", {})
    recorded.update(cluster.processes)
    # Only groups that still hold a process of ours (pids are reused).
    live = {_pgid(pid) for pid in _owned_pids(cluster)}
    groups = {role: pgid for role, pgid in recorded.items() if pgid in live}
    if groups:
        logger.info("stopping %s", ", ".join(f"{r} (process group {g})" for r, g in groups.items()))
        stop_groups(list(groups.values()))
    for pid in _owned_pids(cluster):  # Ray processes that left the groups, by pid
        logger.info("killing leftover process %d", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.processes.clear()
    existing = _run(["ip", "netns", "list"], check=False)
    for ns in (cluster.head_ns, cluster.worker_ns):
        if any(line.split()[0] == ns for line in existing.splitlines() if line.strip()):
            _run(["ip", "netns", "del", ns], check=False)  # takes its end of the veth along
    for link in cluster.links:  # an end left in this namespace by a failed set-up
        if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
            _run(["ip", "link", "del", link], check=False)
    if cluster.state_file.exists():
        cluster.save()


# ----------------------------------------------------------------------------- main
def rehearse(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    """Steps 2-5 of the module docstring; returns the report."""
    timings: dict[str, float] = {}
    started = time.monotonic()
    if args.model_dir and args.tasks_dir:
        model_dir, tasks_dir = str(args.model_dir), str(args.tasks_dir)
    else:
        from rayeval.service.demo import ensure_demo_assets

        assets = ensure_demo_assets()
        model_dir, tasks_dir = str(assets.model_dir), str(assets.tasks_dir)
    token = None if args.no_auth else secrets.token_hex(32)
    if token is not None:  # for the operator's own `ray status` while it runs; never logged
        token_file = cluster.work_dir / "auth_token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
    env = cluster_env(token)

    make_network(cluster)
    head = start_node(cluster, "head", ray_start(cluster, True, args.num_cpus), env,
                      cluster.head_ns)  # fmt: skip
    wait_running(head, cluster.work_dir / "head.log", lambda: helper(
        cluster, cluster.worker_ns, env, "port", cluster.address, str(NODE_TIMEOUT_S),
        timeout_s=NODE_TIMEOUT_S))  # fmt: skip
    worker = start_node(cluster, "worker", ray_start(cluster, False, args.num_cpus), env,
                        cluster.worker_ns)  # fmt: skip
    try:
        nodes = wait_running(worker, cluster.work_dir / "worker.log", lambda: helper(
            cluster, cluster.head_ns, env, "nodes", cluster.address,
            f"{cluster.head_ip},{cluster.worker_ip}", str(NODE_TIMEOUT_S),
            timeout_s=NODE_TIMEOUT_S))  # fmt: skip
    except RehearsalError as exc:
        tails = "\n".join(
            f"--- {log}:\n" + log.read_text(errors="replace")[-2000:]
            for log in (cluster.work_dir / "head.log", cluster.work_dir / "worker.log")
        )
        raise RehearsalError(f"{exc}\n{tails}") from None
    timings["cluster_up_s"] = round(time.monotonic() - started, 1)
    logger.info("cluster up: %s", nodes)
    refused = None
    if token is not None and args.refusal_check:
        wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        refused = helper(cluster, cluster.head_ns, wrong, "refused", cluster.address, "60",
                         timeout_s=60)  # fmt: skip
        logger.info("a driver with a wrong token was refused: %s", refused)

    shared = lm_eval_args(model_dir, tasks_dir, args.tasks, args.limit)
    layouts: dict[str, Any] = {}
    for layout in args.layouts:
        out = cluster.work_dir / "out" / layout.name.replace(":", "-")
        record = evaluate(cluster, env, layout, shared, out)
        check_layout(cluster, layout, record["ranks"])
        record["output_path"] = str(out)
        layouts[layout.name] = record
        logger.info("%s: ranks %s (%.0fs)", layout.name,
                    [(r["replica"], r["shard_rank"], r["ip"]) for r in record["ranks"]],
                    record["seconds"])  # fmt: skip
    report: dict[str, Any] = {
        "auth": "disabled" if token is None else "token",
        "wrong_token_refused": refused,
        "nodes": nodes,
        "head_ip": cluster.head_ip,
        "worker_ip": cluster.worker_ip,
        "lm_eval_args": shared,
        "layouts": layouts,
        "timings": timings,
    }
    if args.reference:
        ref = cluster.work_dir / "out" / "lm-eval-hf"
        reference(shared, ref, env, cluster.work_dir / "reference.log")
        for name, record in layouts.items():
            same_as_reference(ref, Path(record["output_path"]))
            record["same_as_lm_eval_hf"] = True
            logger.info("%s: results identical to lm-eval's hf backend", name)
        report["reference_path"] = str(ref)
    return report


def _probe(argv: list[str]) -> int:
    """Internal: run inside a namespace, print one JSON line (``port``, ``nodes``, ``refused``)."""
    import socket

    what, address, *rest = argv
    host, port = address.rsplit(":", 1)
    timeout_s = float(rest[-1])
    deadline = time.monotonic() + timeout_s
    if what == "port":  # the head's GCS answers on its address
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 2):
                print(json.dumps(address))
                return 0
            time.sleep(0.5)
        raise SystemExit(f"{address} did not answer within {timeout_s:g}s")
    import ray

    if what == "refused":  # a driver without the cluster's token must not get in
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except Exception as exc:  # refused; the caller checks that the token was the reason
            print(json.dumps(f"{type(exc).__name__}: {exc}"[:500]))
            return 0
        ray.shutdown()
        raise SystemExit(f"a driver with a wrong token connected to {address}")
    expected = set(rest[0].split(","))
    ray.init(address=address, log_to_driver=False)
    while time.monotonic() < deadline:
        alive = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        if alive >= expected:
            print(json.dumps(sorted(alive)))
            return 0
        time.sleep(0.5)
    raise SystemExit(f"nodes {sorted(expected)} not all alive within {timeout_s:g}s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deploy/netns/rehearsal.py",
        description="Rehearse a two-node Ray cluster with rayeval in two network namespaces.",
    )
    parser.add_argument("--prefix", default="rvn", help="namespace/link name prefix (<= 8 chars)")
    parser.add_argument("--subnet", default="10.77.0", help="the /24 of the two nodes (a.b.c)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs, Ray temp dirs, outputs (default /tmp/<prefix>; keep it short: "
                        "Ray's socket paths must stay under 107 characters)")  # fmt: skip
    parser.add_argument("--num-cpus", type=int, default=2, help="logical CPUs per node")
    parser.add_argument("--layouts", type=LayoutSpec.parse, nargs="+",
                        default=[LayoutSpec.parse(text) for text in DEFAULT_LAYOUTS],
                        help="RxG[:auto|pack|spread] (default: 2x1 1x2:spread)")  # fmt: skip
    parser.add_argument("--model-dir", help="a local HF model (default: the bundled demo model)")
    parser.add_argument("--tasks-dir", help="task YAMLs (default: the bundled demo tasks)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip lm-eval's hf run and the comparison")  # fmt: skip
    parser.add_argument("--no-auth", action="store_true", help="RAY_AUTH_MODE=disabled")
    parser.add_argument("--no-refusal-check", dest="refusal_check", action="store_false",
                        help="skip checking that a wrong token is refused (~20 s)")  # fmt: skip
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the cluster running (tear it down later with --teardown)",
    )
    parser.add_argument("--teardown", action="store_true", help="only remove leftovers")
    parser.add_argument("--report", type=Path, help="write what was seen as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_probe":
        return _probe(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    if len(args.prefix) > 8 or not args.prefix.replace("-", "").isalnum():
        raise SystemExit("--prefix: at most 8 letters, digits or '-' (link names: 15 chars)")
    cluster = Cluster(args.prefix, args.subnet, (args.work_dir or Path(f"/tmp/{args.prefix}")))
    cluster.work_dir = cluster.work_dir.resolve()
    try:
        preflight()
    except RehearsalError as exc:
        print(f"rehearsal: {exc}", file=sys.stderr)
        return 2
    teardown(cluster)  # leftovers of an earlier run with this prefix and work dir
    if args.teardown:
        return 0
    for part in ("h", "w", "out"):  # an earlier run's Ray sessions and results
        shutil.rmtree(cluster.work_dir / part, ignore_errors=True)
    cluster.save()
    # SIGTERM (a test's timeout, a CI cancel) unwinds like Ctrl-C, through the tear-down below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed = True
    try:
        report = rehearse(args, cluster)
        failed = False
    except (RehearsalError, subprocess.TimeoutExpired) as exc:
        print(f"rehearsal: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep and not failed:
            print(f"left running: head {cluster.address} (namespace {cluster.head_ns}); "
                  f"remove with --teardown --prefix {cluster.prefix} "
                  f"--work-dir {cluster.work_dir}")  # fmt: skip
        else:
            teardown(cluster)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
