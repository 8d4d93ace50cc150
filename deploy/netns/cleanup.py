"""Tear-down of a rehearsal: its process groups, stray Ray processes, namespaces and links.

Processes are found by the pids recorded in ``state.json`` and by command lines that name the
rehearsal's work directory; never this process or one above it. Safe to repeat.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from deploy.netns.nodes import Cluster, run_logged

logger = logging.getLogger(__name__)

#: Seconds a process group has to exit after SIGTERM before it gets SIGKILL.
STOP_GRACE_S = 10.0


def _owned_pids(cluster: Cluster) -> list[int]:
    """Processes whose command line names the rehearsal's Ray temp dirs or outputs: its nodes'
    processes, Ray's workers and the driver (never this process or what started it)."""
    markers = tuple(str(cluster.work_dir / part) for part in ("h", "w", "out"))
    ours = _ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if any(marker in cmdline for marker in markers):
                found.append(int(entry.name))
    return found


def _ancestors() -> set[int]:
    """This process and every process above it."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie, exited but not yet reaped by its
    parent, does not count)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    return False


def stop_groups(pgids: list[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM process groups we started (``ray start --block`` stops its node); SIGKILL what
    is left of them after ``grace_s``."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_group_alive(pgid) for pgid in pgids) and time.monotonic() < deadline:
        for pgid in pgids:  # reap our own children, or they stay as zombies of the group
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-pgid, os.WNOHANG)
        time.sleep(0.2)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def teardown(cluster: Cluster) -> None:
    """Remove everything a rehearsal with this prefix and work dir made; safe to repeat."""
    recorded: dict[str, int] = {}
    if cluster.state_file.exists():
        with contextlib.suppress(ValueError, OSError):
            recorded = json.loads(cluster.state_file.read_text()).get("processes", {})
    recorded.update(cluster.processes)
    # Only groups that still hold a process of ours (pids are reused).
    live = {_pgid(pid) for pid in _owned_pids(cluster)}
    groups = {role: pgid for role, pgid in recorded.items() if pgid in live}
    if groups:
        logger.info("stopping %s", ", ".join(f"{r} (process group {g})" for r, g in groups.items()))
        stop_groups(list(groups.values()))
    for pid in _owned_pids(cluster):  # Ray processes that left the groups, by pid
        logger.info("killing leftover process %d", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.processes.clear()
    existing = run_logged(["ip", "netns", "list"], check=False)
    for ns in (cluster.head_ns, cluster.worker_ns):
        if any(line.split()[0] == ns for line in existing.splitlines() if line.strip()):
            run_logged(["ip", "netns", "del", ns], check=False)  # takes its end of the veth along
    for link in cluster.links:  # an end left in this namespace by a failed set-up
        if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
            run_logged(["ip", "link", "del", link], check=False)
    if cluster.state_file.exists():
        cluster.save()
