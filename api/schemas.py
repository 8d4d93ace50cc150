"""Request and response bodies of the REST API (their shapes are what /docs shows).

The body of ``POST /evaluations`` is :class:`rayeval.service.vocabulary.config.EvaluationConfig`
itself — the one configuration object every entry point builds — so a new option is declared once,
there, and appears here with its default, bounds and description. ``EvaluationPublic`` is what the
API returns about one evaluation; its progress per request type is the service's own
:class:`rayeval.service.vocabulary.events.PhaseCounts`.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayeval.service.vocabulary.config import EvaluationConfig
from rayeval.service.vocabulary.events import EvaluationProgress, PhaseCounts, Stage, StageName
from rayeval.service.vocabulary.states import EvaluationStatus

#: The body of ``POST /evaluations``: lm-eval's options (same names and meanings) plus the layout.
EvaluationCreate = EvaluationConfig


class PhaseProgress(PhaseCounts):
    """Progress of one request type (lm-eval runs them one after the other)."""


class StagePublic(BaseModel):
    """What a starting or running evaluation is doing while no batch moves."""

    name: StageName = Field(
        description="placing, building_requests, loading, computing or computing_metrics."
    )
    label: str = Field(description="In words: 'building requests, 1/2 ranks loaded'.")
    ranks_ready: int | None = Field(description="Ranks that loaded the model so far.")
    ranks: int | None = Field(description="Ranks started (null: none, e.g. all from cache).")
    elapsed_s: float = Field(description="Seconds in this stage so far.")

    @classmethod
    def of(cls, stage: Stage, now: float) -> StagePublic:
        """``stage`` as of ``now`` (seconds since the epoch)."""
        return cls(
            name=stage.name,
            label=stage.label,
            ranks_ready=stage.ranks_ready,
            ranks=stage.ranks,
            elapsed_s=round(max(0.0, now - stage.started_at), 1),
        )


class ProgressPublic(BaseModel):
    """Requests done and known so far (those the response cache answered included); a request
    type's total is known once it starts."""

    done: int
    total: int
    cached: int = Field(0, description="Requests the response cache answered.")
    phases: dict[str, PhaseProgress]
    stage: StagePublic | None = Field(
        None, description="While starting or running: what it does between batches."
    )

    @classmethod
    def of(cls, progress: EvaluationProgress, active: bool = False) -> ProgressPublic:
        """What the API shows of an evaluation's stored progress (``active``: its stage too)."""
        stage = progress.stage if active else None
        return cls(
            done=progress.done,
            total=progress.total,
            cached=sum(p.cached for p in progress.phases.values()),
            phases={
                name: PhaseProgress.model_validate(report, from_attributes=True)
                for name, report in progress.phases.items()
            },
            stage=StagePublic.of(stage, time.time()) if stage is not None else None,
        )


class Throughput(BaseModel):
    """Speed of the run: tokens/s of the current request type, requests/s since it started."""

    tokens_per_s: float | None
    requests_per_s: float | None


class Links(BaseModel):
    """Where to find the evaluation's other resources."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    self_: str = Field(alias="self")
    events: str
    results: str
    samples: dict[str, str] = Field(description="Per task, its samples (with log_samples).")
    sweep: str | None = Field(
        None, description="A checkpoint sweep's or watch's summary, per checkpoint (else null)."
    )


class EvaluationPublic(BaseModel):
    """One evaluation: its state, progress, timestamps, error and request."""

    id: str
    kind: Literal["evaluation", "sweep", "watch"] = Field(
        "evaluation",
        description="One evaluation, a sweep over a list of checkpoints, or a watched directory.",
    )
    owner: str = Field(description="The user who submitted it.")
    status: EvaluationStatus
    queue_position: int | None = Field(
        description="1: next to start (fair share of the queue); null unless queued."
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    progress: ProgressPublic
    throughput: Throughput
    stats: dict[str, Any] | None = Field(
        None,
        description=(
            "Per request type (when finished): requests, answers from the response cache "
            "(cached), answers computed twice (recomputed), micro-batches, those computed again "
            "after their replica was lost (requeued), tokens/s. A sweep's: its checkpoints' "
            "counts and seconds added up."
        ),
    )
    request: EvaluationConfig
    links: Links


class EvaluationList(BaseModel):
    """A page of evaluations, newest first."""

    items: list[EvaluationPublic]
    total: int
    limit: int
    offset: int


class Health(BaseModel):
    """Liveness of the service."""

    status: Literal["ok"] = "ok"
    ray_connected: bool
    task_index: str = Field(description="lm-eval's task index: building, ready or failed.")


class ValidationItem(BaseModel):
    """One problem of a malformed request, machine-readable."""

    loc: list[str] = Field(description="Where: the body field or query parameter path.")
    msg: str
    type: str


class ErrorBody(BaseModel):
    """Every error response: what went wrong and how to fix it."""

    detail: str = Field(description="What went wrong and what to do, in one sentence or more.")
    errors: list[ValidationItem] | None = Field(
        None, description="For a malformed request (422): each problem, machine-readable."
    )


#: What every ``/evaluations`` route can answer besides success: a malformed request or foreign
#: Host header (400), a bad key (401), an unknown id or another member's (404), a malformed body
#: or query (422).
EVALUATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 422)
}
