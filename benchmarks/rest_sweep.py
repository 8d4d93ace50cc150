"""bench_sweep's REST row: the same sweep submitted to ``rayeval serve`` (``sweep.checkpoints``)
and timed as a client sees it: when each checkpoint first shows in ``GET /evaluations/{id}/sweep``
(polled every 0.1 s), from the submission."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from benchmarks.service_harness import free_port, start_server, stop_server, wait_ready


def rest_sweep(
    root: Path, model_dir: Path, include: Path, args: Any, base_body: dict[str, Any]
) -> dict[str, Any]:
    """Run the sweep of ``root/run/step-*`` on a fresh server; per checkpoint the seconds until
    it was listed, the gap since the one before, its record, and its served results."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-rest-") as data:
        assets = SimpleNamespace(tasks_dir=include, model_dir=root)  # the model root: both
        extra = ("--warm-replicas", "0", "--model-root", str(model_dir))
        server = start_server(assets, Path(data), port, *extra)
        try:
            wait_ready(base)
            body = {**base_body, "sweep": {"checkpoints": [str(root / "run" / "step-*")]}}
            started = time.monotonic()
            answer = httpx.post(f"{base}/evaluations", json=body, timeout=120)
            if answer.status_code != 202:
                raise SystemExit(f"the server refused the sweep: {answer.text}")
            evaluation_id = answer.json()["id"]
            seen = _follow(base, evaluation_id, started)
            sweep = httpx.get(f"{base}/evaluations/{evaluation_id}/sweep", timeout=60).json()
            results = {
                record["label"]: httpx.get(base + record["links"]["results"], timeout=60).json()
                for record in sweep["checkpoints"]
            }
        finally:
            stop_server(server)
    previous = 0.0
    rows = []
    for record in sweep["checkpoints"]:
        at = seen[record["label"]]
        rows.append({"label": record["label"], "listed_at_s": at, "gap_s": at - previous,
                     "seconds": record["seconds"]})  # fmt: skip
        previous = at
    return {"rows": rows, "results": results, "total_s": max(seen.values(), default=0.0)}


def _follow(base: str, evaluation_id: str, started: float, timeout_s: float = 3600) -> dict:
    """When each checkpoint was first listed (seconds since ``started``), until the end."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(f"{base}/evaluations/{evaluation_id}", timeout=60).json()
        # Read after the state: an ended sweep's last checkpoint is listed by then.
        sweep = httpx.get(f"{base}/evaluations/{evaluation_id}/sweep", timeout=60).json()
        for record in sweep["checkpoints"]:
            seen.setdefault(record["label"], time.monotonic() - started)
        if state["status"] in ("succeeded", "failed", "cancelled"):
            if state["status"] != "succeeded":
                raise SystemExit(f"REST sweep {state['status']}: {state['error']}")
            return seen
        time.sleep(0.1)
    raise SystemExit(f"the REST sweep did not end within {timeout_s}s")
