"""Typed progress and events, from the engine to the runner, the store and the clients.

One module that ``service.engine``, ``service.jobs`` and ``api`` all import, so that no layer spells
another's keys. A figure's path, from a finished step to a client:

======================  ===========================================================================
engine -> runner        :class:`Progress` (one request type, after every finished step),
                        :class:`Stage` (what it does between batches: start-up, metrics),
                        :class:`RequestWarning` (a task's requests that do not measure it) and
                        :class:`TrackerWarning` (an experiment tracker did not record the run)
runner -> manager       :data:`RunnerEvent`: :class:`RunnerProgress`, :class:`RunnerWarning`,
                        :class:`RunnerCheckpoint` (a sweep's, with :class:`CheckpointOutputs`),
                        :class:`RunnerWaiting` (a watch between checkpoints), :class:`RunnerStage`,
                        :class:`RunnerSucceeded` (with :class:`RunOutputs`), :class:`RunnerFailed`;
                        numbered from 1, read with ``EvaluationRunner.events_since``
manager -> store        :class:`EvaluationProgress`: per request type its latest
                        :class:`PhaseReport` (a ``Progress`` and when the runner reported it),
                        and the latest :class:`Stage`
store -> clients (SSE)  :data:`StreamEvent`: :class:`StateEvent`, :class:`ProgressEvent` (a
                        ``PhaseReport`` plus overall totals), :class:`WarningEvent`,
                        :class:`TrackerWarningEvent`, :class:`TaskResultEvent`,
                        :class:`ResultEvent`, :class:`PreemptedEvent`, :class:`CheckpointEvent`,
                        :class:`StageEvent`
API answers             :class:`PhaseCounts`, what ``GET /evaluations/{id}`` shows of a request type
======================  ===========================================================================

``dump()`` gives each type's JSON, ``parse()`` reads it back. The JSON is what the service wrote
before these types existed (the same keys), so stored rows and clients keep working. Types read
from storage or from another process's answers ignore keys they do not know (a row written by
another version); the types the engine and the runner build refuse them. The kinds of events and
the evaluation states are :mod:`rayeval.service.vocabulary.states`' (a module of enums). No torch
here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rayeval.service.vocabulary.states import EvaluationStatus, EventKind, RunnerEventKind


class _Typed(BaseModel):
    """Frozen, with its JSON form (``dump``) and back (``parse``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON-able form (what is stored and sent)."""
        return self.model_dump(mode="json")

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> Self:
        """Read the JSON-able form back.

        Raises:
            pydantic.ValidationError: ``data`` is not this type's form.
        """
        return cls.model_validate(data)


class _Read(_Typed):
    """A type read from storage or from another process: unknown keys are dropped."""

    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- the engine's
class ReplicaWork(_Typed):
    """What one replica computed of a request type so far."""

    requests: int
    tokens: int = Field(description="Real (non-padding) tokens.")
    busy_s: float = Field(description="Seconds its slowest rank spent computing.")


class RankMemory(_Typed):
    """One shard rank's memory after its last micro-batch."""

    rss_mib: float = Field(description="Resident memory of the rank's process.")
    device_mib: float = Field(description="Device (CUDA) memory held by its tensors.")


class RequestType(StrEnum):
    """lm-eval's request types, which the engine runs one after the other as its phases."""

    LOGLIKELIHOOD = "loglikelihood"
    LOGLIKELIHOOD_ROLLING = "loglikelihood_rolling"
    GENERATE_UNTIL = "generate_until"


class PhaseCounts(_Read):
    """Progress of one request type (lm-eval runs them one after the other).

    ``done`` and ``total`` count the requests the response cache answered (``cached``) too:
    an evaluation answered from the cache is done, not empty. Its rate counts only what the
    ranks computed (:attr:`requests_per_s`).
    """

    done: int = Field(description="Requests answered, from the response cache included.")
    total: int = Field(description="Requests of this type, the cached ones included.")
    tokens_per_s: float
    real_token_fraction: float = Field(description="Real tokens / padded tokens computed.")
    seconds: float = Field(
        0.0, description="Seconds this request type has run so far (rate: done / seconds)."
    )
    cached: int = Field(0, description="Requests answered from the response cache.")

    @property
    def requests_per_s(self) -> float:
        """Requests the ranks computed per second (those from the cache are not a rate)."""
        return max(0, self.done - self.cached) / self.seconds if self.seconds > 0 else 0.0


class Progress(PhaseCounts):
    """Progress of one request type, reported by the engine after every finished step.

    Beyond the counts: ``seconds`` of the request type so far (its rate and ETA are
    ``done / seconds`` and ``(total - done) / rate``), requests it answered from the response
    cache, per replica what it computed, per replica each shard rank's memory after its last
    micro-batch, and the engine's start-up: the slowest rank's model load and the seconds from the
    engine's start to its first batch.
    """

    model_config = ConfigDict(extra="forbid")

    phase: str = Field(description="The request type (loglikelihood, generate_until, ...).")
    replicas: dict[str, ReplicaWork] = Field(default_factory=dict)
    rank_memory: dict[str, list[RankMemory]] = Field(
        default_factory=dict, description="Per replica, its shard ranks in order."
    )
    load_s: float | None = None
    startup_s: float | None = None


class StageName(StrEnum):
    """What an evaluation does while no batch moves: its start-up, in order, and what lm-eval
    does after the last request type."""

    PLACING = "placing"  # reserving the ranks' resources (a placement group)
    BUILDING_REQUESTS = "building_requests"  # lm-eval builds the requests; ranks load meanwhile
    LOADING = "loading"  # the requests are built; the ranks are still loading the model
    COMPUTING = "computing"  # batches run (the request types' progress says more)
    COMPUTING_METRICS = "computing_metrics"  # lm-eval computes metrics (and bootstrap errors)


class Stage(_Typed):
    """What an evaluation is doing between batches, since when; the ranks' loading alongside.

    Read back from storage too, so keys it does not know are dropped.
    """

    model_config = ConfigDict(extra="ignore")

    name: StageName
    started_at: float = Field(description="When the stage began (seconds since the epoch).")
    ranks_ready: int | None = Field(None, description="Ranks that loaded the model so far.")
    ranks: int | None = Field(None, description="Ranks loading (None: none are started).")

    @property
    def label(self) -> str:
        """The stage in words (``building requests, 1/2 ranks loaded``)."""
        words = self.name.value.replace("_", " ")
        if self.name is StageName.PLACING and self.ranks:
            return f"placing {self.ranks} ranks"
        if self.ranks is None or self.name not in (
            StageName.BUILDING_REQUESTS,
            StageName.LOADING,
        ):
            return words
        loaded = f"{self.ranks_ready or 0}/{self.ranks} ranks loaded"
        return f"{words}, {loaded}" if self.name is StageName.BUILDING_REQUESTS else loaded


class RequestWarning(_Typed):
    """A task has loglikelihood requests whose tokens do not measure it
    (:mod:`rayeval.service.engine.plan.checks`): how many of each kind, and the first as an
    example."""

    task: str
    counts: dict[str, int]
    example: dict[str, Any]


class TrackerWarning(_Typed):
    """An experiment tracker (MLflow, W&B) did not record the evaluation; its results stand."""

    tracker: str = Field(description="mlflow or wandb.")
    message: str = Field(description="What failed and what to check.")


#: What the engine calls with each warning: a task's requests that do not measure it, or a
#: tracker that did not record the evaluation.
OnWarning = Callable[[RequestWarning | TrackerWarning], None]


# ------------------------------------------------------------------------ the runner's
class ReplicaReuse(_Typed):
    """Whether a run used ranks kept by an earlier one, and whether its own ranks are kept."""

    reused: bool = False
    kept: bool = False


class RunOutputs(_Typed):
    """What a successful run hands back: lm-eval's files verbatim, and rayeval's figures."""

    results_json: str = Field(description="lm-eval's results file, verbatim.")
    samples: dict[str, str] = Field(description="Per task, lm-eval's samples JSONL, verbatim.")
    stats: dict[str, Any] = Field(description="The engine's figures per request type.")
    replicas: ReplicaReuse = ReplicaReuse()


class RunnerStatus(_Read):
    """What a runner actor is doing (``EvaluationRunner.current``)."""

    evaluation_id: str = Field(description="Its latest evaluation.")
    owner: str = Field(description="The evaluation whose names its resources carry.")
    running: bool
    kept: bool = Field(description="Loaded ranks are held for the next evaluation.")


class _RunnerEvent(_Typed):
    seq: int = Field(description="Numbered from 1 per evaluation.")
    time: float = Field(description="When the runner recorded it (seconds since the epoch).")


class RunnerProgress(_RunnerEvent):
    """A request type moved."""

    type: Literal[RunnerEventKind.PROGRESS] = RunnerEventKind.PROGRESS
    progress: Progress


class RunnerWarning(_RunnerEvent):
    """A task has requests that do not measure it."""

    type: Literal[RunnerEventKind.WARNING] = RunnerEventKind.WARNING
    warning: RequestWarning | TrackerWarning


class CheckpointOutputs(_Typed):
    """One checkpoint of a sweep or watch, as it ended: its record and lm-eval's files."""

    record: dict[str, Any] = Field(
        description="Its sweep record (rayeval.service.engine.sweep_summary.CheckpointRecord)."
    )
    results_json: str | None = Field(
        None, description="lm-eval's results file, verbatim (None unless it succeeded)."
    )
    samples: dict[str, str] = Field(
        default_factory=dict, description="Per task, lm-eval's samples JSONL, verbatim."
    )

    @property
    def label(self) -> str:
        """Its unique name within the sweep."""
        return str(self.record["label"])


class RunnerCheckpoint(_RunnerEvent):
    """A checkpoint of a sweep or watch ended (evaluated, skipped, refused or failed)."""

    type: Literal[RunnerEventKind.CHECKPOINT] = RunnerEventKind.CHECKPOINT
    outputs: CheckpointOutputs


class RunnerWaiting(_RunnerEvent):
    """A watch is alive and waiting for its next checkpoint (sent while nothing else is)."""

    type: Literal[RunnerEventKind.WAITING] = RunnerEventKind.WAITING


class RunnerSucceeded(_RunnerEvent):
    """The run ended with results (the last event of a successful run)."""

    type: Literal[RunnerEventKind.SUCCEEDED] = RunnerEventKind.SUCCEEDED
    outputs: RunOutputs


class RunnerFailed(_RunnerEvent):
    """The run ended with an error (the last event of a failed run)."""

    type: Literal[RunnerEventKind.FAILED] = RunnerEventKind.FAILED
    error: str
    kind: str = Field(description="The error's class name.")
    traceback: str | None = Field(
        default=None, description="Where it was raised: the rank's traceback for a rank's error."
    )


class RunnerStage(_RunnerEvent):
    """The evaluation entered a stage, or its ranks' loading moved."""

    type: Literal[RunnerEventKind.STAGE] = RunnerEventKind.STAGE
    stage: Stage


#: One event a runner keeps and ``events_since`` returns.
RunnerEvent = Annotated[
    RunnerProgress
    | RunnerStage
    | RunnerWarning
    | RunnerCheckpoint
    | RunnerWaiting
    | RunnerSucceeded
    | RunnerFailed,
    Field(discriminator="type"),
]
#: Reads and writes lists of runner events as JSON.
RUNNER_EVENTS: TypeAdapter[list[RunnerEvent]] = TypeAdapter(list[RunnerEvent])


# ------------------------------------------------------------------- the service's
class PhaseReport(Progress):
    """A request type's latest progress as stored: the engine's report and when it was made."""

    model_config = ConfigDict(extra="ignore")

    updated_at: float = Field(
        0.0, description="When the runner reported it (seconds since the epoch)."
    )

    @classmethod
    def of(cls, progress: Progress, updated_at: float) -> PhaseReport:
        """``progress`` as reported at ``updated_at``."""
        return cls(**dict(progress), updated_at=updated_at)


class EvaluationProgress(_Read):
    """An evaluation's stored progress: per request type, its latest report."""

    phases: dict[str, PhaseReport] = Field(default_factory=dict)
    stage: Stage | None = Field(default=None, description="The latest stage (None: none reported).")

    def dump(self) -> dict[str, Any]:
        """The JSON-able form; without a stage, the form written before stages existed."""
        data = super().dump()
        if self.stage is None:
            del data["stage"]
        return data

    @property
    def done(self) -> int:
        """Requests done over every request type seen so far."""
        return sum(p.done for p in self.phases.values())

    @property
    def total(self) -> int:
        """Requests known over every request type seen so far."""
        return sum(p.total for p in self.phases.values())

    def latest(self) -> PhaseReport | None:
        """The most recent report (None before the first batch)."""
        return max(self.phases.values(), key=lambda p: p.updated_at, default=None)

    def all_answered(self) -> bool:
        """Every request of every request type seen so far is answered."""
        return all(p.done >= p.total for p in self.phases.values())

    def with_reports(self, reports: Mapping[str, PhaseReport]) -> EvaluationProgress:
        """This progress with ``reports`` (request type -> report) replacing their phases."""
        return EvaluationProgress(phases={**self.phases, **reports}, stage=self.stage)

    def at_stage(self, stage: Stage | None) -> EvaluationProgress:
        """This progress at ``stage`` (None: the same stage)."""
        return self if stage is None else self.model_copy(update={"stage": stage})


class _StreamEvent(_Read):
    KIND: ClassVar[EventKind]

    def stored(self) -> tuple[EventKind, dict[str, Any]]:
        """The event as the store keeps it: its kind and its JSON."""
        return self.KIND, self.dump()


class StateEvent(_StreamEvent):
    """A state change, with the error on failure."""

    KIND: ClassVar[EventKind] = EventKind.STATE
    status: EvaluationStatus
    error: str | None = None
    traceback: str | None = Field(
        default=None,
        description="On failure, the traceback of what raised the error (a rank's for an error "
        "inside a rank); absent where there is none (the watchdog's verdicts).",
    )

    def dump(self) -> dict[str, Any]:
        """The JSON-able form; without a traceback, the form written before tracebacks existed."""
        data = super().dump()
        if self.traceback is None:
            del data["traceback"]
        return data


class ProgressEvent(PhaseReport, _StreamEvent):
    """One request type moved; the overall totals are over every request type seen so far."""

    KIND: ClassVar[EventKind] = EventKind.PROGRESS
    overall_done: int
    overall_total: int

    @classmethod
    def of_phase(cls, report: PhaseReport, progress: EvaluationProgress) -> ProgressEvent:
        """The event of ``report``, with totals over ``progress`` (which includes it)."""
        return cls(**dict(report), overall_done=progress.done, overall_total=progress.total)


class WarningEvent(RequestWarning, _StreamEvent):
    """A task has loglikelihood requests whose tokens do not measure it."""

    KIND: ClassVar[EventKind] = EventKind.WARNING
    model_config = ConfigDict(extra="ignore")

    @classmethod
    def of_warning(cls, warning: RequestWarning) -> WarningEvent:
        """The stream's event for the engine's warning."""
        return cls(**dict(warning))


class TrackerWarningEvent(TrackerWarning, _StreamEvent):
    """An experiment tracker did not record the evaluation (a ``warning`` with ``tracker``)."""

    KIND: ClassVar[EventKind] = EventKind.WARNING
    model_config = ConfigDict(extra="ignore")


def warning_event(warning: RequestWarning | TrackerWarning) -> WarningEvent | TrackerWarningEvent:
    """The stream's event for a warning the runner reported."""
    if isinstance(warning, TrackerWarning):
        return TrackerWarningEvent(**dict(warning))
    return WarningEvent.of_warning(warning)


class TaskResultEvent(_StreamEvent):
    """One task's (or group's) metrics, when the evaluation ends."""

    KIND: ClassVar[EventKind] = EventKind.TASK_RESULT
    task: str
    metrics: dict[str, Any]


class ResultEvent(_StreamEvent):
    """lm-eval's results JSON; stored empty (the results are kept once, in their own table) and
    filled in by the API when it sends the event."""

    KIND: ClassVar[EventKind] = EventKind.RESULT


class PreemptedEvent(_StreamEvent):
    """The evaluation was stopped to make room for a more urgent one and is queued again; when
    it runs again the response cache answers what it had finished (its progress events count
    them as ``cached``)."""

    KIND: ClassVar[EventKind] = EventKind.PREEMPTED
    by: str = Field(description="The evaluation it made room for.")
    done: int = Field(description="Requests it had answered when it was stopped.")


class CheckpointEvent(_StreamEvent):
    """A sweep's or watch's checkpoint ended; its results are at ``GET
    /evaluations/{id}/checkpoints/{label}/results`` when it succeeded."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT
    label: str
    step: int | None
    status: str = Field(description="succeeded, skipped, refused or failed.")
    error: str | None = None

    @classmethod
    def of_outputs(cls, outputs: CheckpointOutputs) -> CheckpointEvent:
        """The stream's event for a checkpoint the runner reported."""
        record = outputs.record
        return cls(
            label=outputs.label,
            step=record.get("step"),
            status=str(record["status"]),
            error=record.get("error"),
        )


class StageEvent(Stage, _StreamEvent):
    """The evaluation entered a stage (start-up, metrics), or its ranks' loading moved."""

    KIND: ClassVar[EventKind] = EventKind.STAGE

    @classmethod
    def of_stage(cls, stage: Stage) -> StageEvent:
        """The stream's event for a stage the runner reported."""
        return cls(**dict(stage))


#: One event of an evaluation's stream.
StreamEvent = (
    StateEvent
    | ProgressEvent
    | WarningEvent
    | TrackerWarningEvent
    | TaskResultEvent
    | ResultEvent
    | PreemptedEvent
    | CheckpointEvent
    | StageEvent
)
_STREAM_EVENTS: dict[EventKind, type[StreamEvent]] = {
    kind.KIND: kind
    for kind in (
        StateEvent,
        ProgressEvent,
        WarningEvent,
        TaskResultEvent,
        ResultEvent,
        PreemptedEvent,
        CheckpointEvent,
        StageEvent,
    )
}


def stream_event(kind: EventKind, data: Mapping[str, Any]) -> StreamEvent:
    """A stored event's payload as its type.

    Raises:
        pydantic.ValidationError: ``data`` is not the form of a ``kind`` event.
    """
    if kind is EventKind.WARNING and "tracker" in data:
        return TrackerWarningEvent.parse(data)
    return _STREAM_EVENTS[kind].parse(data)
