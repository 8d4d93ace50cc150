"""Status reads under load: 100 pollers of ``GET /evaluations/{id}`` and 20 SSE clients.

Starts ``rayeval serve`` (embedded Ray, SQLite, the bundled tiny model; the response cache off,
so every evaluation computes), then:

1. runs the demo evaluation alone: its duration is the reference;
2. runs it again while 100 closed-loop pollers (each sends its next request as soon as the last
   one is answered) and 20 event-stream clients hit the server, and reports the pollers' latency
   percentiles, their request rate, and the evaluation's duration against (1);
3. the same with pollers that poll every second (what a dashboard does), each starting at a
   random phase within the second;
4. the same with all pollers started together: they stay in lockstep and hit the server as one
   burst of 100 requests every second (the worst case for the tail).

Usage: ``python benchmarks/bench_status.py [--pollers 100] [--streams 20] [--json out.json]``.
The load generator runs on the same machine as the server and the ranks (this is what a user on
one box sees), so its own CPU use is part of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_harness import (
    demo_body,
    free_port,
    seconds_between,
    start_server,
    stop_server,
    wait_finished,
    wait_ready,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-status-") as data_dir:
        port = free_port()
        server = start_server(assets, Path(data_dir), port)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            body = demo_body(str(assets.model_dir))
            alone = _run(base, body)
            print(f"evaluation alone: {alone['duration_s']:.1f}s")
            rows = {"alone": alone}
            for name, interval, spread in (
                ("closed_loop", 0.0, False),
                ("every_1s", 1.0, True),
                ("every_1s_lockstep", 1.0, False),
            ):
                loaded = asyncio.run(
                    _run_under_load(base, body, args.pollers, args.streams, interval, spread)
                )
                loaded["slowdown"] = loaded["duration_s"] / alone["duration_s"]
                rows[name] = loaded
                print(
                    f"{name:>12}: {loaded['requests']} polls, {loaded['requests_per_s']:.0f}/s, "
                    f"p50 {loaded['p50_ms']:.1f} ms, p99 {loaded['p99_ms']:.1f} ms, "
                    f"max {loaded['max_ms']:.1f} ms, errors {loaded['errors']}; evaluation "
                    f"{loaded['duration_s']:.1f}s ({loaded['slowdown']:.2f}x alone)"
                )
        finally:
            stop_server(server)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _run(base: str, body: dict[str, Any]) -> dict[str, Any]:
    evaluation = httpx.post(f"{base}/evaluations", json=body, timeout=120).json()
    return {"duration_s": _duration(wait_finished(base, evaluation["id"]))}


def _duration(state: dict[str, Any]) -> float:
    return seconds_between(state["started_at"], state["finished_at"])


class _LoadGenerator:
    """Pollers of one evaluation and clients of its event stream, until it has finished.

    Args:
        client: The aiohttp session (its base URL is the server's).
        path: ``/evaluations/{id}`` of the evaluation.
        interval_s: Seconds a poller waits after each answer (0: closed loop).
    """

    def __init__(self, client: Any, path: str, interval_s: float) -> None:
        self.client, self.path, self.interval_s = client, path, interval_s
        self.done = asyncio.Event()
        self.latencies: list[float] = []
        self.errors = 0

    async def poll(self, phase_s: float) -> None:
        """Poll from ``phase_s`` on until a poller sees the evaluation finished."""
        import aiohttp

        await asyncio.sleep(phase_s)
        while not self.done.is_set():
            sent = time.perf_counter()
            try:
                async with self.client.get(self.path) as response:
                    state = await response.json()
                self.latencies.append(time.perf_counter() - sent)
                if response.status != 200:
                    self.errors += 1
                elif state["status"] in ("succeeded", "failed", "cancelled"):
                    self.done.set()
            except aiohttp.ClientError:
                self.errors += 1
            if self.interval_s:
                await asyncio.sleep(self.interval_s)

    async def stream(self) -> None:
        """Read the event stream until the evaluation has finished."""
        async with self.client.get(f"{self.path}/events") as response:
            async for _ in response.content:
                if self.done.is_set():
                    return

    async def run(self, pollers: int, streams: int, spread: bool) -> float:
        """Every poller and stream until the evaluation has finished; the seconds that took."""
        started = time.perf_counter()
        # With ``spread``, pollers start at random phases of the interval, as independent
        # dashboards do; started together they stay in lockstep: one burst per interval.
        phases = random.Random(0)
        tasks = [
            asyncio.create_task(self.poll(phases.uniform(0, self.interval_s) if spread else 0.0))
            for _ in range(pollers)
        ]
        tasks += [asyncio.create_task(self.stream()) for _ in range(streams)]
        await asyncio.wait_for(self.done.wait(), timeout=1800)
        elapsed = time.perf_counter() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return elapsed


async def _run_under_load(
    base: str,
    body: dict[str, Any],
    pollers: int,
    streams: int,
    interval_s: float,
    spread: bool,
) -> dict[str, Any]:
    # aiohttp (a Ray dependency) as the load generator: httpx's async pool costs more CPU per
    # request than the server under test, on the same two cores.
    import aiohttp

    connector = aiohttp.TCPConnector(limit=pollers + streams + 10)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as client:
        async with client.post("/evaluations", json=body) as response:
            evaluation = await response.json()
        load = _LoadGenerator(client, f"/evaluations/{evaluation['id']}", interval_s)
        elapsed = await load.run(pollers, streams, spread)
        async with client.get(load.path) as response:
            final = await response.json()
    ordered = sorted(load.latencies)
    return {
        "duration_s": _duration(final),
        "requests": len(load.latencies),
        "requests_per_s": len(load.latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "max_ms": 1000 * ordered[-1],
        "errors": load.errors,
    }


if __name__ == "__main__":
    sys.exit(main())
