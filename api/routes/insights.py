"""``/evaluations/{id}/timeline``: an evaluation's progress over time, for plots and ETAs.

Every stored ``progress`` event becomes one point (the runner's time, the request type, its
counts, rates and seconds so far); ``?after=N`` returns only points after event ``N``, so a page
that polls reads each point once.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from rayeval.api.deps import CallerDep, StoreDep, require_token
from rayeval.api.schemas import EVALUATION_ERRORS
from rayeval.service.jobs.accounts import check_access
from rayeval.service.vocabulary.events import ProgressEvent
from rayeval.service.vocabulary.states import EventKind

router = APIRouter(
    prefix="/evaluations",
    tags=["evaluations"],
    dependencies=[Depends(require_token)],
    responses=EVALUATION_ERRORS,
)
#: Most points one answer carries (the rest follow with ?after=).
MAX_POINTS = 5000
#: Largest event number a request may name (as the event stream's).
MAX_SEQ = 2**53


class TimelinePoint(BaseModel):
    """One progress report of one request type."""

    seq: int = Field(description="The event's number (pass it as ?after= to continue).")
    time: float = Field(description="When the runner reported it (seconds since the epoch).")
    request_type: str
    done: int
    total: int
    seconds: float = Field(description="Seconds this request type has run so far.")
    tokens_per_s: float = Field(description="Average over the request type so far.")
    tokens: float = Field(
        description="Real tokens computed so far (rate between two points: "
        "difference of tokens over difference of seconds)."
    )
    requests_per_s: float | None


class Timeline(BaseModel):
    """Progress points in event order; ``last_seq`` is where to continue from."""

    points: list[TimelinePoint]
    last_seq: int
    complete: bool = Field(description="False when more points follow (ask again with ?after=).")


@router.get("/{evaluation_id}/timeline", response_model=Timeline, summary="Progress over time")
def get_timeline(
    evaluation_id: str,
    store: StoreDep,
    caller: CallerDep,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="Only points after this event.")] = 0,
) -> Timeline:
    """Throughput and counts of each request type over time (404 for an unknown id)."""
    check_access(store.get(evaluation_id), caller)
    points: list[TimelinePoint] = []
    seq = after
    while len(points) < MAX_POINTS:
        events = store.events_since(evaluation_id, seq)
        if not events:
            break
        seq = events[-1].seq
        progress = [e for e in events if e.type is EventKind.PROGRESS]
        moved = [(e.seq, ProgressEvent.parse(e.data)) for e in progress]
        # A request type the response cache answered whole computed nothing: no point.
        points += [_point(seq, event) for seq, event in moved if event.done > event.cached]
    return Timeline(points=points, last_seq=seq, complete=len(points) < MAX_POINTS)


def _point(seq: int, event: ProgressEvent) -> TimelinePoint:
    seconds = event.seconds
    return TimelinePoint(
        seq=seq,
        time=event.updated_at,
        request_type=event.phase,
        done=event.done,
        total=event.total,
        seconds=seconds,
        tokens_per_s=event.tokens_per_s,
        tokens=event.tokens_per_s * seconds,
        requests_per_s=event.requests_per_s if seconds > 0 else None,
    )
