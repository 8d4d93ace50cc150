"""The driver's heap kept out of the cyclic collector's full passes while a request type runs.

A million requests are lm-eval ``Instance``s, their arguments and what the driver makes of them:
millions of objects that live as long as the request type. Every full (oldest-generation) pass
of Python's cyclic garbage collector walks all of them, and the parts' own allocations start
such a pass every few seconds: ~20% of the driver's CPU in a 200,000-request generation run on
the 2-core machine (``docs/performance-notes.md``), and a pass over a large plan stalls the hand-out
long enough to idle every replica. While a request type's micro-batches are computed
(:meth:`rayeval.service.engine.dispatch.dispatcher.Dispatcher.run`, whole plans and parts alike),
what the process holds is frozen (``gc.freeze``: moved to the permanent generation, which no pass
walks) when it starts and again every :data:`~rayeval.service.engine.dispatch.dispatcher.SETTLE_S`
(the answers gathered); a request type run in parts
(:func:`rayeval.service.engine.parts.pipeline.run_parts`) is frozen from before its planning thread
starts, and again after each part is planned. A pass walks only what was made since. When the last
such scope ends everything is unfrozen (``gc.unfreeze``) and the next full pass collects whatever
cycles were dropped meanwhile. Objects still die by reference counting at once; only garbage in
reference cycles waits for the end. Request types that overlap in one process unfreeze when the last
one ends.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager


class _Freezer:
    """How many request types are running (the heap is frozen while any is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._settled = 0.0

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
            gc.freeze()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    gc.unfreeze()

    def settle(self, every_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            if self._running and now - self._settled >= every_s:
                gc.freeze()
                self._settled = now


_FREEZER = _Freezer()


def frozen_while_running() -> AbstractContextManager[None]:
    """The scope of one request type run in parts: the heap frozen as it starts, unfrozen as
    the last such scope ends."""
    return _FREEZER.running()


def settle(every_s: float = 0.0) -> None:
    """Freeze what was made so far (a part just planned, the answers gathered so far), unless
    the last freeze was under ``every_s`` seconds ago; nothing outside a running scope."""
    _FREEZER.settle(every_s)
