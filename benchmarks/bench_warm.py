"""Start-up of an evaluation in the service, cold against warm replicas, in one run.

Starts ``rayeval serve`` (embedded Ray, SQLite, the bundled tiny model, response cache off so
every evaluation computes) twice: with ``--warm-replicas 0`` and with ``--warm-replicas 1``. Each
server runs the same evaluation three times in a row. For every run it reports, from the API's
own timestamps:

* **submit → admitted**: ``created_at`` to ``started_at`` (queueing and admission);
* **submit → first batch**: ``created_at`` to the runner's time of its first progress event,
  which is sent when the first batch is answered (so it includes starting the runner and the
  ranks, loading the model, lm-eval building the requests and that one batch);
* **total**: ``created_at`` to ``finished_at``.

Run 1 of each server is cold (the first also starts Ray's worker processes). Run 2 and 3 are cold
again with ``--warm-replicas 0`` and run on the kept ranks with ``--warm-replicas 1``; the
interesting ratio is run 2 cold against run 2 warm. Every run's results and samples are compared
with the first run's: they must be identical (exit status 1 if not).

Usage: ``python benchmarks/bench_warm.py [--runs 3] [--tasks demo] [--limit 8] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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
    parser.add_argument("--runs", type=int, default=3, help="evaluations per server (3)")
    parser.add_argument("--tasks", default="demo", help="lm-eval tasks (demo)")
    parser.add_argument("--limit", type=int, default=8, help="documents per task (8)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    body = demo_body(
        str(assets.model_dir), tasks=args.tasks.split(","), limit=args.limit, log_samples=True
    )
    rows: dict[str, list[dict[str, Any]]] = {}
    outputs: list[tuple[str, Any]] = []
    for name, warm in (("cold", 0), ("warm", 1)):
        with tempfile.TemporaryDirectory(prefix="rayeval-bench-warm-") as data_dir:
            port = free_port()
            server = start_server(assets, Path(data_dir), port, "--warm-replicas", str(warm))
            try:
                base = f"http://127.0.0.1:{port}"
                wait_ready(base)
                rows[name] = []
                for run in range(1, args.runs + 1):
                    row, output = _run(base, body)
                    rows[name].append(row)
                    outputs.append((f"{name} run {run}", output))
                    print(
                        f"--warm-replicas {warm}, run {run}: submit->admitted "
                        f"{row['admitted_s']:.2f}s, submit->first batch "
                        f"{row['first_batch_s']:.2f}s, total {row['total_s']:.2f}s"
                    )
            finally:
                stop_server(server)
    print()
    print("| run | submit → first batch, cold | warm | warm / cold |")
    print("|---|---|---|---|")
    for run in range(args.runs):
        cold, warm = rows["cold"][run]["first_batch_s"], rows["warm"][run]["first_batch_s"]
        print(f"| {run + 1} | {cold:.2f} s | {warm:.2f} s | {warm / cold:.2f} |")
    reference_name, reference = outputs[0]
    different = [name for name, output in outputs[1:] if output != reference]
    print(
        f"results and samples identical to {reference_name}: "
        + ("all runs" if not different else f"NO: {different}")
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if different else 0


def _run(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    evaluation = httpx.post(f"{base}/evaluations", json=body, timeout=120).json()
    final = wait_finished(base, evaluation["id"])
    first_progress = _first_progress_time(base, evaluation["id"])
    created = final["created_at"]
    from datetime import UTC, datetime

    created_epoch = datetime.fromisoformat(created).replace(tzinfo=UTC).timestamp()
    row = {
        "admitted_s": seconds_between(created, final["started_at"]),
        "first_batch_s": first_progress - created_epoch,
        "total_s": seconds_between(created, final["finished_at"]),
    }
    results = httpx.get(f"{base}/evaluations/{evaluation['id']}/results", timeout=60).json()
    samples = {
        task: httpx.get(f"{base}{link}", timeout=60).text
        for task, link in final["links"]["samples"].items()
    }
    return row, {"results": results["results"], "samples": samples}


def _first_progress_time(base: str, evaluation_id: str) -> float:
    """The runner's wall time of the evaluation's first progress event."""
    with httpx.stream("GET", f"{base}/evaluations/{evaluation_id}/events", timeout=60) as stream:
        event = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "progress":
                return float(json.loads(line.removeprefix("data: "))["updated_at"])
    raise SystemExit(f"evaluation {evaluation_id} sent no progress event")


if __name__ == "__main__":
    sys.exit(main())
