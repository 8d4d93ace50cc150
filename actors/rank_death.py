"""What is known of a rank whose process died: which rank, the signal, its last lines of output.

Ray reports a dead actor as ``ActorDiedError`` with the actor's name, pid and node address, and
"the worker unexpectedly exits": not the signal, not the exit code, not what the process printed.
Those are in the worker's own log files on its node (``worker-<id>-<job>-<pid>.err`` and
``.out`` in the session's log folder), where Ray sends a rank's stdout and stderr: a fatal signal
leaves Ray's ``*** SIGSEGV received`` and Python's ``Fatal Python error:`` with the Python stack
there, an abort inside gloo or NCCL the C++ ``terminate called after throwing ...`` line.
:func:`death_report` reads them with a zero-CPU task placed on the dead rank's node (so it works
for a rank on another node), which finds the folder from its own stderr (``/proc/self/fd/2``),
and words what they say. Every read is bounded: a lost node or a slow task gives a report without
the lines, never a wait.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)

#: Lines of a dead rank's output a report keeps.
TAIL_LINES = 12
_FIELD = re.compile(r"^\s*(pid|name|ip): (\S+)\s*$", re.M)
_RANK_NAME = re.compile(r"-r(\d+)-s(\d+)$")
_SIGNAL = re.compile(r"\*\*\* (SIG[A-Z]+) received")
_FATAL = re.compile(r"Fatal Python error: (.+)")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_MARKER = re.compile(f"{_SIGNAL.pattern}|{_FATAL.pattern}|{_TERMINATE.pattern}|what\\(\\):")
#: Lines of a fault dump that say nothing about the rank (Ray's and Python's boilerplate).
_NOISE = re.compile(
    r"^(:job_id:|:actor_name:|:task_name:|Extension modules:|PC: @|\s*@ )"
    r"|logging\.cc:\d+:\s+(@|PC: @)|site-packages/ray/"
)


@dataclass(frozen=True)
class DeathReport:
    """A dead rank: ``who`` (``replica R rank S``, or the actor's name), its pid and node, how it
    ended (``cause``) and its last lines of output (stderr, then stdout if stderr has none)."""

    who: str
    pid: str
    ip: str
    cause: str
    lines: tuple[str, ...] = ()
    #: Where the lines were read, or why they could not be.
    source: str = ""

    def summary(self) -> str:
        """One line: which rank, where, and how it ended."""
        return f"{self.who} (pid {self.pid} on {self.ip}) died: {self.cause}"

    def __str__(self) -> str:
        if not self.lines:
            return f"{self.summary()} ({self.source})" if self.source else self.summary()
        shown = "\n".join(f"    {line}" for line in self.lines)
        return f"{self.summary()}; its last lines of output ({self.source}):\n{shown}"


def death_report(exc: BaseException, timeout_s: float = 10.0) -> DeathReport:
    """What Ray's ``exc`` (a ``RayActorError``) and the dead rank's log files say of it."""
    text = str(exc)
    fields = dict(_FIELD.findall(text))
    name, pid, ip = fields.get("name", ""), fields.get("pid", "?"), fields.get("ip", "?")
    match = _RANK_NAME.search(name)
    who = f"replica {match[1]} rank {match[2]}" if match else (name or "a rank")
    lines: list[str] = []
    markers: list[str] = []
    source = ""
    if pid.isdigit() and ip != "?" and "ray.kill" not in text:  # a kill says nothing more
        lines, markers, source = _read_output(int(pid), ip, timeout_s)
    return DeathReport(who, pid, ip, _cause(markers, text), tuple(lines), source)


def _cause(markers: list[str], ray_text: str) -> str:
    """How the process ended, from the lines of its output that say (a signal, a fatal error,
    a C++ abort) or Ray's own text."""
    joined = "\n".join(markers)
    parts = []
    if signal := _SIGNAL.search(joined):
        parts.append(f"killed by {signal[1]}")
    if fatal := _FATAL.search(joined):
        parts.append(f"Fatal Python error: {fatal[1].strip()}")
    if thrown := _TERMINATE.search(joined):
        what = re.search(r"what\(\):\s*(.+)", joined)
        parts.append(f"a C++ {thrown[1]} was not caught" + (f" ({what[1][:200]})" if what else ""))
    if parts:
        return "; ".join(parts)
    if "low on memory" in ray_text or "OOM" in ray_text.split("Worker exit detail:")[0]:
        return "killed by Ray's memory monitor (the node ran low on memory)"
    if "ray.kill" in ray_text:
        return "killed by ray.kill"
    return (
        "its process ended without a signal or fatal error in its output (an exit(); Ray does "
        "not report the exit code)"
    )


def _read_output(pid: int, ip: str, timeout_s: float) -> tuple[list[str], list[str], str]:
    """The last lines of ``pid``'s Ray log files on the node at ``ip``, the lines that say how
    it ended, and where they were read (or why not)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = next((n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip), None)
    if node is None:
        return [], [], f"its node {ip} is gone with its log files"
    reader = ray.remote(num_cpus=0, max_retries=0)(_tail_of_worker_logs)
    ref = reader.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    ).remote(pid, TAIL_LINES)
    try:
        lines, markers, path = ray.get(ref, timeout=timeout_s)
    except Exception as exc:  # any failure to read only loses the lines, never the report
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
        logger.debug("could not read the output of pid %d on %s: %s", pid, ip, exc)
        return [], [], f"its output could not be read on {ip}: {type(exc).__name__}"
    return lines, markers, path or f"no log file of pid {pid} on {ip}"


def _tail_of_worker_logs(pid: int, count: int) -> tuple[list[str], list[str], str]:
    """Run on the dead rank's node: the last ``count`` lines of its stderr (its stdout where
    stderr says nothing), the lines that say how it ended, and the file's path; the log folder
    is this task's own."""
    folder = os.path.dirname(os.readlink("/proc/self/fd/2"))
    markers: list[str] = []
    for suffix in ("err", "out"):
        paths = glob.glob(os.path.join(folder, f"worker-*-{pid}.{suffix}"))
        if not paths:
            continue
        path = max(paths, key=os.path.getmtime)
        with open(path, "rb") as file:
            file.seek(max(0, os.path.getsize(path) - 65536))
            text = file.read().decode(errors="replace")
        lines = [line.rstrip() for line in text.splitlines()]
        markers += [line for line in lines if _MARKER.search(line)]
        lines = [line for line in lines if line.strip() and not _NOISE.search(line)]
        if lines:
            return lines[-count:], markers, path
    return [], markers, ""
