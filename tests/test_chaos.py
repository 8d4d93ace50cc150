"""The chaos soak, short: ``benchmarks/chaos.py --short`` on a real service, so it cannot rot.

One fault of each kind (a rank SIGKILLed, a runner actor killed, a worker node removed, the API
server restarted, PostgreSQL restarted, an event stream dropped and resumed, the response cache's
disk filled) while three users keep evaluations in flight; the soak itself checks that every
evaluation ended, that each succeeded one's samples equal a quiet pass's, that every event was
kept in order, and that nothing was left behind. About three minutes on two shared cores.

Also here: what the soak measured led to, CPU ranks at a lower OS priority than the control
plane (a real process's niceness; the rank environment passes the server's setting on).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_a_short_chaos_soak_loses_nothing(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--short", "--json", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert re.fullmatch(r"chaos: \d+ faults of \d+ kinds, lost 0, wrong 0, left behind 0", last)


@pytest.mark.unit
def test_cpu_ranks_yield_the_cpu_to_the_control_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    from rayeval.actors.layout import DeviceKind
    from rayeval.actors.process import RANK_NICENESS, rank_environment

    def niceness_of_a_rank(env: dict[str, str]) -> int:
        code = "from rayeval.actors.process import lower_rank_priority as l; print(l())"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return int(done.stdout)

    base = os.nice(0)
    env = {k: v for k, v in os.environ.items() if k != "RAYEVAL_RANK_NICENESS"}
    assert niceness_of_a_rank(env) == min(19, base + RANK_NICENESS)
    assert niceness_of_a_rank({**env, "RAYEVAL_RANK_NICENESS": "0"}) == base
    monkeypatch.setenv("RAYEVAL_RANK_NICENESS", "3")
    assert rank_environment(DeviceKind.CPU)["RAYEVAL_RANK_NICENESS"] == "3"
