"""The service's database tables (SQLAlchemy), and the engine that reaches them.

Four tables: ``evaluations`` (config, status, timestamps, error, progress, event counter, runner
cursor), ``evaluation_events`` (each evaluation's numbered stream), ``evaluation_results``
(lm-eval's results file and rayeval's figures, once) and ``evaluation_samples`` (lm-eval's samples
files, per task). Only :mod:`rayeval.service.jobs.store` reads and writes them. No torch here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    """The tables' metadata."""


class EvaluationRow(Base):
    """One evaluation: its config, state, timestamps, progress and counters."""

    __tablename__ = "evaluations"

    # ``number`` orders evaluations (FIFO admission, newest-first listing); ``id`` is public.
    number: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    # The column keeps its first name ("spec") so that databases written before stay readable.
    config: Mapped[dict[str, Any]] = mapped_column("spec", JSON)
    resources: Mapped[dict[str, float]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    progress: Mapped[dict[str, Any]] = mapped_column(JSON)
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0)
    runner_cursor: Mapped[int] = mapped_column(Integer, default=0)


class EventRow(Base):
    """One event of an evaluation's stream, numbered from 1 per evaluation."""

    __tablename__ = "evaluation_events"
    __table_args__ = (UniqueConstraint("evaluation_id", "seq"),)

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    evaluation_id: Mapped[str] = mapped_column(ForeignKey("evaluations.id"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ResultRow(Base):
    """lm-eval's results file of a succeeded evaluation, and rayeval's figures."""

    __tablename__ = "evaluation_results"

    evaluation_id: Mapped[str] = mapped_column(ForeignKey("evaluations.id"), primary_key=True)
    results_json: Mapped[str] = mapped_column(Text)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON)


class SamplesRow(Base):
    """One task's samples file (lm-eval's JSONL) of a succeeded evaluation."""

    __tablename__ = "evaluation_samples"

    evaluation_id: Mapped[str] = mapped_column(ForeignKey("evaluations.id"), primary_key=True)
    task: Mapped[str] = mapped_column(String(255), primary_key=True)
    jsonl: Mapped[str] = mapped_column(Text)


def make_engine(url: str) -> Engine:
    """The engine of ``url``; SQLite files are shared by threads and written in WAL mode."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    # The API's request threads and the manager thread share the file: allow cross-thread use,
    # wait for a writer instead of failing at once, and let readers proceed during writes (WAL).
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine
