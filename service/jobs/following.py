"""Following an evaluation: what its runner's events become, and when the watchdog fails it.

The manager follows each active evaluation by asking its runner actor for new events (at most one
call in flight per runner). The decisions are pure functions over typed state, as admission's are
(:func:`rayeval.service.jobs.admission.plan`); the manager applies what they return:

- :func:`digest`: a batch of runner events becomes stored progress, the stream's events, a
  sweep's finished checkpoints and, on the last one, how the run ended (a watch's waiting events
  only say that its runner is alive);
- :func:`unreachable`: the runner has not answered a call for longer than the server allows (it
  includes the runner actor's start), so the cluster lost it or cannot schedule it;
- :func:`stalled`: the runner answers but reports nothing new for longer than the server's stall
  timeout plus the evaluation's own wait for what it is doing (placement and loading before its
  first batch, one step after), e.g. a metric stuck in a loop or a hung child process.

Both watchdog checks read a :class:`Watch` and return the error to fail the evaluation with (and
release it), or None. The messages for runners that are gone (:data:`RUNNER_GONE`,
:data:`RUNNER_GONE_AT_START`, :func:`runner_died`) live here too, so every way a followed
evaluation fails reads in one place. No Ray and no torch here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.vocabulary.config import TimeoutSettings
from rayeval.service.vocabulary.events import (
    CheckpointEvent,
    CheckpointOutputs,
    EvaluationProgress,
    PhaseReport,
    ProgressEvent,
    RunnerCheckpoint,
    RunnerEvent,
    RunnerFailed,
    RunnerProgress,
    RunnerStage,
    RunnerSucceeded,
    RunnerWarning,
    Stage,
    StageEvent,
    StreamEvent,
    TaskResultEvent,
    warning_event,
)

#: The runner actor cannot be found by name while the evaluation is followed.
RUNNER_GONE = (
    "the runner actor of this evaluation no longer exists on the Ray cluster (it died or the "
    "cluster restarted): resubmit the evaluation"
)
#: The runner actor of an evaluation left active by a previous API process is gone.
RUNNER_GONE_AT_START = (
    "the API server restarted and the runner actor of this evaluation no longer exists on the Ray "
    "cluster (the cluster restarted or the runner died): resubmit the evaluation"
)


def runner_died(reason: str) -> str:
    """The error of an evaluation whose runner's call failed with ``reason``."""
    return f"the runner actor died: {reason}"


@dataclass(frozen=True)
class Digest:
    """What a batch of runner events becomes.

    Attributes:
        progress: The evaluation's progress with the new reports.
        cursor: The last runner event read.
        events: For the stream: the warnings, each stage entered, then one progress event per
            request type that moved (with totals over every request type).
        moved: Some request type moved (a starting evaluation is running).
        ended: The event that ended the run, if it is among these.
        checkpoints: A sweep's checkpoints that ended, in order (their stream events are in
            ``events``).
    """

    progress: EvaluationProgress
    cursor: int
    events: list[StreamEvent] = field(default_factory=list)
    moved: bool = False
    ended: RunnerSucceeded | RunnerFailed | None = None
    checkpoints: list[CheckpointOutputs] = field(default_factory=list)


def digest(progress: EvaluationProgress, events: Sequence[RunnerEvent]) -> Digest:
    """Turn runner events (at least one, in order) into what the store keeps.

    Args:
        progress: The evaluation's stored progress before these events.
        events: The runner's new events.
    """
    latest: dict[str, PhaseReport] = {}
    warnings: list[StreamEvent] = []
    checkpoints: list[CheckpointOutputs] = []
    ended: RunnerSucceeded | RunnerFailed | None = None
    stages: list[Stage] = []
    for event in events:
        if isinstance(event, RunnerProgress):
            latest[event.progress.phase] = PhaseReport.of(event.progress, event.time)
        elif isinstance(event, RunnerStage):
            stages.append(event.stage)
        elif isinstance(event, RunnerWarning):
            warnings.append(warning_event(event.warning))
        elif isinstance(event, RunnerCheckpoint):
            checkpoints.append(event.outputs)
            warnings.append(CheckpointEvent.of_outputs(event.outputs))
        elif isinstance(event, RunnerSucceeded | RunnerFailed) and ended is None:
            ended = event
    progress = progress.with_reports(latest).at_stage(stages[-1] if stages else None)
    moved = [ProgressEvent.of_phase(report, progress) for report in latest.values()]
    staged = [StageEvent.of_stage(stage) for stage in stages]
    cursor = events[-1].seq
    events_out = [*warnings, *staged, *moved]
    return Digest(progress, cursor, events_out, bool(latest), ended, checkpoints)


def task_results(results_json: str) -> list[TaskResultEvent]:
    """One event per task (and group) of lm-eval's results file, with its metrics."""
    results = json.loads(results_json)
    return [
        TaskResultEvent(task=task, metrics=metrics)
        for task, metrics in results.get("results", {}).items()
    ]


@dataclass(frozen=True)
class Watch:
    """One active evaluation as the watchdog sees it (times are monotonic seconds).

    Attributes:
        now: The time of the check.
        heard_at: When its runner last reported something new (or was started, re-attached or
            first watched).
        asked_at: When the call for its events still unanswered was sent (None: none pending).
        progress: Its stored progress.
        timeouts: Its own waits.
        bootstrap_iters: Its lm-eval bootstrap iterations (named when metrics may be the cause).
    """

    now: float
    heard_at: float
    asked_at: float | None
    progress: EvaluationProgress
    timeouts: TimeoutSettings
    bootstrap_iters: int

    @classmethod
    def of(
        cls, record: EvaluationRecord, now: float, heard_at: float, asked_at: float | None
    ) -> Watch:
        """The watch of a stored evaluation (its progress and its config's waits)."""
        config = record.config
        return cls(
            now, heard_at, asked_at, record.progress, config.timeouts, config.bootstrap_iters
        )


def verdict(watch: Watch, stall_timeout_s: float, unreachable_s: float) -> str | None:
    """The error to fail the evaluation with (:func:`stalled` first, then :func:`unreachable`),
    or None while it is followed as it should be."""
    return stalled(watch, stall_timeout_s) or unreachable(watch, unreachable_s)


def unreachable(watch: Watch, limit_s: float) -> str | None:
    """The error of a runner that has not answered for more than ``limit_s``, else None."""
    if watch.asked_at is None or watch.now - watch.asked_at <= limit_s:
        return None
    return (
        f"the runner actor did not answer for {limit_s:g}s: check the Ray cluster (dashboard, "
        "`ray status`) and resubmit"
    )


def stall_limit(watch: Watch, stall_timeout_s: float) -> float:
    """How long the evaluation may report nothing new: the server's stall timeout plus its own
    wait for what it is doing (one step once batches run, placement and loading before)."""
    timeouts = watch.timeouts
    own = timeouts.step_s if watch.progress.phases else timeouts.placement_s + timeouts.load_s
    return stall_timeout_s + own


def stalled(watch: Watch, stall_timeout_s: float) -> str | None:
    """The error of an evaluation silent past :func:`stall_limit`, naming where it stopped;
    else None."""
    silent = watch.now - watch.heard_at
    limit = stall_limit(watch, stall_timeout_s)
    if silent <= limit:
        return None
    return (
        f"no progress for {silent:.0f}s (limit {limit:.0f}s: the server's stall timeout plus the "
        f"evaluation's own timeout); it stopped {where_stopped(watch)}. Its actors were released; "
        "retry it, or raise the stall timeout (--stall-timeout) if this step is legitimately slow"
    )


def where_stopped(watch: Watch) -> str:
    """Where an evaluation stopped, from its stored progress."""
    last = watch.progress.latest()
    if last is None:
        return (
            "before its first batch (reserving resources, loading the model or building requests)"
        )
    where = f"after {last.done}/{last.total} {last.phase} requests"
    if watch.progress.all_answered():
        where += (
            ": every request was answered, so lm-eval was computing metrics "
            f"(bootstrap_iters={watch.bootstrap_iters}) or building the next request type"
        )
    return where
