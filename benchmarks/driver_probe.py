"""What ``bench_driver.py`` reads from its own process while the driver works.

:class:`DriverProbe` is handed to ``RayEvalLM`` as its progress callback: it notes when the first
and the last progress came (the first micro-batch's results, the last one's), the process's CPU
time then, and its peak resident memory (``VmHWM`` from ``/proc/self/status``, reset at
submission through ``/proc/self/clear_refs``; without that file, the current ``VmRSS`` sampled on
every progress).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def rss_mib(key: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or peak (``VmHWM``), in MiB (0.0: unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (True if it could)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_s() -> float:
    """CPU seconds of this process, every thread (Ray's core worker threads included)."""
    times = os.times()
    return times.user + times.system


@dataclass
class Mark:
    """The process at one moment."""

    wall: float
    cpu: float
    peak_mib: float
    done: int = 0


@dataclass
class DriverProbe:
    """Progress callback that records the driver's time, CPU and memory (see module doc)."""

    start: Mark | None = None
    first: Mark | None = None
    last: Mark | None = None
    reports: int = 0
    _sampled_peak: float = 0.0
    _peak_resets: bool = field(default=False, repr=False)

    def submit(self) -> None:
        """Call right before the request method: the reference point of every figure."""
        self._peak_resets = reset_peak()
        self._sampled_peak = rss_mib()
        self.start = Mark(time.monotonic(), cpu_s(), self._peak())
        self.first = self.last = None
        self.reports = 0

    def __call__(self, progress: Any) -> None:
        mark = Mark(time.monotonic(), cpu_s(), self._peak(), progress.done)
        self.reports += 1
        if self.first is None:
            self.first = mark
        self.last = mark

    def end(self) -> Mark:
        """The process when the request method returned."""
        return Mark(time.monotonic(), cpu_s(), self._peak())

    def _peak(self) -> float:
        if self._peak_resets:
            return rss_mib("VmHWM")
        self._sampled_peak = max(self._sampled_peak, rss_mib())
        return self._sampled_peak
