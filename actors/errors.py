"""The one exception hierarchy of rayeval.

Every error a user can cause derives from :class:`RayEvalError` and its message says what to do.
The classes are plain exceptions with a single string argument, so they pickle across Ray actors;
a message names a configuration field with :func:`field`, so that each door (REST, command line,
Python) words it its own way.
The base class lives in the lowest layer (``actors``) so that every layer can raise and catch it
without breaking the one-way import rule (api -> service -> actors). Errors that only the job
service raises (unknown evaluation, wrong state, not ready) are its own:
:mod:`rayeval.service.vocabulary.errors`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

#: A log record's ``extra`` that keeps it in the log file, off the console (``--verbose`` shows
#: it there too): details behind a line the console already shows, such as a rank's traceback.
LOG_FILE_ONLY = {"rayeval_log_file_only": True}

#: Delimits a configuration field named inside a message (:func:`field`); separates its value.
_MARK, _VALUE = "\x1f", "\x1e"
_FIELD = re.compile(f"{_MARK}([^{_MARK}{_VALUE}]+)(?:{_VALUE}([^{_MARK}]*))?{_MARK}")
_NO_VALUE: Any = object()


def field(*path: str, value: Any = _NO_VALUE) -> str:
    """A configuration field named inside an error message, to be worded by each door.

    The same refusal reaches a REST caller, a command line and a Python caller, and each knows
    the field by another name: ``parallelism.num_replicas`` in a body, ``--num_replicas`` on the
    command line, ``num_replicas=`` in Python. A message names the field by its ``path`` (as a
    REST body nests it) and the door that answers words it
    (:func:`rayeval.service.vocabulary.doors.render`); ``str()`` of an error gives the command
    line's words.

    Args:
        path: The field as the REST body nests it, e.g. ``("parallelism", "num_replicas")``.
        value: A value to suggest for it (JSON-serialisable), e.g. ``"cpu"`` for ``device``.

    Returns:
        A mark to put in the message (an f-string's part).
    """
    suggested = "" if value is _NO_VALUE else _VALUE + json.dumps(value)
    return f"{_MARK}{'.'.join(path)}{suggested}{_MARK}"


def worded(text: str, name: Callable[[tuple[str, ...], str | None], str]) -> str:
    """``text`` with each :func:`field` mark replaced by ``name(path, value)`` (``value``: the
    suggested value as JSON text, or None)."""
    return _FIELD.sub(lambda mark: name(tuple(mark[1].split(".")), mark[2]), text)


def in_flags(text: str) -> str:
    """``text`` with its :func:`field` marks in the command line's words (for a log line)."""
    return worded(text, _flag)


def _flag(path: tuple[str, ...], value: str | None) -> str:
    """The command line's words for a field (``rayeval run`` names most fields ``--{name}``)."""
    if value is None:
        return f"--{path[-1]}"
    plain = json.loads(value)
    return f"--{path[-1]} {json.dumps(plain) if not isinstance(plain, str) else plain}"


class RayEvalError(Exception):
    """Base class of every rayeval error; the message names the fix.

    A message may name configuration fields with :func:`field`: ``str()`` words them as the
    command line does, :attr:`marked_message` keeps the marks for a door to word them.
    """

    #: The traceback of what raised it where that is not this process's own (a rank's, as Ray
    #: wrote it), for the log file and REST's events; None: the exception's own traceback.
    traceback: str | None = None

    @property
    def marked_message(self) -> str:
        """The message with its :func:`field` marks (to fold into another error's message)."""
        return super().__str__()

    def __str__(self) -> str:
        return worded(super().__str__(), _flag)


class ConfigError(RayEvalError):
    """Bad user input: unknown option, unsupported model argument, malformed value."""


class CheckpointError(ConfigError):
    """A training checkpoint cannot be used: incomplete, unreadable, or not of this model."""


class LayoutError(RayEvalError):
    """The requested parallel layout is impossible (R or G < 1, or larger than the cluster)."""


class ResourcesUnavailableError(LayoutError):
    """The cluster could not provide the layout's resources within the placement timeout."""


class ModelLoadError(RayEvalError):
    """A rank could not load the model (missing path, unsupported checkpoint, out of memory)."""


class EvaluationTimeoutError(RayEvalError):
    """A wait ran past its timeout: no batch finished, or a process group did not form."""


class WorkerLostError(RayEvalError):
    """Every replica was lost (actor died, node lost); the evaluation cannot continue."""


class ResultIntegrityError(RayEvalError):
    """A request id came back missing or more than once (a bug: please report it)."""
