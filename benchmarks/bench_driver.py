"""The driver at many replicas: simulated ranks, the product's driver, measured.

One run: ``R`` simulated ranks (``sim_rank.py``: real Ray actors in the real placement group that
sleep out a modelled GPU's time and load nothing) behind a real ``RayEvalLM``, fed ``N`` synthetic
lm-eval Instances (``driver_workload.py``: MMLU-style multiple choice, or generation) through
the product's own request method: tokenisation, checks, response cache (``--use_cache``),
planning, dispatch, progress, result gathering. It prints the driver's time, CPU and peak
memory from submission to the first results and to the last, the replica utilisation, the load
average of the machine beside them, and as its last line ``replica utilisation: U``.

``--step_ms S`` sets the modelled time of a full scoring micro-batch: the micro-batch token budget
is ``S / token_us`` (``sim_rank.StepCost``: a 1B model on one H100 by default).

    .venv/bin/python benchmarks/bench_driver.py --replicas 64 --step_ms 20 --requests 100000
    .venv/bin/python benchmarks/bench_driver.py --grid --json .rayeval/bench/driver.json

``--grid`` runs the whole table of ``docs/performance-notes.md`` (``driver_grid.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # tests/support holds the simulated rank and the workloads
    sys.path.insert(0, str(REPO_ROOT))

from common import set_environment  # noqa: E402
from driver_grid import ranks_cpu_s  # noqa: E402
from driver_probe import DriverProbe, rss_mib  # noqa: E402

from tests.support.sim_rank import StepCost, simulated_rank  # noqa: E402
from tests.support.workload import bench_model, generation_instances, mmlu_instances  # noqa: E402

ROOT = REPO_ROOT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--step_ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--workload", choices=("mmlu", "generation"), default="mmlu")
    parser.add_argument("--token_us", type=float, default=StepCost().token_s * 1e6)
    parser.add_argument("--decode_ms", type=float, default=StepCost().decode_step_s * 1e3)
    parser.add_argument("--max_gen_toks", type=int, default=256)
    parser.add_argument("--slots", type=int, default=64, help="continuous-batching slots")
    parser.add_argument("--use_cache", default=None, help="response cache path prefix")
    parser.add_argument(
        "--tokenizer_workers",
        type=int,
        default=None,
        help="tokeniser actors for request types of several parts (default: the product's, "
        "half the free CPUs; 0: the driver alone)",
    )
    parser.add_argument("--num_cpus", type=int, default=None, help="logical CPUs of Ray")
    parser.add_argument("--json", default=None, help="append this run's figures here")
    parser.add_argument("--grid", action="store_true", help="the whole table (driver_grid.py)")
    parser.add_argument("--grid_replicas", default="1,8,16,32,64")
    parser.add_argument("--grid_steps", type=int, default=40, help="least steps per replica")
    parser.add_argument("--grid_seconds", type=float, default=2.0, help="least work per replica")
    parser.add_argument("--grid_repeats", type=int, default=1)
    parser.add_argument("--plot", default="docs/driver_utilisation.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def start_ray(num_cpus: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def build_requests(args: argparse.Namespace) -> list[Any]:
    if args.workload == "mmlu":
        return mmlu_instances(args.requests)
    return generation_instances(args.requests, max_gen_toks=args.max_gen_toks)


def make_lm(args: argparse.Namespace, probe: DriverProbe, replicas: Any = None) -> Any:
    """A RayEvalLM on simulated ranks, its ranks started (``replicas``: kept ones to reuse)."""
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.parts.pipeline import Tunables

    cost = StepCost(token_s=args.token_us * 1e-6, decode_step_s=args.decode_ms * 1e-3)
    budget = max(1, int(args.step_ms * 1e-3 / cost.token_s))
    options: dict[str, Any] = {
        "num_replicas": args.replicas,
        "batch_size": "auto",
        "max_batch_tokens": budget,
        "device": "cpu",
    }
    if args.workload == "generation":
        options |= {"max_batch_size": args.slots, "kv_cache_tokens": 1 << 20}
    if args.use_cache:
        options["use_cache"] = args.use_cache
    if args.tokenizer_workers is not None:
        options["tokenizer_workers"] = args.tokenizer_workers
    lm = RayEvalLM(
        pretrained=str(bench_model(ROOT / ".rayeval")),
        on_progress=probe,
        replicas=replicas,
        tunables=Tunables(rank_class=simulated_rank(cost)),
        **options,
    )
    lm.engine.load_reports  # noqa: B018  (waits until every rank answered)
    return lm


def measure(lm: Any, requests: list[Any], args: argparse.Namespace, probe: DriverProbe) -> dict:
    """Submit ``requests`` to the LM's request method; the figures of that one call."""
    phase = "loglikelihood" if args.workload == "mmlu" else "generate_until"
    pids = [site.pid for site in lm.engine.rank_sites()]
    load_before = os.getloadavg()[0]
    ranks_before = ranks_cpu_s(pids)
    probe.submit()
    getattr(lm, phase)(requests, disable_tqdm=args.quiet)
    end = probe.end()
    ranks = ranks_cpu_s(pids) - ranks_before
    start, first, last = probe.start, probe.first, probe.last
    assert start is not None and first is not None and last is not None
    stats = lm.engine.stats[phase]
    utilisation = stats.replica_utilisation
    steps_between = max(1, stats.micro_batches - 1)
    return {
        "replicas": args.replicas,
        "step_ms": args.step_ms,
        "requests": len(requests),
        "workload": args.workload,
        "micro_batches": stats.micro_batches,
        "replica_utilisation": sum(utilisation.values()) / max(1, len(utilisation)),
        "replica_utilisation_min": min(utilisation.values(), default=0.0),
        "dispatch_s": stats.seconds,
        "first_s": first.wall - start.wall,
        "total_s": end.wall - start.wall,
        "rss_submit_mib": start.peak_mib,
        "peak_first_mib": first.peak_mib,
        "peak_total_mib": end.peak_mib,
        "rss_end_mib": rss_mib(),
        "cpu_total_s": end.cpu - start.cpu,
        "cpu_before_first_s": first.cpu - start.cpu,
        "cpu_per_micro_batch_ms": (last.cpu - first.cpu) / steps_between * 1e3,
        "ranks_cpu_per_micro_batch_ms": ranks / max(1, stats.micro_batches) * 1e3,
        "progress_reports": probe.reports,
        "tokenizer_workers": args.tokenizer_workers,
        "tokenised_by_actors": stats.tokenised_by_actors,
        "planned_by_actors": stats.planned_by_actors,
        "driver_cpu_per_request_us": (end.cpu - start.cpu) / max(1, len(requests)) * 1e6,
        "load_average": (load_before + os.getloadavg()[0]) / 2,
    }


def report(figures: dict[str, Any]) -> str:
    f = figures
    return "\n".join(
        [
            f"{f['workload']} x {f['requests']:,} requests, R = {f['replicas']}, "
            f"{f['step_ms']:g} ms steps: {f['micro_batches']:,} micro-batches "
            f"(load average {f['load_average']:.1f} on {os.cpu_count()} cores)",
            f"first results after {f['first_s']:.2f} s (peak RSS {f['peak_first_mib']:,.0f} MiB; "
            f"{f['rss_submit_mib']:,.0f} MiB at submission)",
            f"last results after  {f['total_s']:.2f} s (peak RSS {f['peak_total_mib']:,.0f} MiB)",
            f"dispatch {f['dispatch_s']:.2f} s; driver CPU {f['cpu_total_s']:.2f} s, "
            f"{f['cpu_before_first_s']:.2f} s of it before the first results, "
            f"{f['cpu_per_micro_batch_ms']:.3f} ms per micro-batch while dispatching; "
            f"the ranks' CPU {f['ranks_cpu_per_micro_batch_ms']:.3f} ms per micro-batch",
            f"driver CPU per request {f['driver_cpu_per_request_us']:.1f} us; "
            f"{f['tokenised_by_actors']:,} requests tokenised by actors, "
            f"{f['planned_by_actors']:,} planned by them",
            f"replica utilisation: min {f['replica_utilisation_min']:.3f}",
            f"replica utilisation: {f['replica_utilisation']:.3f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(local_ray=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.grid:
        from driver_grid import run_grid

        return run_grid(args)
    start_ray(args.num_cpus or args.replicas + max(2, args.tokenizer_workers or 0))
    started = time.monotonic()
    requests = build_requests(args)
    print(
        f"built {len(requests):,} Instances in {time.monotonic() - started:.1f} s "
        f"(RSS {rss_mib():,.0f} MiB)",
        file=sys.stderr,
    )
    probe = DriverProbe()
    with make_lm(args, probe) as lm:
        figures = measure(lm, requests, args, probe)
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(figures) + "\n")
    print(report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
