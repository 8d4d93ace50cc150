"""Rendered evaluation views, kept in memory so that status reads do not queue.

``GET /evaluations/{id}`` is what dashboards and clients poll, often many at once. Rendering one
costs several database reads and a validation of the stored config; the answer only changes when
the store writes the evaluation (it tells :class:`EvaluationViews` so) or, while it runs, as time
passes (its request rate). A rendered answer is therefore served from memory until the store
changes the evaluation or, for a live one, for at most ``ttl_s``; a terminal one stays until
evicted. Serving from memory needs no thread, so a poll never waits behind the database or a
busy thread pool.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from service.jobs.store import EvaluationRecord, EvaluationStore


class EvaluationViews:
    """JSON answers of ``GET /evaluations/{id}``, rendered once per change.

    Args:
        store: The service's database (its change notifications invalidate entries).
        ttl_s: Longest a live (not terminal) evaluation's answer is served unchanged.
        capacity: Most answers kept (least recently used ones go first).
    """

    def __init__(self, store: EvaluationStore, ttl_s: float, capacity: int = 4096) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        store.on_change(self.invalidate)

    def cached(self, evaluation_id: str) -> bytes | None:
        """The rendered answer if it is still current, else None."""
        with self._lock:
            entry = self._entries.get(evaluation_id)
            if entry is None or entry[0] < time.monotonic():
                return None
            self._entries.move_to_end(evaluation_id)
            return entry[1]

    def render(self, evaluation_id: str, build: Callable[[EvaluationRecord], bytes]) -> bytes:
        """Render the answer from the database and keep it, unless the store changed meanwhile.

        Raises:
            EvaluationNotFoundError: unknown id.
        """
        version = self._store.version(evaluation_id)
        record = self._store.get(evaluation_id)
        answer = build(record)
        expires = float("inf") if record.status.is_terminal else time.monotonic() + self._ttl_s
        with self._lock:
            if self._store.version(evaluation_id) == version:
                self._entries[evaluation_id] = (expires, answer)
                self._entries.move_to_end(evaluation_id)
                while len(self._entries) > self._capacity:
                    self._entries.popitem(last=False)
        return answer

    def invalidate(self, evaluation_id: str) -> None:
        """Forget the evaluation's answer (the store wrote it)."""
        with self._lock:
            self._entries.pop(evaluation_id, None)
