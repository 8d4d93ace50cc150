"""Whole-command wall time of a tiny evaluation: ``rayeval run`` beside ``lm_eval run``, one run.

On an evaluation this small (one task, ``--limit 2``) almost all of a command's time is start-up:
Python imports, lm-eval loading the task, the model load, and for rayeval starting an embedded Ray
and the rank processes. Each command runs ``--repeats`` times, alternating, in fresh processes
(as a user runs them); the table prints every time, the median, and rayeval's median against
lm-eval's. rayeval runs at 1x1 by default (``--layout RxG`` for another).

Usage: ``python benchmarks/bench_startup.py [--repeats 3] [--layout 1x1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", default="1x1", help="rayeval's RxG (1x1)")
    parser.add_argument("--task", default="demo_mc", help="one lm-eval task (demo_mc)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    replicas, shard = args.layout.split("x")
    common = [
        "--model", "hf", "--model_args", f"pretrained={assets.model_dir},dtype=float32",
        "--include_path", str(assets.tasks_dir), "--tasks", args.task, "--limit", "2",
        "--batch_size", "4",
    ]  # fmt: skip
    bin_dir = Path(sys.executable).parent
    layout = ["--num_replicas", replicas, "--shard_size", shard]
    commands = {
        "lm_eval run --model hf": [str(bin_dir / "lm_eval"), "run", *common],
        f"rayeval run ({args.layout})": [str(bin_dir / "rayeval"), "run", *common, *layout],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    times: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-startup-") as scratch:
        for _ in range(args.repeats):
            for name, argv in commands.items():
                started = time.perf_counter()
                done = subprocess.run(
                    argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=900
                )
                if done.returncode != 0:
                    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
                    raise SystemExit(f"{name} failed with exit status {done.returncode}")
                times[name].append(time.perf_counter() - started)
    reference = statistics.median(times["lm_eval run --model hf"])
    print(f"| command ({args.task}, --limit 2) | runs (s) | median | vs lm_eval |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| `{name}` | {runs} | {median:.1f} s | {median / reference:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(times, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
