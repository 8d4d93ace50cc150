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
   checks that every layout's per-sample results and metrics equal it (``rayeval.service.parity``).
6. Tears everything down — also on failure or Ctrl-C — by the recorded process groups, then by
   any process that names the work directory, then the namespaces (which take the link along).

``--report FILE`` writes what it saw as JSON; ``tests/test_netns.py`` runs this script. The
steps live beside it: ``nodes.py`` (1-3: commands, namespaces, ``ray start``), ``layouts.py``
(4-5: the evaluations and the comparison) and ``cleanup.py`` (6: tear-down). See
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
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file: the repository's packages (deploy)
    sys.path.insert(0, str(REPO))

from deploy.netns.cleanup import teardown  # noqa: E402
from deploy.netns.layouts import (  # noqa: E402
    LayoutSpec,
    check_layout,
    evaluate,
    lm_eval_args,
    reference,
    same_as_reference,
)
from deploy.netns.nodes import (  # noqa: E402
    Cluster,
    RehearsalError,
    cluster_env,
    in_ns,
    make_network,
    preflight,
    ray_start,
    start_node,
    wait_running,
)

logger = logging.getLogger("rehearsal")

DEFAULT_LAYOUTS = ("2x1", "1x2:spread")
DEFAULT_TASKS = "demo_gen_short,demo_mc"
#: Seconds for one node to start, and for both to be seen.
NODE_TIMEOUT_S = 180.0


def helper(cluster: Cluster, ns: str, env: dict[str, str], *args: str, timeout_s: float) -> Any:
    """Run this script's internal ``_probe`` subcommand in ``ns``; return its JSON answer."""
    command = in_ns(ns, [sys.executable, __file__, "_probe", *args])
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


# ----------------------------------------------------------------------------- steps 2-5
def _model_and_tasks(args: argparse.Namespace) -> tuple[str, str]:
    """``--model-dir`` and ``--tasks-dir`` if both are given, else the bundled demo's."""
    if args.model_dir and args.tasks_dir:
        return str(args.model_dir), str(args.tasks_dir)
    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    return str(assets.model_dir), str(assets.tasks_dir)


def _auth_token(args: argparse.Namespace, cluster: Cluster) -> str | None:
    """A fresh token (None with ``--no-auth``), kept readable by root only in the work dir."""
    token = None if args.no_auth else secrets.token_hex(32)
    if token is not None:  # for the operator's own `ray status` while it runs; never logged
        token_file = cluster.work_dir / "auth_token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
    return token


def bring_up(cluster: Cluster, env: dict[str, str], num_cpus: int) -> Any:
    """Steps 2-3: the network, the head, then the worker node; the nodes Ray sees alive.

    Raises:
        RehearsalError: A node did not start or join, with the tail of both nodes' logs.
    """
    make_network(cluster)
    head = start_node(cluster, "head", ray_start(cluster, True, num_cpus), env, cluster.head_ns)
    wait_running(
        head,
        cluster.work_dir / "head.log",
        lambda: helper(
            cluster,
            cluster.worker_ns,
            env,
            "port",
            cluster.address,
            str(NODE_TIMEOUT_S),
            timeout_s=NODE_TIMEOUT_S,
        ),
    )
    worker = start_node(
        cluster, "worker", ray_start(cluster, False, num_cpus), env, cluster.worker_ns
    )
    try:
        return wait_running(
            worker,
            cluster.work_dir / "worker.log",
            lambda: helper(
                cluster,
                cluster.head_ns,
                env,
                "nodes",
                cluster.address,
                f"{cluster.head_ip},{cluster.worker_ip}",
                str(NODE_TIMEOUT_S),
                timeout_s=NODE_TIMEOUT_S,
            ),
        )
    except RehearsalError as exc:
        tails = "\n".join(
            f"--- {log}:\n" + log.read_text(errors="replace")[-2000:]
            for log in (cluster.work_dir / "head.log", cluster.work_dir / "worker.log")
        )
        raise RehearsalError(f"{exc}\n{tails}") from None


def check_refusal(cluster: Cluster, env: dict[str, str]) -> Any:
    """A driver with a wrong token is refused; why, as Ray said it."""
    wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    refused = helper(
        cluster, cluster.head_ns, wrong, "refused", cluster.address, "60", timeout_s=60
    )
    logger.info("a driver with a wrong token was refused: %s", refused)
    return refused


def run_layouts(
    cluster: Cluster, env: dict[str, str], layouts: list[LayoutSpec], shared: list[str]
) -> dict[str, Any]:
    """Step 4: every layout evaluated on the cluster and checked to use both nodes."""
    records: dict[str, Any] = {}
    for layout in layouts:
        out = cluster.work_dir / "out" / layout.name.replace(":", "-")
        record = evaluate(cluster, env, layout, shared, out)
        check_layout(cluster, layout, record["ranks"])
        record["output_path"] = str(out)
        records[layout.name] = record
        logger.info(
            "%s: ranks %s (%.0fs)",
            layout.name,
            [(r["replica"], r["shard_rank"], r["ip"]) for r in record["ranks"]],
            record["seconds"],
        )
    return records


def compare_with_reference(
    cluster: Cluster, env: dict[str, str], shared: list[str], layouts: dict[str, Any]
) -> str:
    """Step 5: lm-eval's hf backend, and every layout's results equal to it; its output path."""
    ref = cluster.work_dir / "out" / "lm-eval-hf"
    reference(shared, ref, env, cluster.work_dir / "reference.log")
    for name, record in layouts.items():
        same_as_reference(ref, Path(record["output_path"]))
        record["same_as_lm_eval_hf"] = True
        logger.info("%s: results identical to lm-eval's hf backend", name)
    return str(ref)


def rehearse(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    """Steps 2-5 of the module docstring; returns the report."""
    timings: dict[str, float] = {}
    started = time.monotonic()
    model_dir, tasks_dir = _model_and_tasks(args)
    token = _auth_token(args, cluster)
    env = cluster_env(token)
    nodes = bring_up(cluster, env, args.num_cpus)
    timings["cluster_up_s"] = round(time.monotonic() - started, 1)
    logger.info("cluster up: %s", nodes)
    refused = check_refusal(cluster, env) if token is not None and args.refusal_check else None
    shared = lm_eval_args(model_dir, tasks_dir, args.tasks, args.limit)
    layouts = run_layouts(cluster, env, args.layouts, shared)
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
        report["reference_path"] = compare_with_reference(cluster, env, shared, layouts)
    return report


# ----------------------------------------------------------------------------- main
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
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="logs, Ray temp dirs, outputs (default /tmp/<prefix>; keep it short: "
        "Ray's socket paths must stay under 107 characters)",
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="logical CPUs per node")
    parser.add_argument(
        "--layouts",
        type=LayoutSpec.parse,
        nargs="+",
        default=[LayoutSpec.parse(text) for text in DEFAULT_LAYOUTS],
        help="RxG[:auto|pack|spread] (default: 2x1 1x2:spread)",
    )
    parser.add_argument("--model-dir", help="a local HF model (default: the bundled demo model)")
    parser.add_argument("--tasks-dir", help="task YAMLs (default: the bundled demo tasks)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip lm-eval's hf run and the comparison",
    )
    parser.add_argument("--no-auth", action="store_true", help="RAY_AUTH_MODE=disabled")
    parser.add_argument(
        "--no-refusal-check",
        dest="refusal_check",
        action="store_false",
        help="skip checking that a wrong token is refused (~20 s)",
    )
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
            print(
                f"left running: head {cluster.address} (namespace {cluster.head_ns}); "
                f"remove with --teardown --prefix {cluster.prefix} "
                f"--work-dir {cluster.work_dir}"
            )
        else:
            teardown(cluster)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
