"""The console of ``rayeval run`` and ``rayeval serve --demo``: rayeval's lines on it, the rest in a
log file.

On the console: rayeval's own log lines (``HH:MM:SS message``), its progress bars (one per request
type) and what the command prints (lm-eval's results table, the demo's lines). In a log file under
``.rayeval/logs/`` (its path said first; ``$RAYEVAL_LOG_DIR`` moves it): everything else the
process prints or logs — lm-eval's and the other libraries' log lines and progress bars, dataset
generation, Python warnings, Ray's own messages, and the output of Ray's workers that Ray forwards
to this driver (``log_to_driver``: the ``(EvaluationRunner pid=...)`` and ``(ShardWorker ...)``
lines). ``--verbose`` keeps everything on the console, as a plain logging setup does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from rayeval.actors.errors import LOG_FILE_ONLY
from rayeval.service.console import progress_on

#: The format of every log line in the log file, and on the console with ``--verbose``.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Log files kept per command (older ones are removed when a new one starts).
KEEP_LOG_FILES = 20


@dataclass(frozen=True)
class Console:
    """Where a command's own output goes.

    Attributes:
        out: What the command prints (results).
        err: Its messages (errors, the demo's lines).
        log_file: Where everything else goes (None: on the console too, ``--verbose``).
    """

    out: TextIO
    err: TextIO
    log_file: Path | None


def basic_logging() -> None:
    """Every log line on standard error (the commands without a clean console, ``--verbose``),
    but not the HTTP client's line per request (a client command makes many)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def default_log_dir() -> Path:
    """``$RAYEVAL_LOG_DIR``, else ``.rayeval/logs`` under the current directory."""
    return Path(os.environ.get("RAYEVAL_LOG_DIR") or Path(".rayeval") / "logs")


@contextlib.contextmanager
def console(command: str, verbose: bool, product_level: int = logging.INFO) -> Iterator[Console]:
    """For the block: rayeval's lines on the console, everything else in a new log file.

    Args:
        command: Names the log file (``run-<date>-<pid>.log``) and the first line.
        verbose: Keep everything on the console instead (no log file).
        product_level: The lowest level of rayeval's log lines shown on the console.

    Yields:
        Where the command's own output goes.
    """
    if verbose:
        basic_logging()
        yield Console(sys.stdout, sys.stderr, None)
        return
    path = _new_log_file(default_log_dir(), command)
    with (
        path.open("a", encoding="utf-8", buffering=1) as log,
        _descriptors_to(log) as (out, err),
        _routed(out, err, log, product_level),
    ):
        print(
            f"rayeval {command}: logs of lm-eval, Ray's workers and other libraries go to "
            f"{_shown(path)} (--verbose shows them here)",
            file=err,
            flush=True,
        )
        yield Console(out, err, path)


@contextlib.contextmanager
def _descriptors_to(log: TextIO) -> Iterator[tuple[TextIO, TextIO]]:
    """Descriptors 1 and 2 (where child processes and native code write: Ray's, git's) to
    ``log``. Yields the console's streams: ``sys.stdout`` and ``sys.stderr``, re-opened on copies
    of the descriptors they wrote to when they are the process's own (not, say, a test's
    capture)."""
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    consoles = [_reopened(stream, saved) for stream in streams]
    try:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        yield consoles[0], consoles[1]
    finally:
        for console_stream, stream in zip(consoles, streams, strict=True):
            console_stream.flush()
            if console_stream is not stream:
                console_stream.close()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def _reopened(stream: TextIO, saved: dict[int, int]) -> TextIO:
    """``stream`` on its own copy of the descriptor it writes to, if that is 1 or 2."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return stream
    if fd not in saved:
        return stream
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return open(os.dup(saved[fd]), "w", encoding=encoding, errors="replace", buffering=1)


@contextlib.contextmanager
def _routed(out: TextIO, err: TextIO, log: TextIO, product_level: int) -> Iterator[None]:
    """Standard output and error, and every log handler writing to them, to ``log``; a console
    handler for rayeval's loggers; rayeval's progress bars on ``err``."""
    previous = (sys.stdout, sys.stderr)
    root = logging.getLogger()
    to_file = logging.StreamHandler(log)
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    to_console = logging.StreamHandler(err)
    to_console.setLevel(product_level)
    to_console.addFilter(_is_rayeval)
    to_console.setFormatter(_ProductFormatter())
    # Handlers made before now (Ray's, transformers') hold the console streams themselves.
    moved = [(handler, handler.setStream(log)) for handler in _console_handlers(*previous)]
    level = root.level
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    sys.stdout = sys.stderr = log
    try:
        with progress_on(err):
            yield
    finally:
        sys.stdout, sys.stderr = previous
        logging.captureWarnings(False)
        root.removeHandler(to_file)
        root.removeHandler(to_console)
        root.setLevel(level)
        for handler, stream in moved:
            if stream is not None:
                handler.setStream(stream)


def _console_handlers(out: TextIO, err: TextIO) -> list[logging.StreamHandler[TextIO]]:
    """Every stream handler of every logger that writes to the console."""
    streams = {id(s) for s in (out, err, sys.__stdout__, sys.__stderr__) if s is not None}
    known = logging.root.manager.loggerDict.values()
    loggers = [logging.getLogger()] + [item for item in known if isinstance(item, logging.Logger)]
    return [
        handler
        for logger in loggers
        for handler in logger.handlers
        if type(handler) is logging.StreamHandler and id(handler.stream) in streams
    ]


def _is_rayeval(record: logging.LogRecord) -> bool:
    """rayeval's own lines, less the details kept for the log file (``LOG_FILE_ONLY``)."""
    if any(getattr(record, key, False) for key in LOG_FILE_ONLY):
        return False
    return record.name == "rayeval" or record.name.startswith("rayeval.")


class _ProductFormatter(logging.Formatter):
    """``HH:MM:SS message``; a warning or error says so."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            stamp, _, message = text.partition(" ")
            return f"{stamp} {record.levelname}: {message}"
        return text


def _new_log_file(folder: Path, command: str) -> Path:
    """A new log file for ``command`` in ``folder``; the oldest beyond the last
    :data:`KEEP_LOG_FILES` are removed."""
    folder.mkdir(parents=True, exist_ok=True)
    old = sorted(folder.glob(f"{command}-*.log"), key=lambda p: p.stat().st_mtime)
    for stale in old[: max(0, len(old) - KEEP_LOG_FILES + 1)]:
        with contextlib.suppress(OSError):
            stale.unlink()
    return folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
