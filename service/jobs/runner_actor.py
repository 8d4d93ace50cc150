"""The runner actor: one evaluation carried from start to results inside the Ray cluster.

:class:`EvaluationRunner` is a plain class; the service applies ``ray.remote`` where it creates it,
as a named, detached actor (so it outlives an API restart and can be re-attached). Its constructor
starts :func:`service.engine.runner.run_evaluation` in a background thread and returns at once; the
service polls :meth:`EvaluationRunner.events_since`, whose last event carries the outputs when the
run succeeded (so nobody waits on a second call for them). lm-eval writes its result and sample
files into a private temporary directory and the runner hands those files back verbatim, so what
the API serves is exactly what ``lm_eval --output_path ... --log_samples`` writes.

This module imports nothing heavy at module level: torch is imported by the background thread,
inside the actor process only.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from actors.errors import RayEvalError
from service.config import EvaluationConfig, HostOptions
from service.jobs.states import RunnerEventKind

logger = logging.getLogger(__name__)


def runner_name(evaluation_id: str) -> str:
    """Name of the detached runner actor of an evaluation."""
    return f"rayeval-runner-{evaluation_id}"


def group_name(evaluation_id: str) -> str:
    """Name of the evaluation's placement group, and prefix of its rank actors' names."""
    return f"rayeval-{evaluation_id}"


class EvaluationRunner:
    """Runs one evaluation in a background thread and records what happens as events.

    Args:
        evaluation_id: The service's id; names the placement group ``rayeval-<id>``.
        config: ``EvaluationConfig.to_json()`` of the evaluation (device already resolved).
        include_paths: The server's task directories (must exist on this node too).
        response_cache: Path prefix of the response cache (``--use_cache``'s; None: none).
    """

    def __init__(
        self,
        evaluation_id: str,
        config: dict[str, Any],
        include_paths: list[str],
        response_cache: str | None = None,
    ) -> None:
        self.evaluation_id = evaluation_id
        self._config = EvaluationConfig.from_json(config)
        self._include_paths = tuple(include_paths)
        self._response_cache = response_cache
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._thread = threading.Thread(
            target=self._run, name=f"rayeval-run-{evaluation_id}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ polled by the API
    def events_since(self, seq: int) -> list[dict[str, Any]]:
        """Events numbered above ``seq`` (numbers start at 1), each ``{seq, type, data, time}``.

        The ``succeeded`` event's data are the run's outputs: ``results_json`` (lm-eval's
        results file, verbatim), ``samples`` (task -> lm-eval's samples JSONL, verbatim) and
        ``stats`` (throughput per request type).
        """
        with self._lock:
            return self._events[seq:]

    # ------------------------------------------------------------------------ the run
    def _emit(self, kind: RunnerEventKind, data: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(
                {
                    "seq": len(self._events) + 1,
                    "type": kind.value,
                    "data": data,
                    "time": time.time(),
                }
            )

    def _on_progress(self, progress: Any) -> None:
        # Every field of the engine's Progress: counts, rates, per-replica work, rank memory and
        # start-up figures (the service's /metrics and dashboard read them from stored progress).
        self._emit(RunnerEventKind.PROGRESS, dataclasses.asdict(progress))

    def _run(self) -> None:
        output_dir = Path(tempfile.mkdtemp(prefix=f"rayeval-{self.evaluation_id}-"))
        try:
            outputs = self._evaluate(output_dir)
        except RayEvalError as exc:
            self._emit(RunnerEventKind.FAILED, {"error": str(exc), "kind": type(exc).__name__})
        except Exception as exc:  # lm-eval raises plain exceptions for bad task/model setups
            logger.exception("evaluation %s failed", self.evaluation_id)
            kind = type(exc).__name__
            self._emit(RunnerEventKind.FAILED, {"error": f"{kind}: {exc}", "kind": kind})
        else:
            self._emit(RunnerEventKind.SUCCEEDED, outputs)
        finally:
            shutil.rmtree(output_dir, ignore_errors=True)

    def _evaluate(self, output_dir: Path) -> dict[str, Any]:
        from service.engine.runner import run_evaluation

        host = HostOptions(
            output_path=str(output_dir),
            include_paths=self._include_paths,
            name=group_name(self.evaluation_id),
            lm_eval={"use_cache": self._response_cache} if self._response_cache else {},
        )
        output = run_evaluation(
            self._config,
            host,
            on_progress=self._on_progress,
            on_warning=lambda data: self._emit(RunnerEventKind.WARNING, data),
        )
        if output is None:
            raise RayEvalError("lm-eval returned no results for this evaluation")
        return {**_read_lm_eval_files(output_dir), "stats": output.stats}


def _read_lm_eval_files(output_dir: Path) -> dict[str, Any]:
    """The results file and per-task samples files lm-eval wrote under ``output_dir``."""
    import json

    results_files = sorted(output_dir.rglob("results_*.json"))
    if len(results_files) != 1:
        raise RuntimeError(f"expected one lm-eval results file, found {results_files}")
    results_file = results_files[0]
    results_json = results_file.read_text(encoding="utf-8")
    date_id = results_file.stem.removeprefix("results_")
    samples = {}
    for task in json.loads(results_json).get("configs", {}):
        # The exact name, not a glob: one task name may be a prefix of another.
        path = results_file.parent / f"samples_{task}_{date_id}.jsonl"
        if path.is_file():
            samples[task] = path.read_text(encoding="utf-8")
    return {"results_json": results_json, "samples": samples}
