"""Shared by the service benchmarks: start ``rayeval serve`` on the bundled demo, submit, wait."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def start_server(
    assets: Any, data_dir: Path, port: int, *extra: str, response_cache: bool = False
) -> subprocess.Popen[bytes]:
    """``rayeval serve`` on the demo assets (embedded Ray, SQLite); ``extra``: more flags."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "RAYEVAL_RESPONSE_CACHE": "true" if response_cache else "false",
    }
    argv = [
        sys.executable, "-m", "rayeval.api.cli", "serve", "--port", str(port),
        "--data-dir", str(data_dir), "--include-path", str(assets.tasks_dir),
        "--model-root", str(assets.model_dir), "--log-level", "warning", *extra,
    ]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, env=env)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """Terminate the server (it releases what it holds), killing it after a minute."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def demo_body(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """The demo evaluation at 2x1, no bootstrap."""
    return {
        "model_args": {"pretrained": model_dir, "dtype": "float32"},
        "tasks": ["demo"],
        "bootstrap_iters": 0,
        "parallelism": {"num_replicas": 2, "shard_size": 1},
        **overrides,
    }


def wait_ready(base: str, timeout_s: float = 300.0) -> None:
    """Wait until ``/healthz`` answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server at {base} did not answer within {timeout_s:g}s")


def wait_finished(base: str, evaluation_id: str, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Poll until the evaluation succeeds and return it; exit naming the error otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(f"{base}/evaluations/{evaluation_id}", timeout=60).json()
        if state["status"] in ("succeeded", "failed", "cancelled"):
            if state["status"] != "succeeded":
                raise SystemExit(f"evaluation {evaluation_id} {state['status']}: {state['error']}")
            return dict(state)
        time.sleep(0.2)
    raise SystemExit(f"evaluation {evaluation_id} did not finish within {timeout_s:g}s")


def seconds_between(start: str, end: str) -> float:
    """Seconds from one ISO timestamp of the API to another."""
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_users(base: str, admin_token: str, names: list[str]) -> dict[str, str]:
    """Members ``names`` made over REST with the server's admin token; name -> API key."""
    keys = {}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_token}"}) as admin:
        for name in names:
            response = admin.post("/users", json={"name": name, "role": "member"}, timeout=60)
            response.raise_for_status()
            keys[name] = response.json()["key"]
    return keys


def percentiles(seconds: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max of latencies (seconds in, milliseconds out)."""
    ordered = sorted(seconds)
    return {
        "reads": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
        "max_ms": round(1000 * ordered[-1], 1),
    }
