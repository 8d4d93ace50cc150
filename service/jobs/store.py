"""Durable state of the service: evaluations, their event streams, results and samples.

One SQLAlchemy database (SQLite under the data directory by default, any SQLAlchemy URL otherwise).
Every state change is one short transaction that also appends the matching events, so a reader
never sees an event whose state is not stored, nor a terminal state without its results. State
transitions are conditional updates (``... WHERE status IN (expected)``): whoever changes an
evaluation first wins and the loser learns it from the return value, which is what makes a
concurrent cancel and completion safe; the allowed moves are
:data:`rayeval.service.vocabulary.states.TRANSITIONS`. lm-eval's results are stored once, in their
own table: the ``result`` event on the stream holds no copy (the API fills it in from the results
table when it sends it). Event numbers (``seq``) start at 1 and increase by one per evaluation.
Users and keys (:attr:`EvaluationStore.accounts`), the audit trail (:attr:`EvaluationStore.audit`)
and a sweep's checkpoints (:attr:`EvaluationStore.sweeps`) share the database. The schema is created
and migrated by :mod:`rayeval.service.jobs.migrations`. No torch here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session, sessionmaker

from rayeval.service.jobs import migrations
from rayeval.service.jobs.accounts import Accounts
from rayeval.service.jobs.audit import AuditTrail
from rayeval.service.jobs.records import (
    EvaluationRecord,
    EventRecord,
    NewEvent,
    record_of,
    stored_progress,
)
from rayeval.service.jobs.rows import (
    BUILTIN_ADMIN,
    EvaluationRow,
    EventRow,
    ResultRow,
    SamplesRow,
    make_engine,
)
from rayeval.service.jobs.sweep_results import SweepResults, store_checkpoints
from rayeval.service.vocabulary.errors import unknown_evaluation
from rayeval.service.vocabulary.events import (
    CheckpointOutputs,
    EvaluationProgress,
    PreemptedEvent,
    ResultEvent,
    StateEvent,
)
from rayeval.service.vocabulary.states import ACTIVE_STATUSES, EvaluationStatus, EventKind

#: The records the store hands out are defined beside it; importers may name them from here.
__all__ = ["EvaluationRecord", "EvaluationStore", "EventRecord", "NewEvent"]

logger = logging.getLogger(__name__)


class EvaluationStore:
    """All reads and writes of the service's database.

    Args:
        url: A SQLAlchemy URL, e.g. ``sqlite:////srv/rayeval/rayeval.db``.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine = make_engine(url)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._versions: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.audit = AuditTrail(self._sessions)
        self.accounts = Accounts(self._sessions, self.audit)
        self.sweeps = SweepResults(self._sessions)

    # -------------------------------------------------------------------- changes
    def version(self, evaluation_id: str) -> int:
        """A number that grows whenever this store writes the evaluation (in this process)."""
        return self._versions.get(evaluation_id, 0)

    def on_change(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(evaluation_id)`` after every write this store commits for it."""
        self._listeners.append(listener)

    def _changed(self, evaluation_id: str) -> None:
        self._versions[evaluation_id] = self._versions.get(evaluation_id, 0) + 1
        for listener in self._listeners:
            listener(evaluation_id)

    def create_schema(self) -> None:
        """Create or migrate the schema to the newest revision (existing rows are kept)."""
        migrations.upgrade(self._engine)

    def close(self) -> None:
        """Release the connection pool."""
        self._engine.dispose()

    # ------------------------------------------------------------------------ writes
    def create(
        self, config: dict[str, Any], resources: dict[str, float], owner: str = BUILTIN_ADMIN
    ) -> EvaluationRecord:
        """Store a new queued evaluation of ``owner`` (and its first event) and return it."""
        row = EvaluationRow(
            id=uuid.uuid4().hex[:16],
            owner=owner,
            status=EvaluationStatus.QUEUED.value,
            config=config,
            resources=resources,
            created_at=_now(),
            progress=EvaluationProgress().dump(),
            last_event_seq=0,
            runner_cursor=0,
        )
        with self._transaction(row.id) as session:
            session.add(row)
            session.flush()
            _append_events(session, row.id, [StateEvent(status=EvaluationStatus.QUEUED)])
            session.refresh(row)
            return record_of(row)

    def transition(
        self,
        evaluation_id: str,
        to: EvaluationStatus,
        only_from: Iterable[EvaluationStatus] | None = None,
        error: str | None = None,
        events: Sequence[NewEvent] = (),
        traceback: str | None = None,
    ) -> bool:
        """Move an evaluation to ``to`` if the state machine allows it; append ``events`` + state.

        Args:
            only_from: Narrow the allowed source states further (default: every state that may
                move to ``to``).
            traceback: On failure, where the error was raised (the state event carries it).

        Returns:
            True if this call made the change; False if the evaluation was in another state.
        """
        allowed = EvaluationStatus.sources_of(to)
        expect = allowed if only_from is None else allowed & frozenset(only_from)
        values: dict[str, Any] = {"status": to.value}
        if to is EvaluationStatus.STARTING:
            values["started_at"] = _now()
        if to.is_terminal:
            values["finished_at"] = _now()
            values["error"] = error
        with self._transaction(evaluation_id) as session:
            if not _update_if(session, evaluation_id, expect, **values):
                return False
            state = StateEvent(status=to, error=error, traceback=traceback)
            _append_events(session, evaluation_id, [*events, state])
            return True

    def requeue(self, evaluation_id: str, preempted: PreemptedEvent) -> bool:
        """Put an active evaluation back in the queue (preempted): its runner cursor and progress
        start over, its events go on.

        Returns:
            True if this call made the change; False if the evaluation was no longer active.
        """
        with self._transaction(evaluation_id) as session:
            if not _update_if(
                session,
                evaluation_id,
                EvaluationStatus.sources_of(EvaluationStatus.QUEUED),
                status=EvaluationStatus.QUEUED.value,
                started_at=None,
                runner_cursor=0,
                progress=EvaluationProgress().dump(),
            ):
                return False
            _append_events(
                session, evaluation_id, [preempted, StateEvent(status=EvaluationStatus.QUEUED)]
            )
            return True

    def record_progress(
        self,
        evaluation_id: str,
        progress: EvaluationProgress | Mapping[str, Any],
        runner_cursor: int,
        events: Sequence[NewEvent] = (),
        checkpoints: Sequence[CheckpointOutputs] = (),
    ) -> bool:
        """Store new progress and the runner cursor of an active evaluation, with its events
        and a sweep's checkpoints that ended (:mod:`rayeval.service.jobs.sweep_results`).

        Args:
            progress: The evaluation's progress (or its JSON form).

        Returns:
            False if the evaluation is no longer active (nothing is written then).
        """
        with self._transaction(evaluation_id) as session:
            if not _update_if(
                session,
                evaluation_id,
                ACTIVE_STATUSES,
                progress=stored_progress(progress).dump(),
                runner_cursor=runner_cursor,
            ):
                return False
            store_checkpoints(session, evaluation_id, checkpoints)
            _append_events(session, evaluation_id, events)
            return True

    def finish_succeeded(
        self,
        evaluation_id: str,
        results_json: str,
        samples: dict[str, str],
        stats: dict[str, Any],
        events: Sequence[NewEvent],
    ) -> bool:
        """Store the results and samples and mark the evaluation succeeded, atomically.

        Args:
            results_json: The results file exactly as lm-eval wrote it.
            samples: Per task, the samples file exactly as lm-eval wrote it (JSONL).
            stats: rayeval's throughput figures per request type.
            events: Appended before the ``result`` event and the final state event.

        Returns:
            False (and nothing stored) if the evaluation was no longer active.
        """
        with self._transaction(evaluation_id) as session:
            if not _update_if(
                session,
                evaluation_id,
                EvaluationStatus.sources_of(EvaluationStatus.SUCCEEDED),
                status=EvaluationStatus.SUCCEEDED.value,
                finished_at=_now(),
                error=None,
            ):
                return False
            session.add(
                ResultRow(evaluation_id=evaluation_id, results_json=results_json, stats=stats)
            )
            for task, jsonl in samples.items():
                session.add(SamplesRow(evaluation_id=evaluation_id, task=task, jsonl=jsonl))
            _append_events(
                session,
                evaluation_id,
                [*events, ResultEvent(), StateEvent(status=EvaluationStatus.SUCCEEDED)],
            )
            return True

    # ------------------------------------------------------------------------- reads
    def get(self, evaluation_id: str) -> EvaluationRecord:
        """One evaluation.

        Raises:
            EvaluationNotFoundError: no evaluation has this id.
        """
        with self._sessions() as session:
            row = session.scalar(select(EvaluationRow).where(EvaluationRow.id == evaluation_id))
            if row is None:
                raise unknown_evaluation(evaluation_id)
            return record_of(row)

    def page(
        self,
        statuses: Iterable[EvaluationStatus] | None = None,
        limit: int = 50,
        offset: int = 0,
        oldest_first: bool = False,
        owner: str | None = None,
    ) -> tuple[list[EvaluationRecord], int]:
        """A page of evaluations (newest first unless ``oldest_first``; only ``owner``'s if
        given) and the total count."""
        query = select(EvaluationRow)
        count = select(func.count()).select_from(EvaluationRow)
        if owner is not None:
            query = query.where(EvaluationRow.owner == owner)
            count = count.where(EvaluationRow.owner == owner)
        if statuses is not None:
            wanted = [s.value for s in statuses]
            query = query.where(EvaluationRow.status.in_(wanted))
            count = count.where(EvaluationRow.status.in_(wanted))
        order = EvaluationRow.number.asc() if oldest_first else EvaluationRow.number.desc()
        with self._sessions() as session:
            rows = session.scalars(query.order_by(order).limit(limit).offset(offset)).all()
            return [record_of(row) for row in rows], int(session.scalar(count) or 0)

    def count_by_status(self) -> dict[EvaluationStatus, int]:
        """How many evaluations are in each state (states with none are absent)."""
        with self._sessions() as session:
            rows = session.execute(
                select(EvaluationRow.status, func.count()).group_by(EvaluationRow.status)
            ).all()
        return {EvaluationStatus(status): int(count) for status, count in rows}

    def queued(self) -> list[EvaluationRecord]:
        """Every queued evaluation, in submission (FIFO) order."""
        return self._all([EvaluationStatus.QUEUED])

    def active(self) -> list[EvaluationRecord]:
        """Every evaluation that has (or should have) a runner: starting or running."""
        return self._all(ACTIVE_STATUSES)

    def queue_position(self, record: EvaluationRecord) -> int | None:
        """1 for the next evaluation to start, None when not queued."""
        if record.status is not EvaluationStatus.QUEUED:
            return None
        with self._sessions() as session:
            ahead = session.scalar(
                select(func.count())
                .select_from(EvaluationRow)
                .where(
                    EvaluationRow.status == EvaluationStatus.QUEUED.value,
                    EvaluationRow.number < record.number,
                )
            )
            return int(ahead or 0) + 1

    def events_since(self, evaluation_id: str, seq: int, limit: int = 500) -> list[EventRecord]:
        """Events with a number above ``seq``, in order (at most ``limit``)."""
        with self._sessions() as session:
            rows = session.scalars(
                select(EventRow)
                .where(EventRow.evaluation_id == evaluation_id, EventRow.seq > seq)
                .order_by(EventRow.seq)
                .limit(limit)
            ).all()
            return [EventRecord(r.seq, EventKind(r.type), r.data, r.created_at) for r in rows]

    def stats(self, evaluation_id: str) -> dict[str, Any] | None:
        """rayeval's figures of a succeeded evaluation (without loading its results file)."""
        with self._sessions() as session:
            return session.scalar(
                select(ResultRow.stats).where(ResultRow.evaluation_id == evaluation_id)
            )

    def results_json(self, evaluation_id: str) -> tuple[str, dict[str, Any]] | None:
        """The stored lm-eval results file and rayeval's stats, or None if there are none."""
        with self._sessions() as session:
            row = session.get(ResultRow, evaluation_id)
            return (row.results_json, row.stats) if row is not None else None

    def sample_tasks(self, evaluation_ids: Sequence[str]) -> dict[str, list[str]]:
        """For each id, the tasks whose samples are stored (sorted)."""
        if not evaluation_ids:
            return {}
        with self._sessions() as session:
            rows = session.execute(
                select(SamplesRow.evaluation_id, SamplesRow.task)
                .where(SamplesRow.evaluation_id.in_(list(evaluation_ids)))
                .order_by(SamplesRow.task)
            ).all()
        found: dict[str, list[str]] = {i: [] for i in evaluation_ids}
        for evaluation_id, task in rows:
            found[evaluation_id].append(task)
        return found

    def samples_jsonl(self, evaluation_id: str, task: str) -> str | None:
        """One task's samples file as lm-eval wrote it, or None."""
        with self._sessions() as session:
            row = session.get(SamplesRow, (evaluation_id, task))
            return row.jsonl if row is not None else None

    # ---------------------------------------------------------------------- internals
    def _all(self, statuses: Iterable[EvaluationStatus]) -> list[EvaluationRecord]:
        with self._sessions() as session:
            rows = session.scalars(
                select(EvaluationRow)
                .where(EvaluationRow.status.in_([s.value for s in statuses]))
                .order_by(EvaluationRow.number)
            ).all()
            return [record_of(row) for row in rows]

    @contextmanager
    def _transaction(self, evaluation_id: str) -> Iterator[Session]:
        """One transaction about one evaluation; listeners hear of it once it is committed."""
        with self._sessions() as session, session.begin():
            yield session
        self._changed(evaluation_id)


def _append_events(session: Session, evaluation_id: str, events: Sequence[NewEvent]) -> None:
    """Number and store events; the counter update serialises concurrent writers."""
    if not events:
        return
    last = session.execute(
        update(EvaluationRow)
        .where(EvaluationRow.id == evaluation_id)
        .values(last_event_seq=EvaluationRow.last_event_seq + len(events))
        .returning(EvaluationRow.last_event_seq)
    ).scalar_one()
    now = _now()
    for offset, new in enumerate(events):
        kind, data = new if isinstance(new, tuple) else new.stored()
        seq = last - len(events) + 1 + offset
        session.add(
            EventRow(evaluation_id=evaluation_id, seq=seq, type=kind, data=data, created_at=now)
        )


def _update_if(
    session: Session, evaluation_id: str, statuses: Iterable[EvaluationStatus], **values: Any
) -> bool:
    """Update one evaluation only while its status is one of ``statuses``; True if it was."""
    result = session.execute(
        update(EvaluationRow)
        .where(
            EvaluationRow.id == evaluation_id,
            EvaluationRow.status.in_([s.value for s in statuses]),
        )
        .values(**values)
    )
    assert isinstance(result, CursorResult)
    return int(result.rowcount) == 1


def _now() -> datetime:
    return datetime.now(UTC)
