"""Dynamic hand-out of steps to replicas, with bounded waits and failover.

A *step* is what one replica computes at once: G micro-batches, one per rank, when its ranks
compute their own (FSDP; dummies fill a short last step so every rank issues the same
collectives), or one micro-batch that all its ranks compute together (tensor parallelism).
Each replica keeps ``depth`` steps queued on its actors so it never idles between steps; a
replica that finishes pulls the next step. A replica whose actor dies is dropped and its
unfinished steps go back to the front of the queue for the others; a step that runs past the
step timeout is an error, never a silent stall.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rayeval.actors.batches import GenerateMicroBatch, MicroBatch, ScoreMicroBatch, StepStats
from rayeval.actors.errors import EvaluationTimeoutError, RayEvalError, WorkerLostError
from rayeval.actors.group import Replica, WorkerGroup, rank_failure

logger = logging.getLogger(__name__)

_OOM_HINT = (
    ". If it ran out of memory, lower --batch_size / --max_batch_tokens or raise --shard_size."
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
class _InFlight:
    """A step sent to a replica: one ref per rank."""

    step: int
    refs: list[ray.ObjectRef]


class Dispatcher:
    """Computes the micro-batches of one request type on a group's replicas.

    Args:
        group: The ready worker group.
        micro_batches: All micro-batches of one request type (all score or all generate).
        step_timeout_s: Longest a replica may spend on one step.
        depth: Steps queued per replica (2: the next one is ready when the current one ends).
    """

    def __init__(
        self,
        group: WorkerGroup,
        micro_batches: Sequence[MicroBatch],
        step_timeout_s: float,
        depth: int = 2,
    ) -> None:
        self._micro_batches = micro_batches
        self._timeout_s = step_timeout_s
        self._depth = depth
        self._width = width = group.micro_batches_per_step
        scoring = bool(micro_batches) and isinstance(micro_batches[0], ScoreMicroBatch)
        self._method = "score" if scoring else "generate"
        self._dummy: MicroBatch = (
            ScoreMicroBatch() if self._method == "score" else GenerateMicroBatch()
        )
        self._steps = [
            list(range(i, min(i + width, len(micro_batches))))
            for i in range(0, len(micro_batches), width)
        ]
        self._results: list[Any] = [None] * len(micro_batches)
        self._filled = [False] * len(micro_batches)
        self._pending = deque(range(len(self._steps)))
        self._alive: dict[int, Replica] = {replica.index: replica for replica in group.replicas}
        self._inflight: dict[int, deque[_InFlight]] = {r: deque() for r in self._alive}
        #: Per replica, since when its oldest step in flight has been its head.
        self._head_since: dict[int, float] = {}

    def run(self, on_step: Callable[[StepDone], None] | None = None) -> list[Any]:
        """Compute every micro-batch; return one result per micro-batch, in the order given.

        Args:
            on_step: Called on the driver after each finished step.

        Raises:
            EvaluationTimeoutError: a step ran past the step timeout.
            WorkerLostError: every replica was lost.
            RayEvalError: a rank raised while computing (its message is passed on).
        """
        self._refill()
        while any(self._inflight.values()):
            heads = [
                ref for r in self._alive if self._inflight[r] for ref in self._inflight[r][0].refs
            ]
            ray.wait(heads, num_returns=1, timeout=self._time_left())
            for index in list(self._alive):
                done = self._poll(index)
                if done is not None and on_step is not None:
                    on_step(done)
            self._refill()
        return self._results

    def _refill(self) -> None:
        """Level by level: every replica gets a step before any gets a second one."""
        for level in range(self._depth):
            for index, replica in self._alive.items():
                if len(self._inflight[index]) > level or not self._pending:
                    continue
                step = self._pending.popleft()
                batch = [self._micro_batches[i] for i in self._steps[step]]
                batch += [self._dummy] * (self._width - len(batch))
                self._inflight[index].append(_InFlight(step, replica.submit(self._method, batch)))
                self._head_since.setdefault(index, time.monotonic())

    def _poll(self, index: int) -> StepDone | None:
        """The replica's head step if it finished (None: not yet, or the replica was lost)."""
        if not self._inflight[index]:
            return None
        head = self._inflight[index][0]
        done, _ = ray.wait(head.refs, num_returns=len(head.refs), timeout=0)
        try:
            # A rank that died fails its ref at once while its peers wait in a collective: look
            # at the finished refs first so a lost replica is noticed immediately.
            ray.get(done, timeout=self._timeout_s)
            if len(done) < len(head.refs):
                self._check_deadline(index)
                return None
            outputs = self._alive[index].answers(ray.get(head.refs, timeout=self._timeout_s))
        except ray.exceptions.RayActorError as exc:
            self._drop(index, exc)
            return None
        except ray.exceptions.RayTaskError as exc:
            raise rank_failure(exc, RayEvalError, "computing a batch", hint=_OOM_HINT) from None
        return self._accept(index, head.step, outputs)

    def _check_deadline(self, index: int) -> None:
        if time.monotonic() - self._head_since[index] > self._timeout_s:
            raise EvaluationTimeoutError(
                f"replica {index} did not finish a batch within {self._timeout_s:g}s: a rank is "
                "stuck or far too slow; raise the step timeout or lower the batch size"
            )

    def _accept(self, index: int, step: int, outputs: list[Any]) -> StepDone:
        """Record a finished step's results (each micro-batch exactly once)."""
        self._inflight[index].popleft()
        self._head_since.pop(index)
        if self._inflight[index]:
            self._head_since[index] = time.monotonic()
        for i, (result, _) in zip(self._steps[step], outputs, strict=False):
            if self._filled[i]:
                raise RayEvalError(
                    f"micro-batch {i} came back twice (internal error, please report)"
                )
            self._results[i], self._filled[i] = result, True
        return StepDone(
            step,
            index,
            tuple(self._steps[step]),
            tuple(stats for _, stats in outputs),
            tuple(self._results[i] for i in self._steps[step]),
        )

    def _time_left(self) -> float:
        if not self._head_since:
            return self._timeout_s
        oldest = min(self._head_since.values())
        return max(0.1, self._timeout_s - (time.monotonic() - oldest) + 0.1)

    def _drop(self, index: int, exc: Exception) -> None:
        """Forget a replica whose actor died and give its unfinished steps back to the queue."""
        replica = self._alive.pop(index)
        lost = [flight.step for flight in self._inflight.pop(index)]
        self._head_since.pop(index, None)
        self._pending.extendleft(reversed(lost))
        replica.kill()
        logger.warning(
            "replica %d lost (%s); re-queued %d batches on the others", index, exc, len(lost)
        )
        if not self._alive:
            raise WorkerLostError(
                f"every replica was lost (last: {exc}). Check node health and memory (a rank "
                "killed for out-of-memory needs a smaller --batch_size or a larger --shard_size)."
            )


def run_steps(
    group: WorkerGroup,
    micro_batches: Sequence[MicroBatch],
    step_timeout_s: float,
    on_step: Callable[[StepDone], None] | None = None,
    depth: int = 2,
) -> list[Any]:
    """Compute every micro-batch on the group's replicas (:class:`Dispatcher`), in input order."""
    if not micro_batches:
        return []
    return Dispatcher(group, micro_batches, step_timeout_s, depth).run(on_step)
