"""The schema rayeval wrote before it had migrations: evaluations, events, results, samples.

Revision ID: 0001
Revises:
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the four tables of an evaluation's life."""
    op.create_table(
        "evaluations",
        sa.Column("number", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=False),
        sa.Column("last_event_seq", sa.Integer(), nullable=False),
        sa.Column("runner_cursor", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("number"),
    )
    op.create_index("ix_evaluations_id", "evaluations", ["id"], unique=True)
    op.create_index("ix_evaluations_status", "evaluations", ["status"])
    op.create_table(
        "evaluation_events",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("evaluation_id", sa.String(32), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"]),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("evaluation_id", "seq"),
    )
    op.create_index("ix_evaluation_events_evaluation_id", "evaluation_events", ["evaluation_id"])
    op.create_table(
        "evaluation_results",
        sa.Column("evaluation_id", sa.String(32), nullable=False),
        sa.Column("results_json", sa.Text(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"]),
        sa.PrimaryKeyConstraint("evaluation_id"),
    )
    op.create_table(
        "evaluation_samples",
        sa.Column("evaluation_id", sa.String(32), nullable=False),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("jsonl", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"]),
        sa.PrimaryKeyConstraint("evaluation_id", "task"),
    )


def downgrade() -> None:
    """Drop the four tables."""
    for table in ("evaluation_samples", "evaluation_results", "evaluation_events", "evaluations"):
        op.drop_table(table)
