"""What the manager knows of each evaluation beyond the database: one object per evaluation.

The store keeps what must survive a restart. :class:`Followed` keeps what only this API process
knows, and re-derives after a restart (runners are found by name): the runner actor's handle, whose
names its resources carry when it is a kept runner, the call for new events in flight and when it
was sent, when the runner last reported something new, whether a cancel is releasing the
evaluation, and its replica key (computed once, for admission). :class:`FollowedEvaluations` is
the one dict of them, shared by the polling thread (following, the watchdog, admission,
warm-keeping) and request threads (cancel). No Ray and no torch here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass
class Followed:
    """One evaluation as this API process follows it (times are monotonic seconds).

    Attributes:
        evaluation_id: The evaluation.
        runner: Its runner actor's handle (None: not looked up yet, or let go).
        owner: When it runs on a kept runner: the evaluation whose names that runner, its ranks
            and its placement group carry (None: its own).
        call: The call for its new events not answered yet.
        asked_at: When ``call`` was sent.
        heard_at: When its runner last reported something new (or was started).
        cancelling: A cancel is releasing it: nothing else may end it meanwhile.
        key: Its replica key, once computed
            (:func:`rayeval.service.engine.dispatch.warm.replica_key`).
    """

    evaluation_id: str
    runner: Any | None = None
    owner: str | None = None
    call: Any | None = None
    asked_at: float | None = None
    heard_at: float | None = None
    cancelling: bool = False
    key: str | None = None

    @property
    def names(self) -> str:
        """The evaluation whose names its runner, ranks and placement group carry."""
        return self.owner or self.evaluation_id

    def ask(self, call: Any, now: float) -> None:
        """A call for its new events was sent at ``now``."""
        self.call, self.asked_at = call, now

    def answered(self) -> None:
        """The call in flight was answered, or is given up."""
        self.call, self.asked_at = None, None

    def let_go(self) -> tuple[str, Any | None]:
        """Stop following its runner: whose names it carries and its handle, now forgotten."""
        names, handle = self.names, self.runner
        self.runner, self.owner, self.heard_at = None, None, None
        self.answered()
        return names, handle


class FollowedEvaluations:
    """Every evaluation this process follows, by id; safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Followed] = {}

    def __getitem__(self, evaluation_id: str) -> Followed:
        """The evaluation's state, created empty if it has none."""
        with self._lock:
            followed = self._by_id.get(evaluation_id)
            if followed is None:
                followed = self._by_id[evaluation_id] = Followed(evaluation_id)
            return followed

    def get(self, evaluation_id: str) -> Followed | None:
        """The evaluation's state, if it has one."""
        with self._lock:
            return self._by_id.get(evaluation_id)

    def all(self) -> list[Followed]:
        """Every state (a snapshot)."""
        with self._lock:
            return list(self._by_id.values())

    def asking(self) -> list[Followed]:
        """The states with a call for events in flight."""
        return [followed for followed in self.all() if followed.call is not None]

    def owners(self) -> dict[str, str]:
        """Evaluations running on kept runners -> the evaluation whose names those carry."""
        return {f.evaluation_id: f.owner for f in self.all() if f.owner is not None}

    def follow(self, evaluation_id: str, handle: Any, owner: str, heard: bool) -> None:
        """Follow the evaluation on the runner ``handle``, which carries ``owner``'s names
        (its own, or a kept runner's first evaluation's); ``heard``: it counts as heard now."""
        followed = self[evaluation_id]
        followed.runner = handle
        followed.owner = owner if owner != evaluation_id else None
        if heard:
            followed.heard_at = time.monotonic()

    def drop(self, evaluation_id: str) -> None:
        """Forget the evaluation."""
        with self._lock:
            self._by_id.pop(evaluation_id, None)

    def keep_only(self, evaluation_ids: Collection[str]) -> None:
        """Forget every evaluation not in ``evaluation_ids`` and not being cancelled."""
        with self._lock:
            for evaluation_id, followed in list(self._by_id.items()):
                if evaluation_id not in evaluation_ids and not followed.cancelling:
                    del self._by_id[evaluation_id]
