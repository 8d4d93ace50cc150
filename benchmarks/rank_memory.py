"""Memory of rank processes, read from ``/proc/<pid>/status`` by a driver thread.

:class:`RankSampler` finds the rank actors of one worker group in Ray's actor table and keeps,
per rank and per phase, the peak private anonymous memory (``RssAnon``) and the kernel's
high-water mark (``VmHWM``). :class:`EmptyRank` is the baseline: an idle actor that imported what
a rank imports and holds no weights.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUS_FIELDS = ("RssAnon", "VmHWM", "VmRSS")
PHASES = ("load", "loglikelihood", "generate_until")


def read_status(pid: int) -> dict[str, int] | None:
    """``RssAnon``, ``VmHWM`` and ``VmRSS`` of ``pid`` in bytes, or None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    figures = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            figures[key] = int(value.split()[0]) * 1024  # the kernel reports kB
    return figures if len(figures) == len(STATUS_FIELDS) else None


@dataclass
class RankMemory:
    """What the sampler saw of one rank process, in bytes."""

    name: str
    pid: int
    peak_anon: dict[str, int] = field(default_factory=dict)  # per phase
    last_anon: int = 0
    vm_hwm: int = 0
    samples: int = 0


class RankSampler:
    """A driver thread that samples ``/proc/<pid>/status`` of the actors named ``prefix-*``.

    Args:
        prefix: The worker group's name; its rank actors are ``<prefix>-r<replica>-s<shard>``.
        interval_s: Seconds between samples.
    """

    def __init__(self, prefix: str, interval_s: float) -> None:
        self._prefix = prefix + "-"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-sampler", daemon=True)
        #: Where the evaluation is; set by the driver thread, read by the sampler.
        self.phase = "load"
        self.ranks: dict[str, RankMemory] = {}

    def __enter__(self) -> RankSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        next_lookup = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_lookup:  # the actor table is a GCS round-trip: not every sample
                self._find_ranks()
                next_lookup = now + 0.5
            self.sample()
            self._stop.wait(self._interval_s)

    def sample(self) -> None:
        """Read every known rank once."""
        for rank in list(self.ranks.values()):
            figures = read_status(rank.pid)
            if figures is None:
                continue
            phase = self.phase
            rank.peak_anon[phase] = max(rank.peak_anon.get(phase, 0), figures["RssAnon"])
            rank.last_anon = figures["RssAnon"]
            rank.vm_hwm = max(rank.vm_hwm, figures["VmHWM"])
            rank.samples += 1

    def _find_ranks(self) -> None:
        from ray._private import state

        for info in state.actors().values():
            name, pid = info.get("Name") or "", info.get("Pid") or 0
            fresh = name.startswith(self._prefix) and name not in self.ranks
            if fresh and pid and info.get("State") == "ALIVE":
                self.ranks[name] = RankMemory(name=name, pid=pid)

    def track(self, lm: Any) -> None:
        """Set :attr:`phase` while lm-eval is inside ``lm.loglikelihood`` / ``generate_until``."""
        for phase in PHASES[1:]:
            setattr(lm, phase, self._in_phase(phase, getattr(lm, phase)))

    def _in_phase(self, phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.phase = phase
            try:
                return method(*args, **kwargs)
            finally:
                self.sample()
                self.phase = "between"  # lm-eval's own work on the driver

        return tracked


class EmptyRank:
    """An idle actor with what a rank imports and no weights: the baseline of every figure.

    It imports torch, transformers and the rank code, and builds the model on the meta device
    (which imports its modeling code and holds no tensor data): memory that every rank pays
    whatever the model's size.
    """

    def measure(self, model_dir: str) -> dict[str, int]:
        """Import and build on meta what a rank would for ``model_dir``; this process's memory."""
        import gc

        import torch
        import transformers

        import rayeval.actors.worker  # noqa: F401

        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
        gc.collect()
        figures = read_status(os.getpid())
        assert figures is not None
        return figures
