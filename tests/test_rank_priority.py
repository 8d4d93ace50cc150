"""Rank processes run at a lower OS priority than the control plane (``--rank-niceness``).

On a node shared by the API server, the runners (each evaluation's driver), Ray's own processes
and the database, compute yields to them (issue 41: status reads during the chaos soak). Ray sets
each worker's niceness as the worker starts (``RAY_worker_niceness``); the ranks get the
service's, the runners the node's default.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import DeviceKind
from rayeval.actors.process import RAY_WORKER_NICENESS, rank_environment, runner_environment
from rayeval.service.vocabulary.config import HostOptions


@pytest.mark.unit
def test_ranks_get_the_niceness_asked_and_runners_the_nodes_default() -> None:
    assert rank_environment(DeviceKind.CPU, 19)[RAY_WORKER_NICENESS] == "19"
    assert RAY_WORKER_NICENESS not in rank_environment(DeviceKind.CPU)  # Ray's own default
    assert runner_environment()[RAY_WORKER_NICENESS] == "0"


@pytest.mark.unit
def test_a_niceness_outside_the_os_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"0 .* to 19"):
        HostOptions(rank_niceness=20)


@pytest.mark.service
def test_the_ranks_compute_at_the_hosts_niceness_and_the_driver_does_not(
    demo: Any, ray_session: None
) -> None:
    import psutil

    from rayeval.service.engine.lm import RayEvalLM

    driver = os.getpriority(os.PRIO_PROCESS, 0)
    with RayEvalLM(
        str(demo.model_dir),
        host=HostOptions(rank_niceness=7),
        dtype="float32",
        num_replicas=1,
        shard_size=2,
    ) as lm:
        assert lm.engine.load_reports  # loaded: torch's threads have started
        pids = [site.pid for site in lm.engine.rank_sites()]
        # The main thread runs the rank's calls; the threads torch starts from it inherit its
        # niceness. Ray's own I/O threads keep theirs.
        main = {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in pids}
        threads = {
            pid: {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}
            for pid in pids
        }
    assert len(pids) == 2 and set(main.values()) == {7}, main
    assert all(7 in nices for nices in threads.values()), threads
    assert os.getpriority(os.PRIO_PROCESS, 0) == driver


@pytest.mark.unit
def test_the_task_index_scan_runs_below_the_server() -> None:
    # The scan a (re)started server runs in a child process: about 6 s of CPU beside the first
    # status reads. Its niceness is read while it runs, then it is stopped.
    import subprocess
    import sys
    import time

    import psutil

    from rayeval.service.jobs.tasks import SCAN_NICENESS

    child = subprocess.Popen(
        [sys.executable, "-m", "rayeval.service.jobs.tasks"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    expected = min(19, SCAN_NICENESS + os.getpriority(os.PRIO_PROCESS, 0))
    try:
        process = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while process.nice() != expected:
            assert child.poll() is None and time.monotonic() < deadline, process.nice()
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
