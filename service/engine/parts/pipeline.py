"""Running a large request type in parts, so the replicas start after one part's work.

Tokenising, checking and planning a million requests takes the driver minutes and gigabytes
before its first micro-batch could leave. Here a background thread (:class:`Planner`) makes and
plans the parts one after the other (their tokens made ahead by tokeniser actors where the
cluster has free CPUs: :mod:`rayeval.service.engine.plan.tokenisers`), at most :data:`AHEAD` ahead
of the dispatcher, while the dispatcher computes the parts before
(:meth:`rayeval.service.engine.dispatch.dispatcher.Dispatcher.add`); a finished part's answers are
read out and its micro-batches dropped (:class:`PartLedger`), so the driver holds the parts in
flight, not the whole plan. :func:`run_parts` wires them together for
any request type; what a part is and how it is planned is the request type's own:
loglikelihood in :mod:`rayeval.service.engine.parts.score`, generation in
:mod:`rayeval.service.engine.parts.generate`.

A part is a fixed run of requests in lm-eval's order (the first :data:`FIRST_PART` requests, then
runs of the request type's part size), planned exactly as any request set of that type is
planned, from its requests and the budget alone. Which micro-batch (or continuous-
batching group) a request lands in therefore depends on its part and the budget, never on R, G
or timing: results stay layout-independent. A request type of at most one part is not run here
at all: it is planned whole, as before.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rayeval.actors.errors import ResultIntegrityError
from rayeval.service.engine.dispatch import heap
from rayeval.service.engine.dispatch.dispatcher import (
    Dispatcher,
    PieceDone,
    StepDone,
    check_exactly_once,
)
from rayeval.service.engine.dispatch.phases import PhaseStats, PhaseTracker

#: Loglikelihood requests tokenised, checked and planned together (:class:`Tunables`).
SCORE_PART = 65536
#: Generation requests tokenised and planned together: a prompt costs the driver about as much
#: to tokenise as a loglikelihood request, but a part's groups reach the replicas sooner.
GENERATE_PART = 16384


@dataclass(frozen=True)
class Tunables:
    """The engine's settings no user sets, in one object that tests and benchmarks pass to
    :class:`rayeval.service.engine.lm.RayEvalLM` (``tunables=``).

    Args:
        score_part: A loglikelihood request type larger than this is planned in parts of it.
        generate_part: A generate_until request type larger than this is planned in parts of it.
        rank_class: The class of every rank actor (None: ``ShardWorker``); a benchmark's
            simulated rank, which loads no model (``tests/fakes/sim_rank.py``).
    """

    score_part: int = SCORE_PART
    generate_part: int = GENERATE_PART
    rank_class: type | None = None


#: Requests of a request type's first part (at most a part): the driver makes it itself, so
#: the first micro-batch leaves after a second's work, while tokeniser actors start.
FIRST_PART = 4096
#: Parts planned ahead of the dispatcher (bounds the driver's memory).
AHEAD = 2
#: Longest wait for the planning thread to take or give a part before looking again.
_POLL_S = 0.5


@dataclass
class PlannedPart:
    """A part's plan, the answers it needed no model call for, and its place in the dispatcher.

    Attributes:
        micro_batches: What the replicas compute (micro-batches or continuous-batching groups).
        computed: Per computed request, in plan order, its index in the whole request type.
        places: Per computed request, where its answer is in the part's results: the part's
            micro-batch first, then the indices inside that micro-batch's result (iterable
            more than once).
        given: Answers without a model call (checks, response cache), by index in the whole
            request type.
        cached: How many of ``given`` the response cache gave.
        store: Stores a finished micro-batch's answers (its index in the part, its result).
        store_piece: Stores a streamed piece's answers (group in the part, its finished).
        first: The dispatcher's index of its first micro-batch.
        left: Its micro-batches not back yet.
    """

    micro_batches: Sequence[Any]
    computed: Sequence[int]
    places: Iterable[tuple[int, ...]]
    given: dict[int, Any]
    cached: int = 0
    store: Callable[[int, Any], None] | None = None
    store_piece: Callable[[int, Sequence[tuple[int, Any]]], None] | None = None
    first: int = 0
    left: int = 0

    def counts(self) -> Counter[int]:
        """Requests per micro-batch, by the dispatcher's index."""
        return Counter(self.first + place[0] for place in self.places)

    def read(self, results: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """(index in the whole request type, answer) of each computed request, from the part's
        results."""
        for index, place in zip(self.computed, self.places, strict=True):
            answer = results[place[0]]
            for inner in place[1:]:
                answer = answer[inner]
            yield index, answer


def part_bounds(
    contexts: Sequence[str], size: int = SCORE_PART, first: int = FIRST_PART
) -> Iterator[tuple[int, int]]:
    """(start, stop) of each part: ``size`` requests (the first part ``first``, at most
    ``size``), extended while the context string stays the one of the part's last request."""
    start, length = 0, min(first, size)
    while start < len(contexts):
        stop = min(start + length, len(contexts))
        while stop < len(contexts) and contexts[stop] == contexts[stop - 1]:
            stop += 1
        yield start, stop
        start, length = stop, size


def even_bounds(total: int, size: int, first: int = FIRST_PART) -> Iterator[tuple[int, int]]:
    """(start, stop) of each part: ``size`` requests (the first ``first``, at most ``size``;
    the last one fewer)."""
    head = min(first, size, total)
    if head > 0:
        yield 0, head
    yield from ((start, min(start + size, total)) for start in range(head, total, size))


_END = object()


class Planner(threading.Thread):
    """Makes and plans the parts in the background, :data:`AHEAD` at most waiting, in order
    (a planner that keeps state from part to part, such as the sampling seeds' repeat counts,
    sees the requests in lm-eval's order).

    Args:
        parts: Each part, tokenised and checked, in order (made lazily, on this thread:
            :func:`rayeval.service.engine.plan.tokenisers.made_parts`).
        plan: Plans one part (and looks it up in the response cache); or returns a call that
            waits for its plan (planned elsewhere), made once the next part is made.
    """

    def __init__(
        self,
        parts: Iterable[Any],
        plan: Callable[[Any], PlannedPart | Callable[[], PlannedPart]],
    ) -> None:
        super().__init__(name="rayeval-part-planner", daemon=True)
        self._parts, self._plan = parts, plan
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=AHEAD)
        self._stopped = threading.Event()

    def run(self) -> None:
        try:
            waiting: Callable[[], PlannedPart] | None = None
            for part in self._parts:
                planned = self._plan(part)
                heap.settle()  # the part and its plan live until it is back: no full GC pass
                if waiting is not None and not self._give(waiting()):
                    return
                waiting = planned if callable(planned) else None
                if waiting is None and not self._give(planned):
                    return
            if waiting is not None and not self._give(waiting()):
                return
            self._give(_END)
        except BaseException as exc:  # handed to the driver's thread, raised there
            self._give(exc)

    def _give(self, item: Any) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take(self, wait_s: float) -> PlannedPart | None:
        """The next planned part; None if none came within ``wait_s``.

        Raises:
            StopIteration: every part was given.
            BaseException: what planning a part raised.
        """
        try:
            item = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Stop after the part in hand (an error ended the run)."""
        self._stopped.set()


class PartLedger:
    """Which part each dispatched micro-batch belongs to, and the answers read out so far.

    Args:
        total: Requests of the whole request type.
        finish: Called with a part whose micro-batches are all back.
    """

    def __init__(self, total: int, finish: Callable[[PlannedPart], None]) -> None:
        self.answers: list[Any] = [None] * total
        self._starts: list[int] = []
        self._parts: list[PlannedPart | None] = []  # None once finished: its plan is dropped
        self._finish = finish

    def add(self, planned: PlannedPart, first: int) -> None:
        """A part whose micro-batches start at the dispatcher's index ``first``."""
        planned.first, planned.left = first, len(planned.micro_batches)
        for index, answer in planned.given.items():
            self.answers[index] = answer
        if planned.left == 0:
            self._finish(planned)
            return
        self._starts.append(first)
        self._parts.append(planned)

    def _part(self, micro_batch: int) -> tuple[int, PlannedPart]:
        at = bisect.bisect_right(self._starts, micro_batch) - 1
        planned = self._parts[at]
        if planned is None:
            raise ResultIntegrityError(
                f"micro-batch {micro_batch} came back after its part was finished (a request "
                "id is duplicated: please report this bug)"
            )
        return at, planned

    def back(self, micro_batch: int, result: Any) -> None:
        """One micro-batch came back (the dispatcher's index)."""
        at, planned = self._part(micro_batch)
        if planned.store is not None:
            planned.store(micro_batch - planned.first, result)
        planned.left -= 1
        if planned.left == 0:
            self._finish(planned)
            self._parts[at] = None

    def piece(self, micro_batch: int, finished: Sequence[tuple[int, Any]]) -> None:
        """Some requests of a streamed group finished (the dispatcher's index of the group)."""
        if not finished:
            return
        _, planned = self._part(micro_batch)
        if planned.store_piece is not None:
            planned.store_piece(micro_batch - planned.first, finished)

    def check(self) -> list[Any]:
        """Every request's answer, once all parts finished.

        Raises:
            ResultIntegrityError: a request has no answer.
        """
        missing = sum(1 for answer in self.answers if answer is None)
        if missing or any(part is not None for part in self._parts):
            raise ResultIntegrityError(
                f"{missing} requests came back without an answer (a request id is missing: "
                "please report this bug)"
            )
        return self.answers


def run_parts(
    dispatcher: Dispatcher,
    planner: Planner,
    tracker: PhaseTracker,
    stats: PhaseStats,
    total: int,
    streamed: bool,
    on_part: Callable[[list[int], list[Any]], None] | None = None,
) -> list[Any]:
    """Every answer, in order, of the ``total`` requests that ``planner`` (not started yet)
    plans in parts: each part joins ``dispatcher`` (made empty, of the parts' kind) once taken;
    each finished part's answers are read out (every micro-batch exactly once) and its
    micro-batches dropped. ``streamed``: the parts are continuous-batching groups, whose
    answers arrive in pieces; ``tracker`` expects ``total`` requests; ``on_part(indices,
    answers)``: called once a part's requests all have their answers.
    """

    def finish(planned: PlannedPart) -> None:
        indices = range(planned.first, planned.first + len(planned.micro_batches))
        results = dispatcher.results(indices)
        check_exactly_once(planned.micro_batches, results)
        for index, answer in planned.read(results):
            ledger.answers[index] = answer
        dispatcher.forget(indices)
        if on_part is not None:
            on_part(sorted([*planned.computed, *planned.given]), ledger.answers)

    def feed(wait_s: float) -> bool:
        try:
            planned = planner.take(wait_s)
        except StopIteration:
            return False
        if planned is not None:
            stats.cached += planned.cached
            stats.micro_batches += len(planned.micro_batches)
            ledger.add(planned, dispatcher.add(planned.micro_batches))
            tracker.expect(planned.counts(), len(planned.given))
        return True

    def on_step(step: StepDone) -> None:
        if not streamed:  # streamed groups reported their pieces already
            tracker.step(step)
        for micro_batch, result in zip(step.micro_batches, step.results, strict=True):
            ledger.back(micro_batch, result)

    def on_piece(piece: PieceDone) -> None:
        tracker.piece(piece)
        if piece.micro_batch is not None:
            ledger.piece(piece.micro_batch, piece.finished)

    ledger = PartLedger(total, finish)
    with heap.frozen_while_running():
        planner.start()
        try:
            dispatcher.run(on_step, on_piece if streamed else None, feed=feed)
        finally:
            planner.stop()
            tracker.close()
    return ledger.check()
