"""Schema migrations of the service's database (Alembic), run by every process that opens it.

:func:`upgrade` brings a database to the newest schema: an empty one is created, one written by
an older rayeval is changed in place without losing a row. Revisions live in ``versions/`` (one
file each, applied in order); the first, ``0001``, is the schema rayeval wrote before it had
migrations, so a database from then (tables but no ``alembic_version``) is stamped ``0001`` first
and upgraded from there. A new revision: change :mod:`rayeval.service.jobs.rows`, then add a
file to ``versions/`` (``alembic revision`` with this folder as ``script_location`` writes one
from ``script.py.mako``); ``tests/test_store.py`` fails while the models and the migrated schema
differ. No torch here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine

if TYPE_CHECKING:
    from alembic.config import Config

#: The revision that is the schema written before migrations existed.
BASELINE = "0001"
_HERE = Path(__file__).resolve().parent

logger = logging.getLogger(__name__)
# Alembic says at INFO what every process that opens the database does; only news is worth a line.
logging.getLogger("alembic").setLevel(logging.WARNING)


def upgrade(engine: Engine) -> None:
    """Bring the database of ``engine`` to the newest schema (idempotent).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database is unreachable or refuses a change.
    """
    from alembic import command

    with engine.begin() as connection:
        config = _config(connection)
        tables = set(inspect(connection).get_table_names())
        if "evaluations" in tables and "alembic_version" not in tables:
            logger.info("stamping a database written before migrations as revision %s", BASELINE)
            command.stamp(config, BASELINE)
        command.upgrade(config, "head")


def current(engine: Engine) -> str | None:
    """The database's revision (None: not migrated yet)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head() -> str:
    """The newest revision this rayeval knows."""
    from alembic.script import ScriptDirectory

    head_revision = ScriptDirectory.from_config(_config(None)).get_current_head()
    assert head_revision is not None
    return head_revision


def _config(connection: Connection | None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_HERE))
    config.attributes["connection"] = connection
    return config
