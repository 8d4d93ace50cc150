"""Checkpoint sweeps and watches run by the service: one row per checkpoint of an evaluation.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the checkpoints table."""
    op.create_table(
        "evaluation_checkpoints",
        sa.Column("evaluation_id", sa.String(32), nullable=False),
        sa.Column("label", sa.String(255), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("results_json", sa.Text(), nullable=True),
        sa.Column("samples", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"]),
        sa.PrimaryKeyConstraint("evaluation_id", "label"),
    )


def downgrade() -> None:
    """Drop what :func:`upgrade` added."""
    op.drop_table("evaluation_checkpoints")
