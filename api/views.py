"""What status readers are served from memory, so that reads do not queue behind evaluations.

``GET /evaluations/{id}`` is what dashboards and clients poll, often a hundred at once, and event
streams follow the same evaluations. Both used to cost database reads and a thread-pool hop per
request; after every progress write, every poller missed at once and rendered the same answer in
parallel, queued behind the event streams reading the same new events (each its own read).

* :class:`EvaluationViews` keeps the rendered JSON of each evaluation. A write by the store drops
  it (so a read after a write never sees the old state) and, when someone has been reading it,
  renders the new one at once on one background thread; readers that arrive meanwhile wait for
  that one render instead of starting their own. A live evaluation's answer also ages (its
  request rate moves with time): after ``ttl_s`` the old answer is still served while a fresh
  one is rendered in the background.
* :class:`EventFeed` reads an evaluation's new events once per store change and hands the same
  list to every stream that follows it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore, EventRecord


@dataclass(frozen=True)
class Rendered:
    """One evaluation's answer, and whose evaluation it is (to check before it is served)."""

    answer: bytes
    owner: str


@dataclass
class _View:
    rendered: Rendered
    expires: float  # monotonic; inf for a terminal evaluation


class EvaluationViews:
    """JSON answers of ``GET /evaluations/{id}``, rendered once per change.

    Args:
        store: The service's database (its change notifications invalidate entries).
        build: Renders one evaluation's answer.
        ttl_s: Age after which a live evaluation's answer is re-rendered (served meanwhile).
        capacity: Most answers kept (least recently used ones go first).
    """

    def __init__(
        self,
        store: EvaluationStore,
        build: Callable[[EvaluationRecord], bytes],
        ttl_s: float,
        capacity: int = 4096,
    ) -> None:
        self._store = store
        self._build = build
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _View] = OrderedDict()
        self._rendering: dict[str, Future[Rendered]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayeval-views")
        store.on_change(self._changed)

    def cached(self, evaluation_id: str) -> Rendered | None:
        """The kept answer if the store has not written the evaluation since, else None.

        An answer older than ``ttl_s`` is still returned, and a fresh one is rendered behind it.
        """
        with self._lock:
            view = self._entries.get(evaluation_id)
            if view is None:
                return None
            self._entries.move_to_end(evaluation_id)
            if view.expires < time.monotonic():
                self._render_locked(evaluation_id)
            return view.rendered

    def render(self, evaluation_id: str) -> Future[Rendered]:
        """The answer as of now: the render in progress since the last write, or a new one.

        The future raises :class:`rayeval.service.vocabulary.errors.EvaluationNotFoundError` for an
        unknown id.
        """
        with self._lock:
            return self._render_locked(evaluation_id)

    def close(self) -> None:
        """Stop the render thread (pending renders are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _render_locked(self, evaluation_id: str) -> Future[Rendered]:
        future = self._rendering.get(evaluation_id)
        if future is None:
            future = self._executor.submit(self._render, evaluation_id)
            self._rendering[evaluation_id] = future
        return future

    def _render(self, evaluation_id: str) -> Rendered:
        version = self._store.version(evaluation_id)
        try:
            record = self._store.get(evaluation_id)
            answer = Rendered(self._build(record), record.owner)
        finally:
            with self._lock:
                if self._rendering.get(evaluation_id) is not None and (
                    self._store.version(evaluation_id) == version
                ):
                    self._rendering.pop(evaluation_id, None)
        expires = float("inf") if record.status.is_terminal else time.monotonic() + self._ttl_s
        with self._lock:
            if self._store.version(evaluation_id) == version:
                self._entries[evaluation_id] = _View(answer, expires)
                self._entries.move_to_end(evaluation_id)
                while len(self._entries) > self._capacity:
                    self._entries.popitem(last=False)
        return answer

    def _changed(self, evaluation_id: str) -> None:
        """The store wrote the evaluation: forget its answer; re-render it if it is read."""
        with self._lock:
            read = self._entries.pop(evaluation_id, None) is not None
            # A render that started before this write must not answer readers arriving after it.
            self._rendering.pop(evaluation_id, None)
            if read:
                self._render_locked(evaluation_id)


class EventFeed:
    """An evaluation's events after a point, read from the database once per store change.

    Every event stream of an evaluation asks after each change; the first one reads, the others
    get a slice of what it read (streams that resume from different points share it as long as
    the read started at or before their point). Reads are one at a time: each is one indexed
    query.

    Args:
        store: The service's database.
        page: Most events one read returns.
        capacity: Most evaluations whose last read is kept.
    """

    def __init__(self, store: EvaluationStore, page: int = 500, capacity: int = 256) -> None:
        self._store = store
        self._page = page
        self._capacity = capacity
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()
        self._reads: OrderedDict[str, tuple[int, int, list[EventRecord]]] = OrderedDict()
        store.on_change(self._changed)

    def events_since(self, evaluation_id: str, seq: int) -> list[EventRecord]:
        """Events numbered above ``seq``, in order (a page at most; ask again for more)."""
        with self._read_lock:
            version = self._store.version(evaluation_id)
            with self._lock:
                kept = self._reads.get(evaluation_id)
            if kept is not None and kept[0] == version and kept[1] <= seq:
                events = [event for event in kept[2] if event.seq > seq]
                if events or len(kept[2]) < self._page:
                    return events
            events = self._store.events_since(evaluation_id, seq, limit=self._page)
            with self._lock:
                if self._store.version(evaluation_id) == version:
                    self._reads[evaluation_id] = (version, seq, events)
                    self._reads.move_to_end(evaluation_id)
                    while len(self._reads) > self._capacity:
                        self._reads.popitem(last=False)
            return events

    def _changed(self, evaluation_id: str) -> None:
        with self._lock:
            self._reads.pop(evaluation_id, None)
