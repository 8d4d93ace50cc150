"""What several benchmarks share: the environment, layouts, task managers, timing and tables.

``set_environment`` (offline Hugging Face, local Ray without auth), ``parse_layout`` (``RxG``),
``make_task_manager``, :class:`PhaseTimer` (seconds inside the LM's request methods, per request
type, in :class:`PhaseFigures`) and ``format_table`` (the aligned text tables they print).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PHASES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def set_environment(local_ray: bool) -> None:
    """Offline Hugging Face (the ranks inherit it), quiet tokenizers, local Ray without auth."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if local_ray:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster only


def parse_layout(text: str) -> tuple[int, int]:
    """``RxG`` (e.g. ``2x1``) as ``(R, G)``.

    Raises:
        ValueError: ``text`` is not ``RxG`` with R, G >= 1.
    """
    try:
        replicas, shards = (int(part) for part in text.strip().lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r} is not RxG, e.g. 2x1") from None
    if replicas < 1 or shards < 1:
        raise ValueError(f"layout {text!r}: R and G must be >= 1")
    return replicas, shards


def make_task_manager(tasks: list[str], include_path: str) -> Any:
    """Only the include path when it has every task (skips lm-eval's index scan), else both."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_defaults=False, include_path=include_path)
    if all(local.match_tasks([task]) for task in tasks):
        return local
    return TaskManager(include_path=include_path)


@dataclass
class PhaseFigures:
    """One request type on one row."""

    requests: int = 0
    seconds: float = 0.0  # inside the LM method
    engine_seconds: float | None = None  # rayeval: dispatch wall time (lm.engine.stats)
    micro_batches: int | None = None
    real_tokens: int | None = None
    padded_tokens: int | None = None
    replica_utilisation: dict[int, float] | None = None  # rayeval: busy share per replica

    def real_token_fraction(self) -> float | None:
        """Real / padded tokens, or None where rayeval's planner did not count them."""
        if self.real_tokens is None or not self.padded_tokens:
            return None
        return self.real_tokens / self.padded_tokens


class PhaseTimer:
    """Times the LM's request methods (the calls lm-eval's evaluator makes) on one instance."""

    def __init__(self, lm: Any) -> None:
        self.phases: dict[str, PhaseFigures] = {}
        for phase in PHASES:
            setattr(lm, phase, self._wrap(phase, getattr(lm, phase)))

    def _wrap(self, phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            figures = self.phases.setdefault(phase, PhaseFigures())
            started = time.perf_counter()
            try:
                return method(requests, *args, **kwargs)
            finally:
                figures.seconds += time.perf_counter() - started
                figures.requests += len(requests)

        return timed


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
