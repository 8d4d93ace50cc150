"""Watching a training run: evaluate each checkpoint that appears under its directory once its
save is complete, on one engine, until stopped.

Each poll lists the run directory's checkpoints (:func:`rayeval.actors.weights.checkpoint_dirs.
candidates`), oldest step first. A checkpoint still being written (a DCP directory without its
``.metadata``, a safetensors file shorter than its header says, an index naming a file not yet
there) is left for a later poll; a complete one not handled yet is skipped if it was evaluated
before with the same settings (its results file under the output path, or its fingerprint in the
response cache), else evaluated (:class:`rayeval.service.engine.sweep.Sweep`: the ranks start at
the first one and swap weights for the next). A checkpoint that does not fit the model is
recorded as refused and not retried. The loop sleeps between polls for a bounded interval (asking
``should_stop`` every second meanwhile) and ends after ``max_checkpoints`` evaluations, when
``should_stop`` says so, or on Ctrl-C (``KeyboardInterrupt`` reaches the caller, the engine
released).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rayeval.actors.errors import ConfigError
from rayeval.actors.weights.checkpoint_dirs import candidates, label_of
from rayeval.service.engine.sweep import Sweep
from rayeval.service.engine.sweep_summary import CheckpointRecord, SweepSummary
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.config_groups import MAX_POLL_S, MIN_POLL_S
from rayeval.service.vocabulary.events import OnWarning, Progress

logger = logging.getLogger(__name__)

#: Longest sleep between two questions to ``should_stop`` while waiting for the next poll.
STOP_CHECK_S = 1.0


@dataclass(frozen=True)
class WatchOptions:
    """How a watch polls and when it stops.

    Args:
        poll_s: Seconds between two looks at the directory.
        max_checkpoints: Stop after evaluating this many (None: until stopped).
        timeout_s: Stop after this many seconds without a new evaluation (None: never).

    Raises:
        ConfigError: a bound out of range.
    """

    poll_s: float = 30.0
    max_checkpoints: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not MIN_POLL_S <= self.poll_s <= MAX_POLL_S:
            raise ConfigError(
                f"--poll_interval must be between {MIN_POLL_S:g} and {MAX_POLL_S:g} seconds, "
                f"got {self.poll_s:g}"
            )
        if self.max_checkpoints is not None and self.max_checkpoints < 1:
            raise ConfigError(f"--max_checkpoints must be at least 1, got {self.max_checkpoints}")


def watch(
    root: str | Path,
    config: EvaluationConfig,
    host: HostOptions,
    options: WatchOptions,
    on_checkpoint: Callable[[CheckpointRecord], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    on_progress: Callable[[Progress], None] | None = None,
    on_warning: OnWarning | None = None,
) -> SweepSummary:
    """Evaluate each new, complete checkpoint under ``root`` until stopped (module docstring).

    Args:
        root: The training run's checkpoint directory.
        config: The evaluation (``pretrained`` names the config and tokenizer).
        host: Where it runs and writes (``output_path``: a directory).
        options: Polling and stopping.
        on_checkpoint: Called with each checkpoint's record (evaluated, skipped or refused).
        should_stop: Asked between polls (and every second while waiting); True ends the watch.
        on_progress: Called after every finished step.
        on_warning: Called when a task has requests whose tokens do not measure it.

    Returns:
        The summary of what this watch evaluated, skipped and refused.

    Raises:
        ConfigError: ``root`` is not a directory, or the evaluation's options are bad.
        RayEvalError: the engine failed (what was evaluated is in the summary file).
    """
    candidates(root)  # a missing directory is an error at once, not a silent wait
    handled: set[Path] = set()
    waiting: set[Path] = set()
    evaluated = 0
    idle_since = time.monotonic()
    with Sweep(config, host, on_progress=on_progress, on_warning=on_warning) as sweep:
        while not should_stop():
            for found in candidates(root):
                if found.path in handled:
                    continue
                if not found.complete:
                    if found.path not in waiting:
                        logger.info("waiting for %s: %s", found.path, found.problem)
                        waiting.add(found.path)
                    continue
                handled.add(found.path)
                record = _handle(sweep, found.path)
                if on_checkpoint is not None:
                    on_checkpoint(record)
                if record.status == "succeeded":
                    evaluated += 1
                    idle_since = time.monotonic()
                if options.max_checkpoints is not None and evaluated >= options.max_checkpoints:
                    return sweep.summary
                if should_stop():
                    return sweep.summary
            if options.timeout_s is not None and time.monotonic() - idle_since > options.timeout_s:
                logger.info("no new checkpoint under %s for %gs: stopping", root, options.timeout_s)
                return sweep.summary
            _sleep(options.poll_s, should_stop)
        return sweep.summary


def _sleep(seconds: float, should_stop: Callable[[], bool]) -> None:
    """Sleep ``seconds``, asking ``should_stop`` at least every :data:`STOP_CHECK_S`."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(left, STOP_CHECK_S))
        if should_stop():
            return


def _handle(sweep: Sweep, path: Path) -> CheckpointRecord:
    """Evaluate one complete checkpoint, or record it as skipped if it was evaluated before."""
    label = label_of(path)
    if sweep.done_before(path, label):
        logger.info("%s was evaluated before with these settings: skipped", path)
        return sweep.skipped(path, label)
    return sweep.evaluate(path, label)
