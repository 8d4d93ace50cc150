"""Where rayeval's own progress display goes.

``rayeval run`` may send what other libraries print, and what Ray's workers print, to a log file
(:mod:`rayeval.api.cli.console`); rayeval's progress bars must still reach the person at the
terminal. :func:`progress_stream` is that stream: the one set by :func:`progress_on` for the
length of a command, else the standard error stream of the moment (a runner actor's, whose output
is Ray's worker log). No torch here.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

_PROGRESS: list[TextIO] = []


#: Seconds between two redraws of a progress bar, or two progress lines, on a stream that is not
#: a terminal (a log file, a pipe, a Ray job's or worker's log): each redraw is a line there.
LINE_INTERVAL_S = 10.0


def progress_stream() -> TextIO:
    """The stream rayeval's progress bars write to."""
    return _PROGRESS[-1] if _PROGRESS else sys.stderr


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (where a bar redraws in place)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def redraw_every_s(stream: Any) -> float:
    """tqdm's ``mininterval`` for a bar on ``stream``: its default on a terminal, else
    :data:`LINE_INTERVAL_S`."""
    return 0.1 if is_terminal(stream) else LINE_INTERVAL_S


@contextlib.contextmanager
def progress_on(stream: TextIO) -> Iterator[None]:
    """Show rayeval's progress bars on ``stream`` until the block ends."""
    _PROGRESS.append(stream)
    try:
        yield
    finally:
        _PROGRESS.remove(stream)
