"""Warm replicas: runner actors kept loaded after their evaluation succeeded.

With ``warm_replicas`` > 0, the runner of an evaluation that succeeded keeps its loaded ranks and
placement group (:class:`KeptRunners`); the next evaluation of the same model and layout
(:func:`rayeval.service.engine.dispatch.warm.replica_key`) is handed to that runner
(``EvaluationRunner.start_next``) instead of starting and loading a new one. A kept runner is
known by its owner: the evaluation whose names the runner, ranks and placement group carry. At
most ``capacity`` runners are kept, one per key, least recently kept released first; admission
(:func:`rayeval.service.jobs.admission.plan`) says when a queued evaluation needs their room.
Used by the manager's polling thread only. No torch here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import ray

from rayeval.service.jobs.admission import Kept
from rayeval.service.jobs.ray_resources import brief

logger = logging.getLogger(__name__)

#: Releases a runner and what it holds, by its owner's names: ``release(owner, handle)``.
Release = Callable[[str, Any], object]


class KeptRunners:
    """The kept runners, least recently kept first.

    Args:
        capacity: Most runners kept (0: none; every runner is released when its evaluation ends).
        release: Releases a runner no longer kept (the manager does it in the background).
    """

    def __init__(self, capacity: int, release: Release) -> None:
        self._capacity = capacity
        self._release = release
        self._kept: OrderedDict[str, tuple[Kept, Any]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """Whether runners are kept at all."""
        return self._capacity > 0

    def entries(self) -> list[Kept]:
        """What is kept, least recently kept first."""
        return [entry for entry, _ in self._kept.values()]

    def keep(self, entry: Kept, handle: Any) -> None:
        """Keep the runner ``handle`` (serving ``entry.key``); older ones give way as needed."""
        for owner, (kept, _) in list(self._kept.items()):  # one kept runner per key
            if kept.key == entry.key:
                self.release(owner)
        self._kept[entry.owner] = (entry, handle)
        while len(self._kept) > self._capacity:
            self.release(next(iter(self._kept)))
        logger.info("keeping the replicas of %s loaded for the next evaluation", entry.owner)

    def hand_over(
        self, owner: str, evaluation_id: str, config: dict[str, Any], timeout_s: float
    ) -> Any | None:
        """Run an evaluation on the runner kept by ``owner``; it is no longer kept either way.

        Args:
            owner: Whose runner.
            evaluation_id: The evaluation to run.
            config: Its ``EvaluationConfig.to_json()``.
            timeout_s: Bound on the runner's answer.

        Returns:
            The runner's handle; None (and the runner is released) when it cannot run it.
        """
        _, handle = self._kept.pop(owner)
        try:
            started = ray.get(handle.start_next.remote(evaluation_id, config), timeout=timeout_s)
        except Exception as exc:  # the runner died while kept: start anew
            logger.warning("the kept runner of %s cannot be reused: %s", owner, brief(exc))
            started = False
        if not started:
            self._release(owner, handle)
            return None
        return handle

    def release(self, owner: str) -> None:
        """Stop keeping the runner of ``owner`` and release it."""
        _, handle = self._kept.pop(owner)
        self._release(owner, handle)

    def release_all(self, release: Release) -> None:
        """Release every kept runner with ``release`` (at shutdown: in the caller's thread)."""
        for owner, (_, handle) in list(self._kept.items()):
            release(owner, handle)
        self._kept.clear()
