"""``bench_driver.py --grid``: replica utilisation and driver CPU over R and step time, and a plot.

For each R in ``--grid_replicas`` the simulated ranks start once (kept between step times, as
the service keeps loaded replicas); for each step time a ``RayEvalLM`` on them scores synthetic
MMLU-shaped token pairs through the product's executor (response cache, planner, dispatcher,
progress, result gathering, exactly-once check): tokenisation is left out, so that enough
requests for ``--grid_steps`` steps per replica (up to a million) can be run at every point.
Utilisation is the engine's own figure: per replica, the modelled compute its steps reported over
the dispatch's wall time, averaged over replicas. The driver's CPU (every thread of this process)
and the ranks' CPU (read from ``/proc``) are divided by the micro-batches dispatched. Every point
runs ``--grid_repeats`` times with the load average beside it, and its replicas' wall time is
split by what they waited for (``share_*``: ``driver_timeline.py``). Writes the rows as JSON
lines to ``--json`` and the plot to ``--plot`` (PNG with matplotlib, else a text plot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from driver_probe import DriverProbe, cpu_s, rss_mib
from driver_timeline import SubmitLog, rank_calls

from tests.support.timeline import time_shares
from tests.support.workload import WINDOW

STEP_MS = (5.0, 20.0, 100.0)
MEAN_CONTEXT = 182  # tokens, as the synthetic MMLU prompts measure with the demo tokenizer
MAX_REQUESTS = 1_200_000


def synthetic_pairs(count: int, seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """MMLU-shaped token pairs: per question a context of 100-270 tokens (mean ~185) and four
    one-token continuations; every question different."""
    rng = random.Random(seed)
    ids = tuple(range(1000))  # shared int objects, as the driver's tokeniser makes them
    letters = [(ids[32 + i],) for i in range(4)]
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(count // 4 + 1):
        context = tuple(rng.choices(ids[100:], k=rng.randint(100, 270)))
        pairs += [(context, letter) for letter in letters]
    return pairs[:count]


def ranks_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the rank processes (this machine's /proc; 0 for any not found)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def grid_point(lm: Any, pairs: list, replicas: int, step_ms: float, probe: DriverProbe) -> dict:
    """Score ``pairs`` with the LM's executor; the point's figures."""
    pids = [site.pid for site in lm.engine.rank_sites()]
    load = os.getloadavg()[0]
    replicas_now = lm.engine._group.replicas
    rank_calls(replicas_now)  # forget earlier points' calls
    ranks_before = ranks_cpu_s(pids)
    with SubmitLog().recording() as submits:
        probe.submit()
        # The product path after tokenising.
        lm.engine._executor.score(pairs, WINDOW, "loglikelihood", True)
        end = probe.end()
    ranks = ranks_cpu_s(pids) - ranks_before
    shares = time_shares(submits.sent, rank_calls(replicas_now))
    stats = lm.engine.stats["loglikelihood"]
    first, last = probe.first, probe.last
    assert first is not None and last is not None and probe.start is not None
    after_first = stats.micro_batches * (1 - first.done / max(1, len(pairs)))
    utilisation = stats.replica_utilisation
    return {
        "replicas": replicas,
        "step_ms": step_ms,
        "requests": len(pairs),
        "micro_batches": stats.micro_batches,
        "steps_per_replica": stats.micro_batches / replicas,
        "replica_utilisation": sum(utilisation.values()) / max(1, len(utilisation)),
        "replica_utilisation_min": min(utilisation.values(), default=0.0),
        "dispatch_s": stats.seconds,
        "plan_s": first.wall - probe.start.wall,
        "cpu_per_micro_batch_ms": (last.cpu - first.cpu) / max(1.0, after_first) * 1e3,
        # Of one core, while dispatching: what the driver needs at this rate of micro-batches.
        "driver_cpu_share": (last.cpu - first.cpu) / max(1e-9, last.wall - first.wall),
        "ranks_cpu_per_micro_batch_ms": ranks / max(1, stats.micro_batches) * 1e3,
        "micro_batches_per_s": stats.micro_batches / max(1e-9, stats.seconds),
        "load_average": (load + os.getloadavg()[0]) / 2,
        "rss_mib": rss_mib(),
        "cpu_total_s": end.cpu - probe.start.cpu,
        **{f"share_{key}": value for key, value in shares.items()},
    }


def requests_for(replicas: int, step_ms: float, args: argparse.Namespace) -> int:
    """Enough requests for ``--grid_steps`` steps and ``--grid_seconds`` of modelled work per
    replica (4 requests per context row)."""
    rows = max(1, int(step_ms * 1e-3 / (args.token_us * 1e-6)) // MEAN_CONTEXT)
    steps = max(args.grid_steps, int(args.grid_seconds / (step_ms * 1e-3)))
    return min(MAX_REQUESTS, steps * replicas * rows * 4)


def run_grid(args: argparse.Namespace) -> int:
    """Every point of the grid; rows to ``--json``, the plot to ``--plot``."""
    from bench_driver import make_lm, start_ray

    from rayeval.service.engine.dispatch.warm import KeptReplicas

    replica_counts = [int(r) for r in args.grid_replicas.split(",")]
    start_ray(args.num_cpus or max(replica_counts) + 4)
    most = max(requests_for(r, s, args) for r in replica_counts for s in STEP_MS)
    started = time.monotonic()
    pairs = synthetic_pairs(most)
    print(f"{len(pairs):,} token pairs in {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    for replicas in replica_counts:
        kept = KeptReplicas(keep=True)
        for step_ms in STEP_MS:
            point = argparse.Namespace(**{**vars(args), "replicas": replicas, "step_ms": step_ms})
            count = requests_for(replicas, step_ms, args)
            for repeat in range(args.grid_repeats):
                probe = DriverProbe()
                lm = make_lm(point, probe, replicas=kept)
                try:
                    row = grid_point(lm, pairs[:count], replicas, step_ms, probe) | {"run": repeat}
                finally:
                    lm.close(keep=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as out:
                        out.write(json.dumps({"grid": True, **row}) + "\n")
        kept.shutdown()
    print(f"driver CPU {cpu_s():.0f} s in all")
    plot(rows, args.plot)
    return 0


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Utilisation and driver CPU per micro-batch against R, one line per step time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(path).with_suffix(".txt").write_text(text_plot(rows))
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for step_ms in STEP_MS:
        xs = sorted({r["replicas"] for r in rows if r["step_ms"] == step_ms})
        for axis, key in ((left, "replica_utilisation"), (right, "cpu_per_micro_batch_ms")):
            ys = [_mean(rows, step_ms, x, key) for x in xs]
            axis.plot(xs, ys, "o-", label=f"{step_ms:g} ms")
    left.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="replicas R", ylabel="replica utilisation", ylim=(0, 1.05))
    right.set(xlabel="replicas R", ylabel="driver CPU per micro-batch (ms)")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks([1, 8, 16, 32, 64], ["1", "8", "16", "32", "64"])
        axis.legend(title="step time")
        axis.grid(alpha=0.3)
    load = sum(r["load_average"] for r in rows) / max(1, len(rows))
    fig.suptitle(f"simulated ranks, one 2-core machine (mean load average {load:.0f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mean(rows: list[dict[str, Any]], step_ms: float, replicas: int, key: str) -> float:
    """The mean of ``key`` over the repeats of one grid point."""
    values = [r[key] for r in rows if r["step_ms"] == step_ms and r["replicas"] == replicas]
    return sum(values) / len(values)


def text_plot(rows: list[dict[str, Any]]) -> str:
    """The plot's data as text bars, for machines without matplotlib."""
    lines = []
    for row in sorted(rows, key=lambda r: (r["step_ms"], r["replicas"])):
        bar = "#" * round(40 * row["replica_utilisation"])
        lines.append(f"{row['step_ms']:>5g} ms R={row['replicas']:>2}  {bar:<40} "
                     f"{row['replica_utilisation']:.2f}")  # fmt: skip
    return "\n".join(lines) + "\n"
