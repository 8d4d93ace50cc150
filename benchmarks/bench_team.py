"""A team on one small cluster: 20 users submit 10 evaluations each, at once, while they poll.

Starts ``rayeval serve`` (embedded Ray with ``--num-cpus`` logical CPUs, warm replicas so that
two hundred evaluations do not each load the model, the response cache off so each computes; the
store is SQLite under a temporary directory, or ``--database-url``), makes the users over REST
with the server's admin token, then:

1. every user submits 10 one-rank evaluations of the bundled tiny model in one burst, user after
   user (u00's ten first, u19's last), each with priorities 0..9 in a shuffled order;
2. while they run, each user polls its own evaluations (``GET /evaluations/{id}`` and the list)
   once a second with its member key, and the latencies of each kind of read are kept;
3. at the end it checks what the policy promises: users are served in turn (at no moment had a
   user started more than two evaluations more than another user that still had some queued;
   first in, first out would let u00 start all ten first; and every user had one started within
   the first ``users`` starts, plus those made before the last user had queued anything), each
   user's own evaluations started in priority order, all succeeded, and each started exactly
   once (its event stream has one ``starting``).

Usage: ``python benchmarks/bench_team.py [--users 20] [--each 10] [--num-cpus 4]
[--database-url URL] [--json out.json]``. The load generator shares the machine with the server
and the ranks, as in ``bench_status.py``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_harness import (
    free_port,
    make_users,
    percentiles,
    start_server,
    stop_server,
    wait_ready,
)

ADMIN = "bench-team-admin"
TERMINAL = ("succeeded", "failed", "cancelled")
#: The report's long lists: written to --json, not printed.
LISTS = ("starts", "start_owners")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--each", type=int, default=10)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-team-") as data_dir:
        port = free_port()
        extra = ["--api-token", ADMIN, "--warm-replicas", str(args.num_cpus)]
        extra += ["--num-cpus", str(args.num_cpus), "--require-api-keys"]
        if args.database_url:
            extra += ["--database-url", args.database_url]
        server = start_server(assets, Path(data_dir), port, *extra)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            keys = make_users(base, ADMIN, [f"u{i:02d}" for i in range(args.users)])
            body = _body(str(assets.model_dir))
            report = asyncio.run(_run(base, keys, body, args.each))
        finally:
            stop_server(server)
    report["store"] = "postgresql" if args.database_url else "sqlite"
    print(json.dumps({k: v for k, v in report.items() if k not in LISTS}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["promises_kept"] else 1


def _body(model_dir: str) -> dict[str, Any]:
    return {
        "model_args": {"pretrained": model_dir, "dtype": "float32"},
        "tasks": ["demo_mc"],
        "limit": 2,
        "bootstrap_iters": 0,
        "parallelism": {"num_replicas": 1, "shard_size": 1},
    }


async def _run(base: str, keys: dict[str, str], body: dict[str, Any], each: int) -> dict[str, Any]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    sessions = {
        name: aiohttp.ClientSession(
            base, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )
        for name, key in keys.items()
    }
    try:
        started = time.perf_counter()
        submitted = await _submit_all(sessions, body, each)
        submit_s = time.perf_counter() - started
        latencies: dict[str, list[float]] = {"status": [], "list": []}
        errors = [0]
        done = asyncio.Event()
        pollers = [
            asyncio.create_task(_poll(session, submitted[name], latencies, errors, done))
            for name, session in sessions.items()
        ]
        finals = await _wait_all(sessions, submitted)
        done.set()
        await asyncio.gather(*pollers, return_exceptions=True)
        elapsed = time.perf_counter() - started
        starts = await _starts(sessions, submitted)
    finally:
        for session in sessions.values():
            await session.close()
    return _report(submitted, finals, starts, latencies, errors[0], submit_s, elapsed)


async def _submit_all(
    sessions: dict[str, Any], body: dict[str, Any], each: int
) -> dict[str, list[tuple[str, int]]]:
    """Each user's burst, user after user: (id, priority) per evaluation."""
    shuffle = random.Random(0)
    submitted: dict[str, list[tuple[str, int]]] = {}
    for name, session in sessions.items():
        priorities = list(range(each))
        shuffle.shuffle(priorities)
        payloads = [{**body, "scheduling": {"priority": p}} for p in priorities]
        answers = await asyncio.gather(*(_post(session, payload) for payload in payloads))
        submitted[name] = [(a["id"], p) for a, p in zip(answers, priorities, strict=True)]
    return submitted


async def _post(session: Any, payload: dict[str, Any]) -> dict[str, Any]:
    async with session.post("/evaluations", json=payload) as response:
        answer: dict[str, Any] = await response.json()
        if response.status != 202:
            raise SystemExit(f"submission refused ({response.status}): {answer}")
        return answer


async def _poll(
    session: Any,
    mine: list[tuple[str, int]],
    latencies: dict[str, list[float]],
    errors: list[int],
    done: asyncio.Event,
) -> None:
    """Once a second: the status of one of the user's evaluations, and their list."""
    turn = 0
    while not done.is_set():
        paths = {
            "status": f"/evaluations/{mine[turn % len(mine)][0]}",
            "list": "/evaluations?limit=20",
        }
        for kind, path in paths.items():
            sent = time.perf_counter()
            async with session.get(path) as response:
                await response.read()
                latencies[kind].append(time.perf_counter() - sent)
                errors[0] += response.status != 200
        turn += 1
        await asyncio.sleep(1.0)


async def _wait_all(
    sessions: dict[str, Any], submitted: dict[str, list[tuple[str, int]]]
) -> dict[str, dict[str, Any]]:
    finals: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 3600
    while len(finals) < sum(len(v) for v in submitted.values()):
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(finals)} evaluations finished within an hour")
        for name, evaluations in submitted.items():
            for evaluation_id, _ in evaluations:
                if evaluation_id in finals:
                    continue
                async with sessions[name].get(f"/evaluations/{evaluation_id}") as response:
                    state = await response.json()
                if state["status"] in TERMINAL:
                    finals[evaluation_id] = state
        await asyncio.sleep(2.0)
    return finals


async def _starts(
    sessions: dict[str, Any], submitted: dict[str, list[tuple[str, int]]]
) -> dict[str, list[str]]:
    """Per evaluation, the states of its event stream (one ``starting`` each, if run once)."""
    states: dict[str, list[str]] = {}
    for name, evaluations in submitted.items():
        for evaluation_id, _ in evaluations:
            async with sessions[name].get(f"/evaluations/{evaluation_id}/events") as response:
                text = await response.text()
            states[evaluation_id] = [
                json.loads(line[len("data: ") :])["status"]
                for line in text.splitlines()
                if line.startswith("data: ") and '"status"' in line
            ]
    return states


def _report(
    submitted: dict[str, list[tuple[str, int]]],
    finals: dict[str, dict[str, Any]],
    states: dict[str, list[str]],
    latencies: dict[str, list[float]],
    errors: int,
    submit_s: float,
    elapsed: float,
) -> dict[str, Any]:
    owner = {i: name for name, evs in submitted.items() for i, _ in evs}
    priority = {i: p for evs in submitted.values() for i, p in evs}
    times = {i: _times(state) for i, state in finals.items()}
    order = sorted(finals, key=lambda i: times[i][1])
    once = all(s.count("starting") == 1 for s in states.values())
    succeeded = sum(f["status"] == "succeeded" for f in finals.values())
    status, listing = percentiles(latencies["status"]), percentiles(latencies["list"])
    unfair = _unfair_starts(order, owner, times)
    out_of_priority = _out_of_priority(order, owner, priority, times)
    first_wait = [
        min(times[i][1] for i, _ in evs) - min(times[i][0] for i, _ in evs)
        for evs in submitted.values()
    ]
    # Turns: by which start had every user one started? Users take turns, so by the number of
    # users plus the starts made before the last user's first evaluation was even queued.
    first_start = {name: min(order.index(i) for i, _ in evs) for name, evs in submitted.items()}
    last_queued = max(min(times[i][0] for i, _ in evs) for evs in submitted.values())
    early = sum(times[i][1] < last_queued for i in order)
    every_user_by = max(first_start.values()) + 1
    return {
        "users": len(submitted),
        "evaluations": len(finals),
        "succeeded": succeeded,
        "started_exactly_once": once,
        "unfair_starts": unfair,
        "out_of_priority_starts": len(out_of_priority),
        "out_of_priority_queued_s": out_of_priority,
        "every_user_started_by": every_user_by,
        "turn_bound": len(submitted) + early,
        "first_start_wait_s_max": round(max(first_wait), 1),
        "first_start_wait_s_mean": round(statistics.mean(first_wait), 1),
        "submit_s": round(submit_s, 1),
        "total_s": round(elapsed, 1),
        "read_errors": errors,
        "status_reads": status,
        "list_reads": listing,
        "promises_kept": once
        and unfair == 0
        and not out_of_priority
        and every_user_by <= len(submitted) + early
        and status["p99_ms"] < 100
        and succeeded == len(finals)
        and errors == 0,
        "starts": order,
        "start_owners": [owner[i] for i in order],
    }


def _times(state: dict[str, Any]) -> tuple[float, float, float]:
    """Created, started and finished, in seconds since the epoch."""
    from datetime import datetime

    return tuple(  # type: ignore[return-value]
        datetime.fromisoformat(state[key]).timestamp()
        for key in ("created_at", "started_at", "finished_at")
    )


def _unfair_starts(
    order: list[str], owner: dict[str, str], times: dict[str, tuple[float, float, float]]
) -> int:
    """Starts that fair share would not have made: the starting user held more running
    evaluations than another user who had one waiting, by more than one (an admission round
    sees states a fraction of a second old)."""
    unfair = 0
    for evaluation_id in order:
        now = times[evaluation_id][1]
        held: dict[str, int] = {}
        for other, (_, start, end) in times.items():
            if start < now <= end:
                held[owner[other]] = held.get(owner[other], 0) + 1
        waiting = {
            owner[other]
            for other, (created, start, _) in times.items()
            if created <= now < start and other != evaluation_id
        }
        mine = held.get(owner[evaluation_id], 0)
        if waiting and mine > min(held.get(user, 0) for user in waiting) + 1:
            unfair += 1
    return unfair


def _out_of_priority(
    order: list[str],
    owner: dict[str, str],
    priority: dict[str, int],
    times: dict[str, tuple[float, float, float]],
) -> list[float]:
    """Starts of a user's evaluation while one of theirs of higher priority waited (among the
    evaluations queued together: the first of a burst may start before the rest arrive): for
    each, how long before the start the higher-priority one had been queued (an admission round
    reads the queue, then records its starts: a submission in between is not one it saw)."""
    late = []
    for evaluation_id in order:
        start = times[evaluation_id][1]
        queued_for = [
            start - times[other][0]
            for other in order
            if owner[other] == owner[evaluation_id]
            and priority[other] > priority[evaluation_id]
            and times[other][0] <= start < times[other][1]
        ]
        if queued_for:
            late.append(round(max(queued_for), 3))
    return late


if __name__ == "__main__":
    sys.exit(main())
