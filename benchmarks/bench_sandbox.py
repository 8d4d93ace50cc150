"""The server while hostile candidates run in the sandbox: status latency, idle and under load.

Starts ``rayeval serve --allow-code-execution`` (embedded Ray, SQLite, the bundled tiny model),
runs one short demo evaluation to have something to read, then polls ``GET /evaluations/{id}``
from 10 pollers (each every 50 ms) for a while with nothing else running, and again while 200
hostile candidates (fork bombs, alarm-proof loops, 8 GB allocations, sockets, writes outside
``/tmp``, ``setsid`` daemons, and correct ones) are scored by the sandboxed code_eval in this
process, 4 at a time, as a code task's scoring runs them. Prints the pollers' latency
percentiles side by side, the candidates' outcomes, their rate, and the processes left behind
(there must be none).

Usage: ``python benchmarks/bench_sandbox.py [--candidates 200] [--json out.json]``. Needs
bwrap (``make install``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_harness import (
    demo_body,
    free_port,
    start_server,
    stop_server,
    wait_finished,
    wait_ready,
)

POLLERS = 10
INTERVAL_S = 0.05

HOSTILE = {
    "fork bomb": "import posix\ndef f():\n    while True:\n        posix.fork()",
    "loop": "def f():\n    while True:\n        try:\n            while True:\n"
    "                pass\n        except BaseException:\n            pass",
    "8 GB": "def f():\n    return len(bytearray(8 * 2**30))",
    "socket": "import socket\ndef f():\n    socket.create_connection(('1.1.1.1', 53), 0.5)",
    "write /etc": "def f():\n    open('/etc/rayeval-bench', 'w').write('x')",
    "daemon": "import posix, time\ndef f():\n    if posix.fork() == 0:\n        posix.setsid()\n"
    "        while True:\n            time.sleep(0.1)\n    return 1",
    "correct": "def f():\n    return 1",
}
TEST = "assert f() == 1"


def _poll(base: str, path: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get(path).raise_for_status()
            latencies.append(time.perf_counter() - started)
            stop.wait(INTERVAL_S)


def _polled(base: str, path: str, work: Any) -> tuple[list[float], Any]:
    """Latencies of :data:`POLLERS` pollers of ``path`` while ``work()`` runs, and its value."""
    stop = threading.Event()
    latencies: list[float] = []
    threads = [
        threading.Thread(target=_poll, args=(base, path, stop, latencies), daemon=True)
        for _ in range(POLLERS)
    ]
    for thread in threads:
        thread.start()
    try:
        value = work()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return latencies, value


def _figures(latencies: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * cuts[98],
        "max_ms": 1000 * max(latencies),
    }


def _leftovers() -> int:
    import psutil

    from rayeval.service.sandbox.bwrap import UID_BASE

    return sum(
        1
        for p in psutil.process_iter(["uids", "name"])
        if p.info["name"] == "bwrap"
        or (p.info["uids"] is not None and p.info["uids"].real >= UID_BASE)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=15.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rayeval.service.demo import ensure_demo_assets
    from rayeval.service.sandbox.bwrap import check_available
    from rayeval.service.sandbox.metric import SandboxedCodeEval

    check_available()
    assets = ensure_demo_assets()
    kinds = list(HOSTILE)
    chosen = [kinds[i % len(kinds)] for i in range(args.candidates)]
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-sandbox-") as data_dir:
        port = free_port()
        server = start_server(assets, Path(data_dir), port, "--allow-code-execution")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base)
            body = demo_body(str(assets.model_dir), tasks=["demo_mc"], limit=4)
            created = httpx.post(f"{base}/evaluations", json=body, timeout=60).json()
            wait_finished(base, created["id"])
            path = f"/evaluations/{created['id']}"
            idle, _ = _polled(base, path, lambda: time.sleep(args.idle_s))
            metric = SandboxedCodeEval()
            started = time.perf_counter()
            loaded, (_, results) = _polled(
                base,
                path,
                lambda: metric.compute(
                    predictions=[[HOSTILE[k] for k in chosen]], references=[TEST], k=[1]
                ),
            )
            seconds = time.perf_counter() - started
        finally:
            stop_server(server)
    outcomes = Counter(
        (chosen[completion], answer["result"].split(":")[0]) for completion, answer in results[0]
    )
    report = {
        "idle": _figures(idle),
        "hostile": _figures(loaded),
        "candidates": args.candidates,
        "candidates_per_s": args.candidates / seconds,
        "outcomes": {f"{kind}: {result}": n for (kind, result), n in sorted(outcomes.items())},
        "left_running": _leftovers(),
    }
    print(f"{'status GET':>24} {'idle':>10} {'hostile':>10}")
    for key in ("requests", "p50_ms", "p99_ms", "max_ms"):
        print(f"{key:>24} {report['idle'][key]:10.1f} {report['hostile'][key]:10.1f}")
    print(f"{args.candidates} candidates in {seconds:.1f} s ({report['candidates_per_s']:.1f}/s)")
    for what, n in report["outcomes"].items():
        print(f"  {n:4d}  {what}")
    print(f"processes left running: {report['left_running']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["left_running"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
