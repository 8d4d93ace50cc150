"""The chaos soak, short: ``benchmarks/chaos.py --short`` on a real service, so it cannot rot.

One fault of each kind (a rank SIGKILLed, a runner actor killed, a worker node removed, the API
server restarted, PostgreSQL restarted, an event stream dropped and resumed, the response cache's
disk filled) while three users keep evaluations in flight (a checkpoint sweep among the recipes,
checked per checkpoint); the soak itself checks that every evaluation ended, that each succeeded
one's samples equal a quiet pass's, that every event was kept in order, that each evaluation a
fault failed succeeds on a retry, and that nothing was left behind. Three to four and a half
minutes on two shared cores (192 s measured at load average 2-4, 264 s at 12; 196 s with the sweep
on a quiet machine).

Also here, at one seam each, what the soak found: a killed runner's scratch folder is removed by
the next runner on its node. Elsewhere: a full cache disk, and a sweep's cache opened on one
(``tests/test_response_cache.py``), a rank killed while loading (``tests/test_load_restart.py``),
the ranks' priority (``tests/test_rank_priority.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KINDS = ("rank", "runner", "node", "api", "postgres", "stream", "disk")


def _soak(report: Path, seed: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "benchmarks/chaos.py",
            "--short",
            "--seed",
            str(seed),
            "--json",
            str(report),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.e2e
def test_a_short_chaos_soak_loses_nothing(tmp_path: Path) -> None:
    # A failed soak is a finding: it fails here, with its output (it is not rerun on another
    # seed until one passes).
    report = tmp_path / "chaos.json"
    done = _soak(report, seed=0)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert re.fullmatch(r"chaos: \d+ faults of \d+ kinds, lost 0, wrong 0, left behind 0", last)
    # One of each kind this machine offers (the database and the disk need PostgreSQL and root).
    written = json.loads(report.read_text())
    assert set(written["faults"]) == set(KINDS) - set(written["unavailable"]), written["faults"]
    assert all(count == 1 for count in written["faults"].values()), written["faults"]
    assert written["retries_succeeded"] == written["retried"]


@pytest.mark.unit
def test_the_next_runner_removes_a_killed_runner_s_scratch_folder(tmp_path: Path) -> None:
    from rayeval.service.jobs.runner_actor import sweep_scratch_folders

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    dead = tmp_path / f"rayeval-0123abcd-p{killed.pid}-x1"
    (dead / "output").mkdir(parents=True)
    live = tmp_path / f"rayeval-4567cdef-p{os.getpid()}-x2"
    other = tmp_path / "rayeval-output-x3"  # not a runner's: left alone
    live.mkdir()
    other.mkdir()
    assert sweep_scratch_folders(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
