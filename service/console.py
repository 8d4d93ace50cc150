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
from typing import TextIO

_PROGRESS: list[TextIO] = []


def progress_stream() -> TextIO:
    """The stream rayeval's progress bars write to."""
    return _PROGRESS[-1] if _PROGRESS else sys.stderr


@contextlib.contextmanager
def progress_on(stream: TextIO) -> Iterator[None]:
    """Show rayeval's progress bars on ``stream`` until the block ends."""
    _PROGRESS.append(stream)
    try:
        yield
    finally:
        _PROGRESS.remove(stream)
