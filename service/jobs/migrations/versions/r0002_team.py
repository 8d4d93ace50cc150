"""A service a team shares: users, API keys (hashes), an audit trail, an owner per evaluation.

Evaluations stored before have the built-in admin as owner (the server's ``--api-token``).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add users, keys, the audit trail, and each evaluation's owner."""
    op.create_table(
        "users",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("max_ranks", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("user_name", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["user_name"], ["users.name"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_api_keys_user_name", "api_keys", ["user_name"])
    op.create_table(
        "audit_events",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(64), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("pk"),
    )
    for column in ("at", "actor", "action"):
        op.create_index(f"ix_audit_events_{column}", "audit_events", [column])
    with op.batch_alter_table("evaluations") as table:
        table.add_column(sa.Column("owner", sa.String(64), nullable=False, server_default="admin"))
        table.create_index("ix_evaluations_owner", ["owner"])


def downgrade() -> None:
    """Drop what :func:`upgrade` added."""
    with op.batch_alter_table("evaluations") as table:
        table.drop_index("ix_evaluations_owner")
        table.drop_column("owner")
    for table_name in ("audit_events", "api_keys", "users"):
        op.drop_table(table_name)
