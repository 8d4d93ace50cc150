"""Dynamic hand-out of steps to replicas, with bounded waits and failover.

A *step* is what one replica computes at once: G micro-batches, one per rank, when its ranks
compute their own (FSDP; dummies fill a short last step so every rank issues the same
collectives), or one micro-batch that all its ranks compute together (tensor parallelism).
Continuous-batching groups (:class:`~rayeval.actors.batches.GenerateGroup`) are streamed: each
rank sends back a piece whenever some of its requests finish, and the step ends when every rank's
stream has ended.
Each replica keeps ``depth`` steps queued on its actors so it never idles between steps; a
replica that finishes pulls the next step. A replica whose actor dies is dropped and its
unfinished steps go back to the front of the queue for the others; a step that runs past the
step timeout is an error, never a silent stall.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rayeval.actors.batches import (
    GenerateGroup,
    GenerateMicroBatch,
    GenerationPiece,
    MicroBatch,
    PickledScoreBatch,
    ScoreMicroBatch,
    StepStats,
)
from rayeval.actors.errors import (
    EvaluationTimeoutError,
    RayEvalError,
    ResultIntegrityError,
    WorkerLostError,
)
from rayeval.actors.errors import field as config_field
from rayeval.actors.group import Replica, WorkerGroup, rank_failure
from rayeval.actors.rank_death import death_report
from rayeval.service.engine.dispatch import heap

logger = logging.getLogger(__name__)

#: Appended to a rank's failure only when it ran out of memory (:func:`rank_failure`).
_OOM_HINT = (
    f". Lower {config_field('batch_size')} / {config_field('max_batch_tokens')} or raise "
    f"{config_field('parallelism', 'shard_size')}."
)


@dataclass(frozen=True)
class StepDone:
    """One finished step, as reported to the progress callback."""

    step: int
    replica: int
    micro_batches: tuple[int, ...]
    stats: tuple[StepStats, ...]
    results: tuple[Any, ...]  # one per entry of ``micro_batches``


@dataclass(frozen=True)
class PieceDone:
    """Requests of a streamed micro-batch that finished, as reported to the piece callback.

    ``finished`` holds only answers not reported before (a step re-run after a lost replica
    sends its earlier answers again). ``shard_rank``: which rank of the replica sent it.
    """

    replica: int
    shard_rank: int
    micro_batch: int | None  # None: a dummy group's piece (figures only)
    finished: tuple[tuple[int, tuple[int, ...]], ...]
    stats: StepStats


@dataclass
class _InFlight:
    """A call sent to a replica: the steps it carries, one ref (or one stream) per rank."""

    steps: list[int]
    refs: list[Any]
    ended: list[bool] = field(default_factory=list)


#: A call carries about this many seconds of a replica's work: each call costs the driver and the
#: rank a Ray round trip (a fraction of a millisecond of CPU each) that short steps cannot hide.
CALL_SECONDS = 0.5
#: The most steps one call carries.
MAX_STEPS_PER_CALL = 64
#: How long an idle dispatcher waits for the next part of a plan before it looks again.
FEED_WAIT_S = 1.0
#: How often the answers gathered so far join the frozen heap (:mod:`.heap`).
SETTLE_S = 1.0


class CallSizer:
    """How many steps the next call to a replica carries (plain steps; a stream carries one).

    One until steps have been timed, so the first results come back after one step; then enough
    for :data:`CALL_SECONDS` of the mean step so far, but never more than the queue's share of
    every replica's calls, so calls shrink as the queue drains and the replicas end together, and
    never more than twice the replica's previous call: the first round of timed calls (one per
    replica, each with a step or two queued) then costs the driver little and reaches every
    replica before it runs dry. Which replica computes which step never changes a result, so
    neither does this.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._steps = 0
        self._last: dict[int, int] = {}  # per replica, the steps its last call was given

    def timed(self, seconds: float) -> None:
        """Count one finished step's compute time."""
        self._seconds += seconds
        self._steps += 1

    def size(self, pending: int, calls: int, replica: int) -> int:
        """Steps for ``replica``'s next call, ``pending`` steps queued for ``calls`` call slots."""
        count = 1
        if self._steps:
            mean = max(self._seconds / self._steps, 1e-6)
            most = min(MAX_STEPS_PER_CALL, 2 * self._last.get(replica, 1), pending // max(1, calls))
            count = max(1, min(int(CALL_SECONDS / mean), most))
        self._last[replica] = count
        return count


class Dispatcher:
    """Computes the micro-batches of one request type on a group's replicas.

    Args:
        group: The ready worker group.
        micro_batches: All micro-batches of one request type (all score or all generate).
        step_timeout_s: Longest a replica may spend on one step.
        depth: Calls queued per replica (2: the next one is ready when the current one ends).
        kind: The micro-batches' type, when none is given yet (they come with :meth:`add`).
    """

    def __init__(
        self,
        group: WorkerGroup,
        micro_batches: Sequence[MicroBatch],
        step_timeout_s: float,
        depth: int = 2,
        kind: type[MicroBatch] | None = None,
    ) -> None:
        self._micro_batches = list(micro_batches)
        self._timeout_s = step_timeout_s
        self._depth = depth
        self._width = width = group.micro_batches_per_step
        first = micro_batches[0] if micro_batches else (kind() if kind else None)
        self._streaming = isinstance(first, GenerateGroup)
        self._same_batch = any(r.same_batch for r in group.replicas)
        self._dummy: MicroBatch = GenerateMicroBatch()
        if isinstance(first, ScoreMicroBatch):
            self._dummy = ScoreMicroBatch()
        elif self._streaming:
            self._dummy = GenerateGroup()
        #: Streamed micro-batches: the answers received so far, by position.
        self._answers: dict[int, dict[int, tuple[int, ...]]] = {}
        self._on_piece: Callable[[PieceDone], None] | None = None
        self._steps = [
            list(range(i, min(i + width, len(micro_batches))))
            for i in range(0, len(micro_batches), width)
        ]
        self._results: list[Any] = [None] * len(micro_batches)
        self._filled = [False] * len(micro_batches)
        self._pending = deque(range(len(self._steps)))
        self._alive: dict[int, Replica] = {replica.index: replica for replica in group.replicas}
        self._inflight: dict[int, deque[_InFlight]] = {r: deque() for r in self._alive}
        #: Per replica, when its oldest call in flight must have ended (or sent a piece).
        self._deadline: dict[int, float] = {}
        self._sizer = CallSizer()
        #: Micro-batches given back to the queue because their replica was lost (computed again
        #: on another; a streamed group's requests that had finished are computed twice).
        self.requeued = 0

    def add(self, micro_batches: Sequence[MicroBatch]) -> int:
        """Queue more micro-batches of the same kind (a plan that arrives in parts), in steps of
        their own; returns the index of the first."""
        first = len(self._micro_batches)
        self._micro_batches.extend(micro_batches)
        for i in range(first, len(self._micro_batches), self._width):
            self._steps.append(list(range(i, min(i + self._width, len(self._micro_batches)))))
            self._pending.append(len(self._steps) - 1)
        self._results.extend([None] * len(micro_batches))
        self._filled.extend([False] * len(micro_batches))
        return first

    def results(self, indices: Iterable[int]) -> list[Any]:
        """The results of these micro-batches (None: not back yet)."""
        return [self._results[i] for i in indices]

    def forget(self, indices: Iterable[int]) -> None:
        """Drop finished micro-batches and their results (read already): a long run's memory
        stays its unfinished part. Each still counts as returned."""
        for i in indices:
            if not self._filled[i]:
                raise RayEvalError(f"micro-batch {i} was dropped before it came back")
            self._micro_batches[i] = self._results[i] = None  # type: ignore[call-overload]
            self._answers.pop(i, None)

    def run(
        self,
        on_step: Callable[[StepDone], None] | None = None,
        on_piece: Callable[[PieceDone], None] | None = None,
        feed: Callable[[float], bool] | None = None,
    ) -> list[Any]:
        """Compute every micro-batch; return one result per micro-batch, in the order given
        (a streamed group's: each request's answer, by position).

        Args:
            on_step: Called on the driver after each finished step.
            on_piece: Called with each streamed piece's new answers.
            feed: Adds micro-batches while the others compute (:meth:`add`): ``feed(wait_s)``
                waits at most ``wait_s`` for more, and returns False once none will come.

        Raises:
            EvaluationTimeoutError: a step ran past the step timeout.
            WorkerLostError: every replica was lost.
            RayEvalError: a rank raised while computing (its message is passed on).
        """
        self._on_piece = on_piece
        more = feed is not None
        with heap.frozen_while_running():  # a full GC pass would stall every replica
            while True:
                if more:
                    assert feed is not None
                    starving = not self._pending and not any(self._inflight.values())
                    more = feed(FEED_WAIT_S if starving else 0.0)
                self._refill()
                if not any(self._inflight.values()):
                    if more:
                        continue
                    return self._results
                owners = {
                    ref: r for r in self._alive if self._inflight[r] for ref in self._waiting(r)
                }
                ready, _ = ray.wait(list(owners), num_returns=1, timeout=self._time_left())
                if ready:  # everything that is ready now, in one call
                    ready, _ = ray.wait(list(owners), num_returns=len(owners), timeout=0)
                now = time.monotonic()
                due = {owners[ref] for ref in ready}
                due |= {index for index, deadline in self._deadline.items() if now > deadline}
                for index in sorted(due):
                    for done in self._poll(index):
                        if on_step is not None:
                            on_step(done)
                heap.settle(every_s=SETTLE_S)  # the answers so far: kept out of full GC passes

    def _waiting(self, index: int) -> list[Any]:
        """The refs (or streams that have not ended) of the replica's head call."""
        head = self._inflight[index][0]
        return [ref for ref, ended in zip(head.refs, head.ended, strict=True) if not ended]

    def _refill(self) -> None:
        """Level by level: every replica gets a call before any gets a second one."""
        for level in range(self._depth):
            for index, replica in self._alive.items():
                if len(self._inflight[index]) > level or not self._pending:
                    continue
                count = 1
                if not self._streaming:
                    calls = len(self._alive) * self._depth
                    count = self._sizer.size(len(self._pending), calls, index)
                steps = [self._pending.popleft() for _ in range(min(count, len(self._pending)))]
                batches = [self._step_batches(step) for step in steps]
                if self._streaming:
                    refs = replica.submit(batches[0])
                else:
                    refs = replica.submit_many(batches)
                self._inflight[index].append(_InFlight(steps, refs, [False] * len(refs)))
                self._deadline.setdefault(index, time.monotonic() + self._timeout_s * len(steps))

    def _step_batches(self, step: int) -> list[MicroBatch]:
        """A step's micro-batches, dummies filling the ranks it has none for."""
        batch = [self._micro_batches[i] for i in self._steps[step]]
        return batch + [self._dummy] * (self._width - len(batch))

    def _poll(self, index: int) -> list[StepDone]:
        """The steps of the replica's head call if it finished (none: not yet, or the replica
        was lost)."""
        if index not in self._alive or not self._inflight[index]:
            return []
        head = self._inflight[index][0]
        try:
            outputs = self._drain(index, head) if self._streaming else self._collect(index, head)
            if outputs is None:
                return []
        except ray.exceptions.RayActorError as exc:
            self._drop(index, exc)
            return []
        except ray.exceptions.RayTaskError as exc:
            raise rank_failure(exc, RayEvalError, "computing a batch", oom_hint=_OOM_HINT) from None
        return self._accept(index, outputs)

    def _collect(self, index: int, head: _InFlight) -> list[list[Any]] | None:
        """Per step of a plain call, its (result, stats) per micro-batch, once every rank
        returned."""
        done, _ = ray.wait(head.refs, num_returns=len(head.refs), timeout=0)
        if len(done) < len(head.refs):
            # A rank that died fails its ref at once while its peers wait in a collective: look
            # at the finished refs first so a lost replica is noticed immediately.
            ray.get(done, timeout=self._timeout_s)
            self._check_deadline(index)
            return None
        return self._alive[index].answers_many(ray.get(head.refs, timeout=self._timeout_s))

    def _drain(self, index: int, head: _InFlight) -> list[list[Any]] | None:
        """Read every piece the replica's streams have ready; once all ended, the step's
        (answers by position, no stats: pieces carried them) per micro-batch."""
        while not all(head.ended):
            streams = [s for s, ended in zip(head.refs, head.ended, strict=True) if not ended]
            ready, _ = ray.wait(streams, num_returns=len(streams), timeout=0)
            if not ready:
                self._check_deadline(index)
                return None
            stream: Any
            for stream in ready:
                rank = head.refs.index(stream)
                try:
                    piece = ray.get(next(stream), timeout=self._timeout_s)
                except StopIteration:
                    head.ended[rank] = True
                    continue
                self._deadline[index] = time.monotonic() + self._timeout_s
                self._take(index, head.steps[0], rank, piece)
        mbs = self._steps[head.steps[0]]
        outputs = [(self._group_result(mb), None) for mb in mbs]
        return [outputs + [(None, None)] * (self._width - len(mbs))]

    def _take(self, index: int, step: int, rank: int, piece: GenerationPiece) -> None:
        """Record a piece's new answers and report them."""
        if self._same_batch and rank > 0:
            return  # the replica's ranks computed the same group: rank 0 reports it
        mbs = self._steps[step]
        micro_batch = mbs[rank] if rank < len(mbs) else None
        new = []
        if micro_batch is not None:
            known = self._answers.setdefault(micro_batch, {})
            for position, tokens in piece.finished:
                if position in known:
                    if known[position] != tokens:
                        logger.warning(
                            "micro-batch %d request %d: a re-run answered otherwise; the first "
                            "answer stands",
                            micro_batch,
                            position,
                        )
                    continue
                known[position] = tokens
                new.append((position, tokens))
        if self._on_piece is not None:
            self._on_piece(PieceDone(index, rank, micro_batch, tuple(new), piece.stats))

    def _group_result(self, micro_batch: int) -> list[tuple[int, ...]] | None:
        """A streamed group's answers in position order (None if one is missing)."""
        group = self._micro_batches[micro_batch]
        assert isinstance(group, GenerateGroup)
        known = self._answers.get(micro_batch, {})
        if len(known) != len(group.requests):
            return None
        return [known[position] for position in range(len(group.requests))]

    def _check_deadline(self, index: int) -> None:
        if time.monotonic() > self._deadline[index]:
            raise EvaluationTimeoutError(
                f"replica {index} did not finish a batch within {self._timeout_s:g}s: a rank is "
                "stuck or far too slow; raise the step timeout or lower the batch size"
            )

    def _accept(self, index: int, outputs: list[list[Any]]) -> list[StepDone]:
        """Record the finished head call's results (each micro-batch exactly once), per step."""
        head = self._inflight[index].popleft()
        self._deadline.pop(index)
        if self._inflight[index]:
            steps = len(self._inflight[index][0].steps)
            self._deadline[index] = time.monotonic() + self._timeout_s * steps
        done = []
        for step, step_outputs in zip(head.steps, outputs, strict=True):
            for i, (result, _) in zip(self._steps[step], step_outputs, strict=False):
                if self._filled[i]:
                    raise RayEvalError(
                        f"micro-batch {i} came back twice (internal error, please report)"
                    )
                self._results[i], self._filled[i] = result, True
            stats = tuple(stats for _, stats in step_outputs if stats is not None)
            if stats:
                self._sizer.timed(max(s.seconds for s in stats))
            mbs = tuple(self._steps[step])
            done.append(StepDone(step, index, mbs, stats, tuple(self._results[i] for i in mbs)))
        return done

    def _time_left(self) -> float:
        if not self._deadline:
            return self._timeout_s
        return max(0.1, min(self._deadline.values()) - time.monotonic() + 0.1)

    def _drop(self, index: int, exc: Exception) -> None:
        """Forget a replica whose actor died and give its unfinished steps back to the queue."""
        replica = self._alive.pop(index)
        lost = [step for flight in self._inflight.pop(index) for step in flight.steps]
        self._deadline.pop(index, None)
        self._pending.extendleft(reversed(lost))
        self.requeued += sum(len(self._steps[step]) for step in lost)
        # Which rank, how it ended and its last lines (read before its replica is killed: a
        # peer's kill would not change the dead rank's own log).
        report = death_report(exc)
        replica.kill()
        logger.warning(
            "replica %d lost: %s; re-queued %d batches on the others", index, report, len(lost)
        )
        if not self._alive:
            raise WorkerLostError(
                f"every replica was lost (last: {report}). Check node health and memory (a rank "
                f"killed for out-of-memory needs a smaller {config_field('batch_size')} or a "
                f"larger {config_field('parallelism', 'shard_size')})."
            )


def check_exactly_once(
    micro_batches: Sequence[MicroBatch | PickledScoreBatch], results: Sequence[Any]
) -> None:
    """Every micro-batch came back once, with one answer per row (per target for scores)."""
    for index, (batch, result) in enumerate(zip(micro_batches, results, strict=True)):
        if isinstance(batch, ScoreMicroBatch | PickledScoreBatch):
            expected = list(batch.targets)
            got = [len(row) for row in result] if result is not None else None
        elif isinstance(batch, GenerateGroup):
            expected = [1] * len(batch.requests)
            got = [1] * len(result) if result is not None else None
        else:
            assert isinstance(batch, GenerateMicroBatch)
            expected = [1] * len(batch.contexts)
            got = [1] * len(result) if result is not None else None
        if got != expected:
            raise ResultIntegrityError(
                f"micro-batch {index} came back with {got} answers, expected {expected} "
                "(a request id is missing or duplicated: please report this bug)"
            )
