"""The runner actor: one evaluation carried from start to results inside the Ray cluster.

:class:`EvaluationRunner` is a plain class; the service applies ``ray.remote`` where it creates it,
as a named, detached actor (so it outlives an API restart and can be re-attached). Its constructor
starts :func:`rayeval.service.engine.runner.run_evaluation` (a checkpoint sweep or watch:
:func:`rayeval.service.jobs.sweep_runner.run_service_sweep`) in a background thread and returns at
once (later ones start with :meth:`EvaluationRunner.start_next`, on ranks kept loaded); the
service polls :meth:`EvaluationRunner.events_since`, whose last event carries the outputs when the
run succeeded (so nobody waits on a second call for them). lm-eval writes its result and sample
files into a private temporary directory and the runner hands those files back verbatim, so what
the API serves is exactly what ``lm_eval --output_path ... --log_samples`` writes.

This module imports nothing heavy at module level: torch is imported by the background thread,
inside the actor process only.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from rayeval.actors.errors import RayEvalError
from rayeval.actors.process import runner_environment
from rayeval.service.engine.dispatch.warm import KeptReplicas
from rayeval.service.jobs.failures import explain
from rayeval.service.jobs.ray_resources import group_name, runner_name
from rayeval.service.jobs.sweep_runner import SweepReports, run_service_sweep
from rayeval.service.trackers import Trackers
from rayeval.service.vocabulary.config import CodeExecution, EvaluationConfig, HostOptions
from rayeval.service.vocabulary.doors import Door, render
from rayeval.service.vocabulary.events import (
    CheckpointOutputs,
    Progress,
    ReplicaReuse,
    RequestWarning,
    RunnerCheckpoint,
    RunnerEvent,
    RunnerFailed,
    RunnerProgress,
    RunnerStage,
    RunnerStatus,
    RunnerSucceeded,
    RunnerWaiting,
    RunnerWarning,
    RunOutputs,
    Stage,
    TrackerWarning,
)

logger = logging.getLogger(__name__)

#: A runner's scratch folder for lm-eval's files, ``rayeval-<evaluation>-p<pid>-<random>`` in its
#: node's temporary directory: the pid lets the next runner on the node remove the folders of
#: runners killed before they could (``ray.kill``, a node lost; issue 41's chaos soak found them).
_SCRATCH = re.compile(r"rayeval-[0-9a-f]+-p(?P<pid>\d+)-")


class EvaluationRunner:
    """Runs evaluations in a background thread and records what happens as events.

    The first evaluation starts at construction; it names the runner, its placement group and
    its rank actors (:func:`runner_name`, :func:`group_name`). With ``keep_replicas``, a runner
    whose evaluation succeeded keeps its loaded ranks and can run the next evaluation of the same
    model and layout (:meth:`start_next`): the service's warm replicas.

    Args:
        evaluation_id: The service's id; names the placement group ``rayeval-<id>``.
        config: ``EvaluationConfig.to_json()`` of the evaluation (device already resolved).
        include_paths: The server's task directories (must exist on this node too).
        response_cache: Path prefix of the response cache (``--use_cache``'s; None: none).
        keep_replicas: Keep the loaded ranks after a successful evaluation.
        trackers: ``Trackers.to_json()`` of the server's experiment trackers (None: none).
    """

    def __init__(
        self,
        evaluation_id: str,
        config: dict[str, Any],
        include_paths: list[str],
        response_cache: str | None = None,
        keep_replicas: bool = False,
        trackers: dict[str, Any] | None = None,
        rank_niceness: int | None = None,
        code_execution: bool = False,
    ) -> None:
        self.owner_id = evaluation_id
        self._rank_niceness = rank_niceness
        self._code_execution = CodeExecution.SANDBOX if code_execution else CodeExecution.OFF
        self._include_paths = tuple(include_paths)
        self._response_cache = response_cache
        self._trackers = Trackers(**(trackers or {}))
        self._replicas = KeptReplicas(keep=keep_replicas)
        self._lock = threading.Lock()
        self._events: dict[str, list[RunnerEvent]] = {}
        self._delivered: dict[str, int] = {}  # per evaluation: events whose files are dropped
        self._current = evaluation_id
        self._thread: threading.Thread | None = None
        self._start(evaluation_id, EvaluationConfig.from_json(config))

    # ------------------------------------------------------------------ called by the API
    def events_since(self, seq: int, evaluation_id: str | None = None) -> list[RunnerEvent]:
        """Events of an evaluation (default: the current one) numbered above ``seq``.

        Numbers start at 1. The last one is :class:`RunnerSucceeded`, carrying the run's outputs
        (lm-eval's files verbatim, throughput per request type, whether its ranks are kept), or
        :class:`RunnerFailed`.
        """
        with self._lock:
            key = evaluation_id or self._current
            events = self._events.get(key, [])
            self._delivered[key] = _drop_delivered_files(events, self._delivered.get(key, 0), seq)
            return events[seq:]

    def start_next(self, evaluation_id: str, config: dict[str, Any]) -> bool:
        """Run another evaluation on the kept ranks.

        Returns:
            False when it cannot: an evaluation is still running, no ranks are kept, or they
            were loaded for another model or layout.
        """
        from rayeval.service.engine.dispatch.warm import replica_key

        parsed = EvaluationConfig.from_json(config)
        previous = self._thread
        if previous is not None:  # its final event is out; it may still be cleaning up
            # A third of the caller's wait for this call: the answer reaches it in time.
            previous.join(timeout=parsed.timeouts.control_s / 3)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            if self._replicas.group is None or self._replicas.key != replica_key(parsed):
                return False
        self._start(evaluation_id, parsed)
        return True

    def current(self) -> RunnerStatus:
        """Its latest evaluation, whose names its resources carry, whether it runs, whether
        loaded ranks are held."""
        with self._lock:
            return RunnerStatus(
                evaluation_id=self._current,
                owner=self.owner_id,
                running=self._thread is not None and self._thread.is_alive(),
                kept=self._replicas.group is not None,
            )

    def release_replicas(self) -> None:
        """Shut the kept ranks down (the runner itself is killed by the service)."""
        self._replicas.shutdown()

    # ------------------------------------------------------------------------ the run
    def _start(self, evaluation_id: str, config: EvaluationConfig) -> None:
        with self._lock:
            # The previous evaluation's final event was read before the service chose this
            # runner: its events are not needed any more.
            self._events = {evaluation_id: []}
            self._delivered = {}
            self._current = evaluation_id
            self._thread = threading.Thread(
                target=self._run,
                args=(evaluation_id, config),
                name=f"rayeval-run-{evaluation_id}",
                daemon=True,
            )
        self._thread.start()

    def _emit(self, evaluation_id: str, event_type: type[RunnerEvent], /, **fields: Any) -> None:
        """Record an event of ``event_type`` with ``fields``, numbered next, timed now."""
        with self._lock:
            events = self._events.setdefault(evaluation_id, [])
            events.append(event_type(seq=len(events) + 1, time=time.time(), **fields))

    def _run(self, evaluation_id: str, config: EvaluationConfig) -> None:
        output_dir = scratch_folder(evaluation_id)
        try:
            outputs = self._evaluate(evaluation_id, config, output_dir)
        except RayEvalError as exc:
            kind = type(exc).__name__
            # Read over REST: the fields it names are a body's fields.
            self._emit(evaluation_id, RunnerFailed, error=render(exc, Door.REST), kind=kind,
                       traceback=exc.traceback or traceback.format_exc())  # fmt: skip
        except Exception as exc:  # lm-eval raises plain exceptions for bad task/model setups
            logger.exception("evaluation %s failed", evaluation_id)
            kind = type(exc).__name__
            self._emit(evaluation_id, RunnerFailed, error=explain(exc), kind=kind,
                       traceback=traceback.format_exc())  # fmt: skip
        else:
            self._emit(evaluation_id, RunnerSucceeded, outputs=outputs)
        finally:
            shutil.rmtree(output_dir, ignore_errors=True)

    def _evaluate(
        self, evaluation_id: str, config: EvaluationConfig, output_dir: Path
    ) -> RunOutputs:
        from rayeval.service.engine.runner import run_evaluation
        from rayeval.service.result_files import read_lm_eval_files

        def on_progress(progress: Progress) -> None:
            # Every figure of the engine's Progress: counts, rates, per-replica work, rank memory
            # and start-up figures (/metrics and the dashboard read them from stored progress).
            self._emit(evaluation_id, RunnerProgress, progress=progress)

        def on_warning(warning: RequestWarning | TrackerWarning) -> None:
            self._emit(evaluation_id, RunnerWarning, warning=warning)

        def on_stage(stage: Stage) -> None:
            self._emit(evaluation_id, RunnerStage, stage=stage)

        host = HostOptions(
            output_path=str(output_dir),
            include_paths=self._include_paths,
            name=group_name(self.owner_id),
            lm_eval={"use_cache": self._response_cache} if self._response_cache else {},
            trackers=replace(self._trackers, evaluation_id=evaluation_id),
            rank_niceness=self._rank_niceness,
            # Submission refused code tasks unless the operator allows code execution; what
            # was accepted runs its code in the sandbox, never in the server's processes, and
            # not at all where the operator has turned code execution off since.
            code_execution=self._code_execution,
        )
        if config.sweep is not None:
            reports = SweepReports(
                on_checkpoint=lambda outputs: self._emit(
                    evaluation_id, RunnerCheckpoint, outputs=outputs
                ),
                on_waiting=lambda: self._emit(evaluation_id, RunnerWaiting),
                on_progress=on_progress,
                on_warning=on_warning,
            )
            return run_service_sweep(config, host, reports)
        output = run_evaluation(
            config,
            host,
            on_progress=on_progress,
            on_warning=on_warning,
            replicas=self._replicas,
            on_stage=on_stage,
        )
        if output is None:
            raise RayEvalError("lm-eval returned no results for this evaluation")
        results_json, samples = read_lm_eval_files(output_dir)
        replicas = ReplicaReuse(reused=self._replicas.reused, kept=self._replicas.group is not None)
        return RunOutputs(
            results_json=results_json, samples=samples, stats=output.stats, replicas=replicas
        )


def scratch_folder(evaluation_id: str) -> Path:
    """A new scratch folder for the evaluation, after removing those of dead runners here."""
    sweep_scratch_folders(Path(tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"rayeval-{evaluation_id}-p{os.getpid()}-"))


def sweep_scratch_folders(root: Path) -> list[Path]:
    """Remove the scratch folders under ``root`` whose runner process is gone; those removed."""
    removed = []
    for path in root.glob("rayeval-*-p*-*"):
        match = _SCRATCH.match(path.name)
        if match and not _process_alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d scratch folders of runners that were killed", len(removed))
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _drop_delivered_files(events: list[RunnerEvent], done: int, seq: int) -> int:
    """Forget the lm-eval files of checkpoint events numbered ``done + 1`` to ``seq``: the
    service stored them with its cursor ``seq`` (a watch that runs for days holds no copy of what
    it delivered). Returns the new ``done``."""
    upto = min(seq, len(events))
    for index in range(done, upto):
        event = events[index]
        if isinstance(event, RunnerCheckpoint):
            outputs = CheckpointOutputs(record=event.outputs.record, results_json=None)
            events[index] = event.model_copy(update={"outputs": outputs})
    return max(done, upto)


def launch_runner(
    evaluation_id: str,
    config: dict[str, Any],
    namespace: str,
    include_paths: list[str],
    response_cache: str | None,
    keep_replicas: bool,
    trackers: Trackers | None = None,
    rank_niceness: int | None = None,
    code_execution: bool = False,
) -> Any:
    """Start the named, detached runner actor of an evaluation (its first evaluation starts).

    Args:
        evaluation_id: Names the runner (:func:`runner_name`) and what it creates.
        config: ``EvaluationConfig.to_json()`` (device resolved).
        namespace: The service's Ray namespace (where a restarted API looks for runners).
        include_paths: The server's task directories.
        response_cache: Path prefix of the response cache (None: none).
        keep_replicas: Keep the loaded ranks after a successful evaluation.
        trackers: The server's experiment trackers (None: none).
        rank_niceness: The OS niceness of the evaluation's rank processes (None: Ray's
            default); the runner itself, the evaluation's driver, runs at the node's default.
        code_execution: Whether the operator allows code execution (code tasks' candidates
            run in the sandbox); off, a code task fails before any rank starts.

    Returns:
        The actor's handle.
    """
    return (
        ray.remote(EvaluationRunner)
        .options(
            name=runner_name(evaluation_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            runtime_env={"env_vars": runner_environment()},
        )
        .remote(
            evaluation_id,
            config,
            include_paths,
            response_cache,
            keep_replicas,
            trackers.to_json() if trackers is not None else None,
            rank_niceness,
            code_execution,
        )
    )
