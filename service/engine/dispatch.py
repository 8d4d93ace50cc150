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


@dataclass(frozen=True)
class StepDone:
    """One finished step, as reported to the progress callback."""

    step: int
    replica: int
    micro_batches: tuple[int, ...]
    stats: tuple[StepStats, ...]
    results: tuple[Any, ...]  # one per entry of ``micro_batches``


def run_steps(
    group: WorkerGroup,
    micro_batches: Sequence[MicroBatch],
    step_timeout_s: float,
    on_step: Callable[[StepDone], None] | None = None,
    depth: int = 2,
) -> list[Any]:
    """Compute every micro-batch on the group's replicas and return results in input order.

    Args:
        group: The ready worker group.
        micro_batches: All micro-batches of one request type (all score or all generate).
        step_timeout_s: Longest a replica may spend on one step.
        on_step: Called on the driver after each finished step.
        depth: Steps queued per replica (2: the next one is ready when the current one ends).

    Returns:
        One result per micro-batch, in the order given.

    Raises:
        EvaluationTimeoutError: a step ran past ``step_timeout_s``.
        WorkerLostError: every replica was lost.
        RayEvalError: a rank raised while computing (its message is passed on).
    """
    if not micro_batches:
        return []
    width = group.micro_batches_per_step
    method = "score" if isinstance(micro_batches[0], ScoreMicroBatch) else "generate"
    dummy: MicroBatch = ScoreMicroBatch() if method == "score" else GenerateMicroBatch()
    steps = [
        list(range(i, min(i + width, len(micro_batches))))
        for i in range(0, len(micro_batches), width)
    ]
    results: list[Any] = [None] * len(micro_batches)
    filled = [False] * len(micro_batches)

    pending = deque(range(len(steps)))
    alive: dict[int, Replica] = {replica.index: replica for replica in group.replicas}
    inflight: dict[int, deque[tuple[int, list[ray.ObjectRef]]]] = {r: deque() for r in alive}
    head_since: dict[int, float] = {}

    def refill() -> None:
        # Level by level: every replica gets a step before any gets a second one.
        for level in range(depth):
            for index, replica in alive.items():
                if len(inflight[index]) > level or not pending:
                    continue
                step = pending.popleft()
                batch = [micro_batches[i] for i in steps[step]]
                batch += [dummy] * (width - len(batch))
                inflight[index].append((step, replica.submit(method, batch)))
                head_since.setdefault(index, time.monotonic())

    refill()
    while any(inflight.values()):
        heads = [ref for r in alive if inflight[r] for ref in inflight[r][0][1]]
        ray.wait(heads, num_returns=1, timeout=_time_left(head_since, step_timeout_s))
        for index in list(alive):
            if not inflight[index]:
                continue
            step, refs = inflight[index][0]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            try:
                # A rank that died fails its ref at once while its peers wait in a collective:
                # look at the finished refs first so a lost replica is noticed immediately.
                ray.get(done, timeout=step_timeout_s)
                if len(done) < len(refs):
                    if time.monotonic() - head_since[index] > step_timeout_s:
                        raise EvaluationTimeoutError(
                            f"replica {index} did not finish a batch within {step_timeout_s:g}s:"
                            " a rank is stuck or far too slow; raise the step timeout or lower"
                            " the batch size"
                        )
                    continue
                outputs = alive[index].answers(ray.get(refs, timeout=step_timeout_s))
            except ray.exceptions.RayActorError as exc:
                _drop_replica(index, alive, inflight, pending, head_since, exc)
                continue
            except ray.exceptions.RayTaskError as exc:
                raise rank_failure(
                    exc,
                    RayEvalError,
                    "computing a batch",
                    hint=". If it ran out of memory, lower --batch_size / --max_batch_tokens or "
                    "raise --shard_size.",
                ) from None
            inflight[index].popleft()
            head_since.pop(index)
            if inflight[index]:
                head_since[index] = time.monotonic()
            for i, (result, _) in zip(steps[step], outputs, strict=False):
                if filled[i]:
                    raise RayEvalError(
                        f"micro-batch {i} came back twice (internal error, please report)"
                    )
                results[i], filled[i] = result, True
            if on_step is not None:
                on_step(
                    StepDone(
                        step,
                        index,
                        tuple(steps[step]),
                        tuple(stats for _, stats in outputs),
                        tuple(results[i] for i in steps[step]),
                    )
                )
        refill()
    return results


def _time_left(head_since: dict[int, float], step_timeout_s: float) -> float:
    if not head_since:
        return step_timeout_s
    oldest = min(head_since.values())
    return max(0.1, step_timeout_s - (time.monotonic() - oldest) + 0.1)


def _drop_replica(
    index: int,
    alive: dict[int, Replica],
    inflight: dict[int, deque[tuple[int, list[ray.ObjectRef]]]],
    pending: deque[int],
    head_since: dict[int, float],
    exc: Exception,
) -> None:
    """Forget a replica whose actor died and give its unfinished steps back to the queue."""
    replica = alive.pop(index)
    lost = [step for step, _ in inflight.pop(index)]
    head_since.pop(index, None)
    pending.extendleft(reversed(lost))
    replica.kill()
    logger.warning(
        "replica %d lost (%s); re-queued %d batches on the others", index, exc, len(lost)
    )
    if not alive:
        raise WorkerLostError(
            f"every replica was lost (last: {exc}). Check node health and memory "
            "(a rank killed for out-of-memory needs a smaller --batch_size or a larger "
            "--shard_size)."
        )
