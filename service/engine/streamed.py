"""Scoring many loglikelihood requests in parts, so the replicas start after one part's work.

Tokenising, checking and planning a million requests takes the driver minutes and gigabytes
before its first micro-batch could leave. Here a background thread does them part by part
(:data:`SCORE_PART` requests at a time, at most :data:`AHEAD` parts ahead) while the dispatcher
computes the parts before (:meth:`rayeval.service.engine.dispatch.Dispatcher.add`); a finished
part's answers are read out and its micro-batches dropped, so the driver holds the parts in
flight, not the whole plan.

A part is a fixed run of requests in lm-eval's order, cut only where the context string changes
(a question's choices stay together, as lm-eval's checks and shared-prefix packing need), and
planned exactly as :func:`rayeval.service.engine.planner.plan_score` plans any request set. Which
micro-batch a request lands in therefore depends on its part and the budget, never on R, G or
timing: results stay layout-independent. A request type of at most :data:`SCORE_PART` requests
is one part, planned as before.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rayeval.actors.batches import ScoreMicroBatch
from rayeval.actors.errors import ResultIntegrityError
from rayeval.service.engine.checks import Inspection
from rayeval.service.engine.encoder import encode_pairs
from rayeval.service.engine.planner import ScorePlan, TokenBudget, plan_score
from rayeval.service.engine.response_cache import ResponseCache, score_key

#: Requests tokenised, checked and planned together.
SCORE_PART = 65536
#: Parts planned ahead of the dispatcher (bounds the driver's memory).
AHEAD = 2
#: Longest wait for the planning thread to take or give a part before looking again.
_POLL_S = 0.5


@dataclass
class ScorePart:
    """One part's requests, tokenised and checked (made by the LM, planned here).

    Attributes:
        start: Index of its first request in the whole request type.
        pairs: The (context, continuation) tokens of the requests to compute.
        todo: Their indices in the whole request type.
        fixed: Answers given without a model call, by index in the whole request type.
    """

    start: int
    pairs: list[tuple[Sequence[int], Sequence[int]]]
    todo: list[int]
    fixed: dict[int, tuple[float, bool]]


def make_part(
    encoder: Any,
    pairs: Sequence[tuple[str, str]],
    origins: Sequence[tuple[str, Any]],
    inspect: Callable[[list[Any], Sequence[tuple[str, Any]], list[bool]], Inspection],
    start: int,
    stop: int,
) -> ScorePart:
    """Requests ``start:stop`` of lm-eval's loglikelihood ``pairs``, tokenised as lm-eval does
    (:func:`rayeval.service.engine.encoder.encode_pairs`) and checked by ``inspect``."""
    strings = pairs[start:stop]
    encoded = encode_pairs(encoder, strings)
    inspection = inspect(encoded.requests(strings), origins[start:stop], encoded.merged)
    todo = [i for i in range(len(strings)) if i not in inspection.answers]
    return ScorePart(
        start=start,
        pairs=[encoded.pairs[i] for i in todo],
        todo=[start + i for i in todo],
        fixed={start + i: answer for i, answer in inspection.answers.items()},
    )


@dataclass
class PlannedPart:
    """A part with its plan, the response cache's answers and where it sits in the dispatcher.

    Attributes:
        part: The part.
        plan: Micro-batches of the requests the cache did not answer.
        computed: Their indices in the whole request type, in plan order.
        cached: The cache's answers, by index in the whole request type.
        store: Stores a finished micro-batch's answers (None without a cache).
        first: The dispatcher's index of its first micro-batch.
        left: Its micro-batches not back yet.
    """

    part: ScorePart
    plan: ScorePlan
    computed: list[int]
    cached: dict[int, Any]
    store: Callable[[int, Any], None] | None
    first: int = 0
    left: int = 0

    def counts(self) -> Counter[int]:
        """Requests per micro-batch, by the dispatcher's index."""
        return Counter(self.first + micro_batch for micro_batch, _, _ in self.plan.where)

    @property
    def micro_batches(self) -> list[ScoreMicroBatch]:
        return self.plan.micro_batches


def part_bounds(contexts: Sequence[str], size: int = SCORE_PART) -> Iterator[tuple[int, int]]:
    """(start, stop) of each part: ``size`` requests, extended while the context string stays
    the one of the part's last request."""
    start = 0
    while start < len(contexts):
        stop = min(start + size, len(contexts))
        while stop < len(contexts) and contexts[stop] == contexts[stop - 1]:
            stop += 1
        yield start, stop
        start = stop


_END = object()


class Planner(threading.Thread):
    """Makes and plans the parts in the background, :data:`AHEAD` at most waiting.

    Args:
        bounds: Each part's (start, stop).
        make: Tokenises and checks one part.
        plan: Plans one part (and looks it up in the response cache).
    """

    def __init__(
        self,
        bounds: Iterator[tuple[int, int]],
        make: Callable[[int, int], ScorePart],
        plan: Callable[[ScorePart], PlannedPart],
    ) -> None:
        super().__init__(name="rayeval-score-planner", daemon=True)
        self._bounds, self._make, self._plan = bounds, make, plan
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=AHEAD)
        self._stopped = threading.Event()

    def run(self) -> None:
        try:
            for start, stop in self._bounds:
                if not self._give(self._plan(self._make(start, stop))):
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
        for index, answer in (planned.part.fixed | planned.cached).items():
            self.answers[index] = answer
        if planned.left == 0:
            self._finish(planned)
            return
        self._starts.append(first)
        self._parts.append(planned)

    def back(self, micro_batch: int, result: Any) -> None:
        """One micro-batch came back (the dispatcher's index)."""
        at = bisect.bisect_right(self._starts, micro_batch) - 1
        planned = self._parts[at]
        if planned is None:
            raise ResultIntegrityError(
                f"micro-batch {micro_batch} came back after its part was finished (a request "
                "id is duplicated: please report this bug)"
            )
        if planned.store is not None:
            planned.store(micro_batch - planned.first, result)
        planned.left -= 1
        if planned.left == 0:
            self._finish(planned)
            self._parts[at] = None

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


def plan_part(
    part: ScorePart,
    cache: ResponseCache | None,
    budget: TokenBudget,
    share_prefixes: bool,
    max_length: int,
) -> PlannedPart:
    """Look a part's requests up in the response cache and plan the rest (as
    :meth:`rayeval.service.engine.executor.Executor.score` does for a whole request type)."""
    todo: Sequence[int] = range(len(part.pairs))
    keys: list[Any] = []
    found: dict[int, Any] = {}
    if cache is not None:
        keys = [cache.digest(score_key(c, k, max_length)) for c, k in part.pairs]
        found = cache.get_many(keys)
        todo = [i for i in range(len(keys)) if i not in found]
    plan = plan_score([part.pairs[i] for i in todo], max_length, budget, share_prefixes)
    store = None
    if cache is not None:
        where = zip(todo, plan.where, strict=True)
        store = cache.storer([(keys[i], mb, (row, target)) for i, (mb, row, target) in where])
    return PlannedPart(
        part=part,
        plan=plan,
        computed=[part.todo[i] for i in todo],
        cached={part.todo[i]: answer for i, answer in found.items()},
        store=store,
    )
