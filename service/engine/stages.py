"""What one evaluation does while no batch moves, reported as it changes.

Between a submission and its first batch, and after its last, a user sees no request move: the
ranks are placed, then load the model while lm-eval builds its requests on the driver; after the
last request type lm-eval computes the metrics (bootstrap errors included). :class:`Stages`
reports each of these as a :class:`rayeval.service.vocabulary.events.Stage`, and while ranks load
it reports every rank that finished (a thread asks the worker group, without waiting on it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rayeval.actors.group import WorkerGroup
from rayeval.service.vocabulary.events import Stage, StageName

logger = logging.getLogger(__name__)

#: Seconds between two looks at how many ranks have loaded.
POLL_S = 0.5


class Stages:
    """Reports an evaluation's stages to ``on_stage`` (nothing without it).

    Args:
        on_stage: Called with each new stage, and again when the ranks' loading moved.
    """

    def __init__(self, on_stage: Callable[[Stage], None] | None) -> None:
        self._on_stage = on_stage
        self._lock = threading.Lock()
        self._stage: Stage | None = None
        self._group: WorkerGroup | None = None
        self._closed = threading.Event()
        self._poller: threading.Thread | None = None

    def enter(self, name: StageName, ranks: int | None = None) -> None:
        """The evaluation entered stage ``name`` (``ranks``: placing that many)."""
        with self._lock:
            if self._stage is not None and self._stage.name is name:
                return
            ready, total = self._loading()
            if name is StageName.PLACING:
                ready, total = None, ranks
            elif name is StageName.LOADING and ready == total:
                name = StageName.COMPUTING  # loaded already (or none started): no wait
                if self._stage is not None and self._stage.name is name:
                    return
            self._report(Stage(name=name, started_at=time.time(), ranks_ready=ready, ranks=total))

    def follow(self, group: WorkerGroup) -> None:
        """``group``'s ranks load now: report each that finishes until all have."""
        with self._lock:
            self._group = group
        if self._on_stage is None or self._poller is not None:
            return
        self._poller = threading.Thread(target=self._poll, name="rayeval-stages", daemon=True)
        self._poller.start()

    def close(self) -> None:
        """Stop following the ranks' loading."""
        self._closed.set()

    def _loading(self) -> tuple[int | None, int | None]:
        """(ranks loaded, ranks) of the group (None, None: none started)."""
        if self._group is None:
            return None, None
        try:
            return self._group.ranks_loaded(), self._group.layout.world
        except Exception:  # the group was closed under us; the next wait on it says why
            return None, None

    def _report(self, stage: Stage) -> None:
        self._stage = stage
        if self._on_stage is not None:
            self._on_stage(stage)

    def _poll(self) -> None:
        while not self._closed.wait(POLL_S):
            with self._lock:
                stage = self._stage
                ready, total = self._loading()
                if stage is None or total is None or ready == stage.ranks_ready:
                    continue
                update: dict[str, object] = {"ranks_ready": ready, "ranks": total}
                if stage.name is StageName.LOADING and ready == total:
                    update.update(name=StageName.COMPUTING, started_at=time.time())
                self._report(stage.model_copy(update=update))
                if ready == total:
                    return
