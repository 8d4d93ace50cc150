"""Evaluations and their events as the store hands them out: plain values, detached from the
database, with progress parsed into its type
(:class:`rayeval.service.vocabulary.events.EvaluationProgress`). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rayeval.service.jobs.rows import BUILTIN_ADMIN, EvaluationRow
from rayeval.service.vocabulary.config import EvaluationConfig, Scheduling
from rayeval.service.vocabulary.events import EvaluationProgress, StreamEvent, stream_event
from rayeval.service.vocabulary.states import EvaluationStatus, EventKind


@dataclass(frozen=True)
class EvaluationRecord:
    """One stored evaluation, detached from the database.

    ``config`` is the evaluation's configuration, parsed once here (the store keeps its
    ``to_json()``); ``progress`` is per request type its latest
    report; ``runner_cursor`` is the last runner event already turned into stored events;
    ``owner`` is the user who submitted it.
    """

    id: str
    number: int
    status: EvaluationStatus
    config: EvaluationConfig
    resources: dict[str, float]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    progress: EvaluationProgress
    last_event_seq: int
    runner_cursor: int
    owner: str = BUILTIN_ADMIN

    @property
    def scheduling(self) -> Scheduling:
        """Its priority and whether it may be preempted (rows from before: the defaults)."""
        return self.config.scheduling

    @property
    def ranks(self) -> int:
        """Ranks its layout holds (R x G), what a user's cap counts."""
        return self.config.parallelism.num_replicas * self.config.parallelism.shard_size


@dataclass(frozen=True)
class EventRecord:
    """One event of an evaluation's stream: ``data`` is its JSON as stored."""

    seq: int
    type: EventKind
    data: dict[str, Any]
    created_at: datetime

    def payload(self) -> StreamEvent:
        """The event as its type (:mod:`rayeval.service.vocabulary.events`).

        Raises:
            pydantic.ValidationError: the stored JSON is not the form of its kind.
        """
        return stream_event(self.type, self.data)


#: An event about to be stored: a typed stream event, or one already in its stored form (its
#: kind and its JSON).
NewEvent = StreamEvent | tuple[EventKind, dict[str, Any]]


def record_of(row: EvaluationRow) -> EvaluationRecord:
    """The stored evaluation ``row`` as a detached value."""
    return EvaluationRecord(
        id=row.id,
        number=row.number,
        owner=row.owner,
        status=EvaluationStatus(row.status),
        config=EvaluationConfig.from_json(row.config),  # rayeval 0.1's flat layout fields too
        resources=row.resources,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        error=row.error,
        progress=stored_progress(row.progress),
        last_event_seq=row.last_event_seq,
        runner_cursor=row.runner_cursor,
    )


def stored_progress(progress: EvaluationProgress | Mapping[str, Any]) -> EvaluationProgress:
    """Stored progress as its type (the JSON column reads back as a dict)."""
    if isinstance(progress, EvaluationProgress):
        return progress
    return EvaluationProgress.parse(progress)
