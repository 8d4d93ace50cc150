"""A sweep's or watch's checkpoints in the service's database: each one's record and lm-eval's
files, written as the runner reports them and read by ``GET /evaluations/{id}/sweep`` and
``/checkpoints/{label}/...``.

A checkpoint reported twice (the evaluation was preempted and ran again, or a watch found it
again) keeps its first position in the sweep; the later report replaces the earlier, except that
a ``skipped`` report (evaluated before, with these settings) never replaces a stored
``succeeded`` one, whose results it points back to. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from rayeval.service.jobs.rows import CheckpointRow
from rayeval.service.vocabulary.events import CheckpointOutputs


@dataclass(frozen=True)
class StoredCheckpoint:
    """One checkpoint as stored: its sweep record, whether its results file is kept, and the
    tasks whose samples are kept."""

    record: dict[str, Any]
    has_results: bool
    sample_tasks: list[str]


def store_checkpoints(
    session: Session, evaluation_id: str, checkpoints: Sequence[CheckpointOutputs]
) -> None:
    """Write ``checkpoints`` of an evaluation inside the caller's transaction."""
    for outputs in checkpoints:
        row = session.get(CheckpointRow, (evaluation_id, outputs.label))
        if row is None:
            last = session.scalar(
                select(func.max(CheckpointRow.position)).where(
                    CheckpointRow.evaluation_id == evaluation_id
                )
            )
            row = CheckpointRow(
                evaluation_id=evaluation_id,
                label=outputs.label,
                position=(last or 0) + 1,
            )
            session.add(row)
        elif outputs.record.get("status") == "skipped" and row.results_json is not None:
            continue
        row.record = dict(outputs.record)
        row.results_json = outputs.results_json
        row.samples = dict(outputs.samples)


class SweepResults:
    """Reads of the checkpoints table (the store's ``sweeps``).

    Args:
        sessions: The store's session factory.
    """

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def checkpoints(self, evaluation_id: str) -> list[StoredCheckpoint]:
        """The evaluation's checkpoints in the order they ended first."""
        with self._sessions() as session:
            rows = session.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.evaluation_id == evaluation_id)
                .order_by(CheckpointRow.position)
            ).all()
            return [
                StoredCheckpoint(row.record, row.results_json is not None, sorted(row.samples))
                for row in rows
            ]

    def results_json(self, evaluation_id: str, label: str) -> str | None:
        """The checkpoint's lm-eval results file (None: no such checkpoint, or no results)."""
        with self._sessions() as session:
            row = session.get(CheckpointRow, (evaluation_id, label))
            return row.results_json if row is not None else None

    def samples_jsonl(self, evaluation_id: str, label: str, task: str) -> str | None:
        """The checkpoint's samples file of ``task`` (None: none kept)."""
        with self._sessions() as session:
            row = session.get(CheckpointRow, (evaluation_id, label))
            return row.samples.get(task) if row is not None else None
