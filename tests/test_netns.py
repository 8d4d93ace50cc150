"""Multi-node for real: ``deploy/netns/rehearsal.py`` on two network namespaces of this machine.

Unlike ``ray.cluster_utils.Cluster`` (tests/test_placement.py), the two Ray nodes here have their
own network stacks and addresses, joined by one veth link: the worker node reaches the head, and
each replica's gloo ranks reach each other, only by address, as on two machines. The script runs
a Ray head and a worker node (token authentication on), then ``rayeval run`` with a 2x1 layout
(replicas spread over the nodes) and a 1x2 layout placed across them (``--placement spread``).
These tests check, from what each rank actor reported, that both layouts used both nodes, that
their results equal lm-eval's own ``hf`` backend run here, and that nothing is left behind.

Needs root and ``ip netns``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    assert_same_results,
    read_outputs,
    run_lm_eval_cli,
    stop_process_group,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "netns" / "rehearsal.py"
RUN_TIMEOUT_S = 600


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30)
    if done.returncode != 0:
        return f"`ip netns` does not work here: {done.stderr.decode(errors='replace').strip()}"
    return None


pytestmark = pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _processes_naming(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and str(SCRIPT) not in cmdline:
                found.append(f"{entry.name}: {cmdline.replace(chr(0), ' ')[:200]}")
    return found


def _rehearse(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_group(process)  # type: ignore[arg-type]  # SIGTERM: the script tears down
        pytest.fail(f"the rehearsal outlasted {timeout_s}s")
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


@pytest.fixture(scope="module")
def rehearsal(demo: Any) -> dict[str, Any]:
    """One rehearsal: two nodes, both layouts; its report, its prefix and work dir.

    A cluster that does not come up (a ``ray start`` that exits, a worker node that does not
    join: seen once on this machine at a load average of 24) is torn down and brought up once
    more; a failure after the cluster is up fails at once.
    """
    for attempt in (1, 2):
        prefix = f"rt{uuid.uuid4().hex[:5]}"
        work = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths
        report = work / "report.json"
        started = time.monotonic()
        try:
            done = _rehearse(
                "--prefix", prefix, "--work-dir", str(work), "--report", str(report),
                "--model-dir", str(demo.model_dir), "--tasks-dir", str(demo.tasks_dir),
                "--no-reference", "--no-refusal-check",
            )  # fmt: skip
            seconds = time.monotonic() - started
            leftovers = {
                "namespaces": sorted(ns for ns in _namespaces() if ns.startswith(prefix)),
                "processes": _processes_naming(str(work)),
            }
            if done.returncode != 0 or not report.exists():
                if attempt == 1 and "cluster up:" not in done.stdout:
                    continue
                pytest.fail(
                    f"the rehearsal failed (exit {done.returncode}):\n{done.stdout[-6000:]}"
                )
            outputs = {}
            for name, layout in json.loads(report.read_text())["layouts"].items():
                _, results, samples = read_outputs(Path(layout["output_path"]))
                outputs[name] = {"results": results["results"], "samples": samples}
            return {
                "report": json.loads(report.read_text()),
                "outputs": outputs,
                "leftovers": leftovers,
                "seconds": seconds,
            }
        finally:
            _rehearse("--teardown", "--prefix", prefix, "--work-dir", str(work), timeout_s=120)
            shutil.rmtree(work, ignore_errors=True)
    raise AssertionError("unreachable: the second attempt returns or fails")


@pytest.mark.e2e
def test_layouts_use_both_nodes_by_their_addresses(rehearsal: dict[str, Any]) -> None:
    report = rehearsal["report"]
    head, worker = report["head_ip"], report["worker_ip"]
    assert report["nodes"] == sorted([head, worker])
    assert report["auth"] == "token"
    spread = report["layouts"]["2x1"]["ranks"]
    assert sorted((r["replica"], r["shard_rank"]) for r in spread) == [(0, 0), (1, 0)]
    assert {r["ip"] for r in spread} == {head, worker}, spread
    across = report["layouts"]["1x2:spread"]["ranks"]
    assert [(r["replica"], r["shard_rank"]) for r in across] == [(0, 0), (0, 1)]
    assert {r["ip"] for r in across} == {head, worker}, across
    assert len({r["node"] for r in across}) == 2, across


@pytest.mark.e2e
def test_results_equal_lm_eval_hf(rehearsal: dict[str, Any], tmp_path: Path) -> None:
    run_lm_eval_cli(["run", *rehearsal["report"]["lm_eval_args"], "--device", "cpu",
                     "--batch_size", "4", "--output_path", str(tmp_path / "ref")])  # fmt: skip
    _, ref_results, ref_samples = read_outputs(tmp_path / "ref")
    for name, ours in rehearsal["outputs"].items():
        assert set(ours["samples"]) == {"demo_gen_short", "demo_mc"}, name
        assert_same_results({"results": ref_results["results"], "samples": ref_samples}, ours)


@pytest.mark.e2e
def test_nothing_is_left_behind(rehearsal: dict[str, Any]) -> None:
    assert rehearsal["leftovers"] == {"namespaces": [], "processes": []}


@pytest.mark.unit
def test_teardown_removes_leftovers_of_a_failed_run(tmp_path: Path) -> None:
    """What a killed run leaves — namespaces, a link in this namespace, a recorded process group
    and a process outside it — goes, by name and by pid, and a second tear-down is a no-op."""
    prefix = f"rt{uuid.uuid4().hex[:5]}"
    work = tmp_path / "w"
    work.mkdir()
    marker = str(work / "h" / "session")  # as a Ray process of the head names its temp dir
    commands = [
        ["ip", "netns", "add", f"{prefix}-head"],
        ["ip", "netns", "add", f"{prefix}-work"],
        ["ip", "link", "add", f"{prefix}-h", "type", "veth", "peer", "name", f"{prefix}-w"],
    ]
    for command in commands:
        subprocess.run(command, check=True, timeout=30)
    group = subprocess.Popen(["bash", "-c", f"exec -a {marker} sleep 300"], start_new_session=True)
    stray = subprocess.Popen(["bash", "-c", f"exec -a {marker}-2 sleep 300"])
    state = {"prefix": prefix, "processes": {"head": group.pid}}
    (work / "state.json").write_text(json.dumps(state))
    try:
        for _ in range(2):
            done = _rehearse(
                "--teardown", "--prefix", prefix, "--work-dir", str(work), timeout_s=120
            )
            assert done.returncode == 0, done.stdout
            assert not any(ns.startswith(prefix) for ns in _namespaces())
            link = subprocess.run(["ip", "link", "show", f"{prefix}-h"], capture_output=True)
            assert link.returncode != 0, "the link is still there"
        assert group.wait(timeout=30) != 0 and stray.wait(timeout=30) != 0
    finally:
        for process in (group, stray):
            process.kill()
            process.wait(timeout=30)
        subprocess.run(["ip", "link", "del", f"{prefix}-h"], capture_output=True)
        for ns in (f"{prefix}-head", f"{prefix}-work"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.unit
def test_script_refuses_without_root_with_the_fix() -> None:
    """The preflight names the fix (run as root) instead of failing half-way."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, str(SCRIPT), "--prefix", "rtnobody", "--work-dir", "/tmp/rtnobody"],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "need root: run it with sudo" in done.stderr
