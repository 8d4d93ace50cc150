"""The audit trail: who submitted, cancelled, retried or preempted which evaluation, and who
created, changed, rotated or revoked which user or key, and when.

One row per action in ``audit_events``, written by the manager (evaluations) and by whoever
manages users (the API's admin routes, ``rayeval users``); admins read it with ``GET /audit``
or ``rayeval audit``. Keys never appear in it, only their public ids. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from rayeval.service.jobs.rows import AuditRow
from rayeval.service.vocabulary.config import EvaluationConfig


class Action(StrEnum):
    """What an audit entry records."""

    SUBMIT = "submit"
    CANCEL = "cancel"
    RETRY = "retry"
    PREEMPT = "preempt"
    USER_ADD = "user.add"
    USER_UPDATE = "user.update"
    KEY_ROTATE = "key.rotate"
    KEY_REVOKE = "key.revoke"


@dataclass(frozen=True)
class AuditEntry:
    """One action: when, who (a user's name, or ``<name> (cli)`` at the shell), what, on what."""

    at: datetime
    actor: str
    action: Action
    target: str
    detail: dict[str, Any] = field(default_factory=dict)


class AuditTrail:
    """Appends to and reads the audit trail.

    Args:
        sessions: Opens a session of the service's database (the store's).
    """

    def __init__(self, sessions: Callable[[], AbstractContextManager[Session]]) -> None:
        self._sessions = sessions

    def record(
        self, actor: str, action: Action, target: str, detail: dict[str, Any] | None = None
    ) -> None:
        """Append one entry, timed now."""
        with self._sessions() as session, session.begin():
            session.add(
                AuditRow(
                    at=datetime.now(UTC),
                    actor=actor,
                    action=action.value,
                    target=target,
                    detail=detail or {},
                )
            )

    def page(
        self,
        limit: int = 100,
        offset: int = 0,
        actor: str | None = None,
        action: Action | None = None,
    ) -> tuple[list[AuditEntry], int]:
        """Entries newest first (optionally one actor's or one action's) and their count."""
        query = select(AuditRow)
        count = select(func.count()).select_from(AuditRow)
        if actor is not None:
            query, count = (
                query.where(AuditRow.actor == actor),
                count.where(AuditRow.actor == actor),
            )
        if action is not None:
            wanted = action.value
            query, count = (
                query.where(AuditRow.action == wanted),
                count.where(AuditRow.action == wanted),
            )
        query = query.order_by(AuditRow.pk.desc()).limit(limit).offset(offset)
        with self._sessions() as session:
            rows = session.scalars(query).all()
            entries = [
                AuditEntry(r.at, r.actor, Action(r.action), r.target, dict(r.detail)) for r in rows
            ]
            return entries, int(session.scalar(count) or 0)


def submission(config: EvaluationConfig) -> dict[str, Any]:
    """What the trail notes of a submission: the model, tasks, ranks and scheduling."""
    return {
        "model": config.pretrained,
        "tasks": list(config.tasks),
        "ranks": config.parallelism.num_replicas * config.parallelism.shard_size,
        **config.scheduling.model_dump(),
    }
