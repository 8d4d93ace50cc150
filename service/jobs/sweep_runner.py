"""A sweep or watch inside the runner actor: the engine's loop over checkpoints
(:func:`rayeval.service.engine.sweep.run_sweep`, :func:`rayeval.service.engine.watch.watch`) with
each checkpoint's outcome and lm-eval files reported to the service as it ends.

The checkpoints of a ``sweep.checkpoints`` list were expanded and checked against the server's
model roots at submission; the engine checks each against the model before any rank starts (a
list) or as it is found (a watch: one that does not fit is recorded as refused). Each checkpoint's
files are read from the run's private output directory, handed to the service
(:class:`rayeval.service.vocabulary.events.RunnerCheckpoint`) and removed, so a watch that runs for
days holds one checkpoint's files at a time. The run's own result is the sweep summary
(``kind: rayeval-sweep``). A watch reports that it is alive while it waits
(:class:`rayeval.service.vocabulary.events.RunnerWaiting`, at most every :data:`WAITING_EVERY_S`),
so the service's stall watchdog tells a quiet directory from a hung runner. Imports torch (through
the engine) only when called.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.events import (
    CheckpointOutputs,
    OnWarning,
    Progress,
    ReplicaReuse,
    RunOutputs,
)

#: Longest a waiting watch stays silent.
WAITING_EVERY_S = 10.0


class SweepReports:
    """What the runner hands a sweep: where to report checkpoints, progress and warnings.

    Args:
        on_checkpoint: Called with each checkpoint's outputs as it ends.
        on_waiting: Called while a watch waits (throttled here to every WAITING_EVERY_S).
        on_progress: Called after every finished step.
        on_warning: Called with a task's request warning or a tracker's failure.
    """

    def __init__(
        self,
        on_checkpoint: Callable[[CheckpointOutputs], None],
        on_waiting: Callable[[], None],
        on_progress: Callable[[Progress], None],
        on_warning: OnWarning,
    ) -> None:
        self.on_checkpoint = on_checkpoint
        self.on_progress = on_progress
        self.on_warning = on_warning
        self._on_waiting = on_waiting
        self._said_at = time.monotonic()

    def waiting(self) -> bool:
        """The watch's ``should_stop``: says it is alive now and then; never asks it to stop
        (the service cancels a watch by ending its runner)."""
        if time.monotonic() - self._said_at >= WAITING_EVERY_S:
            self._said_at = time.monotonic()
            self._on_waiting()
        return False


def run_service_sweep(
    config: EvaluationConfig, host: HostOptions, reports: SweepReports
) -> RunOutputs:
    """Run the evaluation's sweep or watch; every checkpoint is reported as it ends.

    Args:
        config: The evaluation (``config.sweep`` set; checkpoint paths already expanded).
        host: Where it runs; ``output_path`` is the run's private directory.
        reports: Where its checkpoints, progress and warnings go.

    Returns:
        The run's outputs: the sweep summary as the results file, no samples, the figures
        summed over its checkpoints.

    Raises:
        RayEvalError: a checkpoint that does not fit the model (a list: before any rank
            starts), or the engine failed; checkpoints that ended before were reported.
    """
    from rayeval.service.engine.sweep import run_sweep
    from rayeval.service.engine.sweep_summary import total_stats
    from rayeval.service.engine.watch import WatchOptions, watch

    spec = config.sweep
    assert spec is not None and host.output_path is not None
    engine_config = config.model_copy(update={"sweep": None})
    out = Path(host.output_path)

    def on_checkpoint(record: Any) -> None:
        reports.on_checkpoint(checkpoint_outputs(record, out))

    if spec.checkpoints is not None:
        summary = run_sweep(
            engine_config,
            host,
            spec.checkpoints,
            on_checkpoint=on_checkpoint,
            on_progress=reports.on_progress,
            on_warning=reports.on_warning,
        )
    else:
        assert spec.watch is not None
        options = WatchOptions(spec.poll_s, spec.max_checkpoints, spec.timeout_s)
        summary = watch(
            spec.watch,
            engine_config,
            host,
            options,
            on_checkpoint=on_checkpoint,
            should_stop=reports.waiting,
            on_progress=reports.on_progress,
            on_warning=reports.on_warning,
        )
    summary_json = json.dumps(summary.to_json(), indent=2, default=str)
    stats = total_stats(summary.checkpoints)
    return RunOutputs(results_json=summary_json, samples={}, stats=stats, replicas=ReplicaReuse())


def checkpoint_outputs(record: Any, output_dir: Path) -> CheckpointOutputs:
    """A checkpoint's record with lm-eval's files of it, read from (and then removed from) its
    directory under the run's output directory."""
    from dataclasses import asdict

    from rayeval.service.result_files import read_lm_eval_files

    # Its results file is served at a link (the run's private directory is gone by then).
    data = json.loads(json.dumps({**asdict(record), "results_file": None}, default=str))
    directory = output_dir / record.label
    if record.status != "succeeded" or not directory.is_dir():
        return CheckpointOutputs(record=data, results_json=None)
    results_json, samples = read_lm_eval_files(directory)
    shutil.rmtree(directory, ignore_errors=True)
    return CheckpointOutputs(record=data, results_json=results_json, samples=samples)
