"""The life of an evaluation in the job service: its states, their transitions, its event kinds.

:class:`EvaluationStatus` is the state machine; :data:`TRANSITIONS` is the one list of allowed
moves, and the store refuses any other (a state change is a conditional update on the allowed
*from* states, so whoever changes an evaluation first wins). :class:`EventKind` names what the
service stores on an evaluation's event stream; :class:`RunnerEventKind` what a runner actor
reports. No torch here.
"""

from __future__ import annotations

from enum import StrEnum


class EvaluationStatus(StrEnum):
    """Where an evaluation is in its life: queued -> starting -> running -> a terminal state.

    ``starting`` covers reserving the layout, loading the model on every rank and building the
    requests; ``running`` begins when the first batch comes back.
    """

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True once nothing about the evaluation changes any more."""
        return not TRANSITIONS[self]

    @property
    def is_active(self) -> bool:
        """True while a runner actor exists (or should exist) for the evaluation."""
        return self in ACTIVE_STATUSES

    def can_become(self, to: EvaluationStatus) -> bool:
        """Whether the state machine allows moving from this state to ``to``."""
        return to in TRANSITIONS[self]

    @classmethod
    def sources_of(cls, to: EvaluationStatus) -> frozenset[EvaluationStatus]:
        """Every state from which an evaluation may move to ``to``."""
        return frozenset(s for s in cls if s.can_become(to))


_S = EvaluationStatus
#: The allowed moves. A queued evaluation never fails (it is refused at submission instead) and
#: never succeeds without having started; a terminal state has no way out. A starting or running
#: evaluation goes back to the queue only when it is preempted (``EvaluationStore.requeue``).
TRANSITIONS: dict[EvaluationStatus, frozenset[EvaluationStatus]] = {
    _S.QUEUED: frozenset({_S.STARTING, _S.CANCELLED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED, _S.QUEUED}),
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.CANCELLED, _S.QUEUED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}
ACTIVE_STATUSES = frozenset({_S.STARTING, _S.RUNNING})


class EventKind(StrEnum):
    """Events on an evaluation's stream (``GET /evaluations/{id}/events``)."""

    STATE = "state"  # a state change, with the error on failure
    PROGRESS = "progress"  # one request type moved, plus overall totals
    WARNING = "warning"  # a task's requests do not measure it (engine.checks); a tracker failed
    TASK_RESULT = "task_result"  # one task's (or group's) metrics, when the evaluation ends
    RESULT = "result"  # lm-eval's results JSON (read from the stored results, kept once)
    PREEMPTED = "preempted"  # stopped for a more urgent evaluation; back in the queue
    CHECKPOINT = "checkpoint"  # a sweep's or watch's checkpoint ended (its outcome, its metrics)
    STAGE = "stage"  # what the evaluation is doing between batches (start-up, metrics)


class RunnerEventKind(StrEnum):
    """What a runner actor reports to the service: progress, warnings, a sweep's checkpoints,
    a watch's waiting, and the two ways a run ends."""

    PROGRESS = "progress"
    WARNING = "warning"
    CHECKPOINT = "checkpoint"
    WAITING = "waiting"
    STAGE = "stage"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
