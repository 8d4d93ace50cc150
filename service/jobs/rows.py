"""The service's database tables (SQLAlchemy), and the engine that reaches them.

Eight tables: ``evaluations`` (owner, config, status, timestamps, error, progress, event counter,
runner cursor), ``evaluation_events`` (each evaluation's numbered stream), ``evaluation_results``
(lm-eval's results file and rayeval's figures, once), ``evaluation_samples`` (lm-eval's samples
files, per task), ``evaluation_checkpoints`` (a sweep's checkpoints: record, results, samples),
``users`` (role, fair-share weight, rank cap), ``api_keys`` (a hash per key,
never the key) and ``audit_events`` (who did what, when). Only the store
(:mod:`rayeval.service.jobs.store`, :mod:`rayeval.service.jobs.accounts`,
:mod:`rayeval.service.jobs.audit`) reads and writes them; their schema changes only through a
migration (:mod:`rayeval.service.jobs.migrations`). No torch here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: The user every request acts as on a server without keys, and the ``--api-token``'s holder: an
#: admin no ``rayeval users add`` can create. Evaluations stored before owners existed are its.
BUILTIN_ADMIN = "admin"


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
    # Who submitted it (a user's name; rows from before users existed: the built-in admin).
    owner: Mapped[str] = mapped_column(String(64), index=True, server_default=BUILTIN_ADMIN)
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


class CheckpointRow(Base):
    """One checkpoint of a sweep or watch: its record (step, outcome, metrics, timings), and its
    results and samples files (lm-eval's, verbatim; none unless it succeeded)."""

    __tablename__ = "evaluation_checkpoints"

    evaluation_id: Mapped[str] = mapped_column(ForeignKey("evaluations.id"), primary_key=True)
    label: Mapped[str] = mapped_column(String(255), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)
    results_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    samples: Mapped[dict[str, str]] = mapped_column(JSON)


class UserRow(Base):
    """One user: a role, a weight in the fair share of the queue, a cap on ranks held at once."""

    __tablename__ = "users"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_ranks: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ApiKeyRow(Base):
    """One API key of a user: its public id and a digest of its secret (never the key)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    user_name: Mapped[str] = mapped_column(ForeignKey("users.name"), index=True)
    hash: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class AuditRow(Base):
    """One entry of the audit trail: who did what to which evaluation, user or key, and when."""

    __tablename__ = "audit_events"

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    actor: Mapped[str] = mapped_column(String(64), index=True)
    action: Mapped[str] = mapped_column(String(32), index=True)
    target: Mapped[str] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


def make_engine(url: str) -> Engine:
    """The engine of ``url``; SQLite files are shared by threads and written in WAL mode.

    A plain ``postgresql://`` URL is served by psycopg 3 (the driver rayeval installs). Every
    connection taken from the pool is checked first (``pool_pre_ping``), so a database server that
    restarted costs a reconnect, not an error, once it is back.
    """
    if not url.startswith("sqlite"):
        parsed = make_url(url)
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        connect_args = {"connect_timeout": 10} if parsed.drivername.startswith("postgres") else {}
        # The API's request threads, the manager and the view renderer share the pool.
        return create_engine(
            parsed, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=connect_args
        )
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
