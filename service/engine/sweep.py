"""Checkpoint sweeps: one evaluation's tasks and settings over many training checkpoints of one
model, on ranks started once; and the loop that watches a training run for new checkpoints.

What is done once for the whole sweep, and how:

* **Ranks** start at the first checkpoint; between checkpoints every rank swaps weights in
  place, reading only the regions it holds (:meth:`rayeval.service.engine.engine.Engine.
  swap_checkpoint`). Each checkpoint is checked on the driver before any rank reads it.
* **Adapter checkpoints.** When the checkpoints are LoRA adapters (``adapter_config.json`` +
  ``adapter_model.safetensors``, as a PEFT trainer saves ``checkpoint-500/``), ``pretrained``
  is their base: the ranks load it once with the first adapter applied (``peft=``, as lm-eval's
  hf backend applies it) and between checkpoints overwrite only the adapter's matrices
  (:meth:`rayeval.service.engine.engine.Engine.swap_adapter`); every checkpoint must be one of
  the same LoRA run (its config and shapes). A sweep's checkpoints are all adapters or all
  weights. Each record and results file names its adapter (``peft=`` in the model args).
* **Tasks and requests.** lm-eval's ``simple_evaluate`` loads its tasks through the task
  manager it is given and ``evaluate`` then has every task build its requests. A sweep hands it
  :class:`TasksOnce`: the tasks are loaded on the first call only, and each task's
  ``build_all_requests`` builds its ``Instance`` objects on the first call only; later calls
  with the same arguments give the same instances back with their answers cleared (``resps``,
  ``filtered_resps``). Everything else is lm-eval's own code, run for each checkpoint as for a
  single evaluation: seeds, filters, metrics, groups, stderrs, the results dict. lm-eval's own
  request cache (``--cache_requests``) is not what a sweep uses: its key leaves out ``limit``,
  ``samples`` and the few-shot seed, it builds every document of a task when it first writes the
  cache, and it stores pickles.
* **Tokenisation and plans** follow from the same requests (the engine's own work per checkpoint
  is its model calls); the response cache keys every answer by the checkpoint's fingerprint.

Outputs under ``--output_path``: each checkpoint's lm-eval files in a directory named by its
label, ``OUT/<label>/<model>/results_<ts>.json`` (and ``samples_<task>_<ts>.jsonl``), so each is
an lm-eval output directory, and ``OUT/sweep.json`` (:mod:`rayeval.service.engine.sweep_summary`),
rewritten after every checkpoint. A sweep that asks to be tracked (``--mlflow_tracking_uri``) is
one MLflow run per checkpoint, named by it (:func:`rayeval.service.engine.experiments.
record_mlflow`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rayeval.actors.errors import CheckpointError, ConfigError
from rayeval.actors.weights.checkpoint_dirs import (
    CheckpointFormat,
    inspect_dir,
    label_of,
    labels,
    step_of_dir,
)
from rayeval.service.engine.experiments import record_mlflow, written_files
from rayeval.service.engine.lm import RayEvalLM
from rayeval.service.engine.outputs import OutputTarget
from rayeval.service.engine.response_cache import model_fingerprint, open_cache, settings_digest
from rayeval.service.engine.runner import evaluate_on, make_tracker, resolve_tasks, save
from rayeval.service.engine.sweep_summary import CheckpointRecord, SweepSummary, metrics_of
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.events import OnWarning, Progress

logger = logging.getLogger(__name__)


class TasksOnce:
    """A task manager for ``simple_evaluate`` that loads the tasks once and has each task build
    its requests once (see the module docstring); every other attribute is the wrapped one's."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._loaded: dict[str, Any] | None = None
        self._names: Any = None

    def load(self, tasks: Any) -> dict[str, Any]:
        """The tasks of ``tasks``, loaded on the first call (the same objects afterwards)."""
        if self._loaded is None:
            self._loaded, self._names = self._manager.load(tasks), tasks
            for task in self._loaded["tasks"].values():
                _build_once(task)
        elif tasks != self._names:
            raise ConfigError(
                f"a sweep evaluates one set of tasks, not {self._names!r} then {tasks!r}"
            )
        return self._loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _build_once(task: Any) -> None:
    """Have ``task`` build its requests on the first call, and give them back afterwards."""
    build = task.build_all_requests
    built: dict[str, str] = {}

    def build_all_requests(**kwargs: Any) -> None:
        key = repr(sorted(kwargs.items()))
        if built.get("key") == key and task.instances:
            for instance in task.instances:  # the same requests, unanswered
                instance.resps = []
                instance.filtered_resps = {}
            return
        build(**kwargs)
        built["key"] = key

    task.build_all_requests = build_all_requests


class Sweep:
    """Evaluates checkpoints one after another on one engine (see the module docstring).

    Args:
        config: The evaluation; ``model_args`` name the config and tokenizer (``pretrained``)
            and no ``checkpoint``.
        host: Where it runs and writes; ``output_path`` must be a directory.
        on_progress: Called after every finished step.
        on_warning: Called when a task has requests whose tokens do not measure it.

    Raises:
        ConfigError: ``checkpoint=``, ``peft=`` or ``delta=`` in the model args, an output path
            ending in ``.json``, a tracker asked for, unknown tasks.
    """

    def __init__(
        self,
        config: EvaluationConfig,
        host: HostOptions,
        on_progress: Callable[[Progress], None] | None = None,
        on_warning: OnWarning | None = None,
    ) -> None:
        if config.checkpoint:
            raise ConfigError(
                "a sweep names its checkpoints itself (--checkpoints, or the watched directory): "
                "drop checkpoint= from --model_args"
            )
        if config.model_args.get("peft"):
            raise ConfigError(
                "a sweep names its checkpoints itself: drop peft= from --model_args and name the "
                "adapter checkpoints in --checkpoints (or watch their folder); pretrained= is "
                "their base"
            )
        if config.model_args.get("delta"):
            raise ConfigError(
                "delta= over a checkpoint sweep is not supported: the checkpoints replace "
                "pretrained's weights (or, for adapters, lm-eval refuses peft= with delta=); "
                "evaluate delta= with pretrained= alone"
            )
        self._cfg = config.evaluator_config(host)
        if self._cfg.output_path and str(self._cfg.output_path).endswith(".json"):
            raise ConfigError(
                "a sweep writes one results file per checkpoint: give --output_path a directory"
            )
        if self._cfg.wandb_args or self._cfg.trackio_args:
            raise ConfigError(
                "a sweep does not log to W&B or trackio yet: read its sweep.json, or evaluate "
                "checkpoints one by one with checkpoint=... to log them"
            )
        self._config = config.model_copy(update={"model_args": dict(self._cfg.model_args)})
        self._host = host
        self._callbacks = (on_progress, on_warning)
        self._tasks = TasksOnce(resolve_tasks(self._cfg))
        self._target = OutputTarget(self._cfg.output_path) if self._cfg.output_path else None
        self._lm: RayEvalLM | None = None
        #: Adapters or weights: set by the first checkpoint checked or evaluated.
        self._adapters: bool | None = None
        self._first_adapter: str | None = None
        self._shell: Any = None
        self._settings = settings_digest(self._config)
        # Only to record and look up which checkpoints were evaluated (the engine opens its own
        # for the answers); None where the cache's disk is full, as the engine's.
        self._cache = open_cache(host.lm_eval.get("use_cache"), None)
        self.summary = SweepSummary(model=self._config.pretrained, tasks=list(self._cfg.tasks))

    # ------------------------------------------------------------------------ checks
    def check(self, checkpoints: Sequence[Path]) -> None:
        """Refuse the sweep before any rank starts if a checkpoint does not fit the model.

        Raises:
            CheckpointError: naming, per unusable checkpoint, its first problem.
        """
        refused = []
        for checkpoint in checkpoints:
            try:
                self._check(Path(checkpoint))
            except CheckpointError as exc:
                refused.append(str(exc))
        if refused:
            raise CheckpointError("; ".join(refused))

    def _check(self, checkpoint: Path) -> None:
        """Refuse one checkpoint that does not fit the model, or is an adapter in a sweep of
        weights (or the reverse), or an adapter of another LoRA run than the first.

        Raises:
            CheckpointError: what is wrong and what to do.
        """
        from rayeval.service.engine.plan.model_shell import check_checkpoint

        found = inspect_dir(checkpoint)
        adapter = found is not None and found.format is CheckpointFormat.ADAPTER
        if self._adapters is None:
            if found is not None:  # what is no checkpoint at all decides nothing
                self._adapters = adapter
        elif adapter != self._adapters:
            first = "LoRA adapters" if self._adapters else "model weights"
            raise CheckpointError(
                f"{checkpoint} is {'a LoRA adapter' if adapter else 'model weights'} and this "
                f"sweep's first checkpoint is {first}: sweep adapters and weights separately"
            )
        if not adapter:
            check_checkpoint(str(checkpoint), self._meta(), self._config.pretrained)
            return
        from rayeval.actors.weights.adapters import adapter_problems, swap_problems

        assert found is not None
        if not found.complete:
            raise CheckpointError(f"adapter {checkpoint} cannot be used: {found.problem}")
        path = str(checkpoint.resolve())
        try:
            if self._first_adapter is None:
                adapter_problems(path, self._meta())
                self._first_adapter = path
            else:
                swap_problems(self._first_adapter, path, self._meta())
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None

    def _meta(self) -> Any:
        """``pretrained``'s model on the meta device (built once)."""
        if self._shell is None:
            from rayeval.service.engine.plan.encoder import meta_model

            self._shell, _ = meta_model(self._config.pretrained, dict(self._config.model_args))
        return self._shell

    def done_before(self, checkpoint: Path, label: str) -> bool:
        """Whether ``checkpoint`` was evaluated before with these settings: its results file is
        under the output path, or the response cache recorded its fingerprint."""
        if self._has_results(label):
            return True
        if self._cache is None:
            return False
        return self._cache.evaluated(self._fingerprint(checkpoint), self._settings)

    def _has_results(self, label: str) -> bool:
        """Whether a results file of ``label`` is under a local output path."""
        if self._target is None or self._target.remote:
            return False
        return any((Path(self._target.local_path) / label).glob("*/results_*.json"))

    def skipped(self, checkpoint: Path, label: str) -> CheckpointRecord:
        """Record ``checkpoint`` as evaluated before (:meth:`done_before`), not evaluated now."""
        path = Path(checkpoint)
        record = CheckpointRecord(str(path.resolve()), label, step_of_dir(path), "skipped")
        record.kind = "adapter" if self._adapters else "weights"
        return self._record(record)

    # ------------------------------------------------------------------------ evaluation
    def evaluate(self, checkpoint: Path, label: str | None = None) -> CheckpointRecord:
        """Evaluate one checkpoint, write its files and the summary; returns its record.

        A checkpoint that does not fit the model is recorded as ``refused`` (nothing ran).

        Raises:
            RayEvalError: the engine failed (its ranks are released); the summary keeps what
                was evaluated before.
        """
        path = Path(checkpoint).resolve()
        label = label or label_of(Path(checkpoint))
        record = CheckpointRecord(str(path), label, step_of_dir(Path(checkpoint)), "failed")
        started = time.monotonic()
        try:
            self._check(path)
            record.kind = "adapter" if self._adapters else "weights"
            self._swap(str(path), record)
        except CheckpointError as exc:
            record.status, record.error = "refused", str(exc)
            logger.warning("checkpoint %s refused: %s", path, exc)
            return self._record(record)
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            self._record(record)
            raise
        swapped = time.monotonic()
        output = self._run_lm_eval(record, label)
        if output is not None:
            record.seconds["evaluate"] = time.monotonic() - swapped - record.seconds["save"]
            record.seconds["compute"] = sum(s["seconds"] for s in output.stats.values())
        record.seconds["total"] = time.monotonic() - started
        return self._record(record)

    def _swap(self, checkpoint: str, record: CheckpointRecord) -> None:
        started = time.monotonic()
        if self._lm is None:
            on_progress, on_warning = self._callbacks
            self._lm = RayEvalLM.from_config(
                self._model_config(checkpoint),
                self._host,
                on_progress=on_progress,
                on_warning=on_warning,
            )
            reports = self._lm.engine.load_reports  # the ranks' start is this checkpoint's swap
            record.seconds["read"] = max(r.seconds for r in reports)
        elif self._adapters:
            try:
                record.seconds["read"] = self._lm.engine.swap_adapter(checkpoint).read_s
            except CheckpointError:
                raise
            except ConfigError as exc:  # checked with the tokenizer too: nothing was swapped
                raise CheckpointError(str(exc)) from None
        else:
            record.seconds["read"] = self._lm.engine.swap_checkpoint(checkpoint).read_s
        record.fingerprint = model_fingerprint(self._lm.engine.config.model_args)
        record.seconds["swap"] = time.monotonic() - started

    def _run_lm_eval(self, record: CheckpointRecord, label: str) -> Any:
        """lm-eval's evaluation of the loaded checkpoint, its files written."""
        assert self._lm is not None
        self._cfg.model_args = dict(self._lm.engine.config.model_args)
        local = self._target.local_path if self._target is not None else None
        tracker = make_tracker(self._cfg, f"{local}/{label}" if local is not None else None)
        try:
            output = evaluate_on(self._lm, self._config, self._cfg, self._tasks, tracker)
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            self._record(record)
            self.close()
            raise
        if output is None:
            return None
        saving = time.monotonic()
        save(tracker, output.results, output.samples)
        if self._target is not None:
            self._target.publish()
            written = sorted((Path(local or ".") / label).glob("*/results_*.json"))
            if written:
                record.results_file = str(written[-1].relative_to(Path(local or ".")))
        record.seconds["save"] = time.monotonic() - saving
        # One MLflow run per checkpoint, named by it, when the sweep asks to be tracked.
        checkpoint = self._config.model_copy(update={"model_args": self._cfg.model_args})
        files = written_files(tracker, output.results)
        on_warning = self._callbacks[1]
        record_mlflow(checkpoint, self._host, output.results, output.samples, files, on_warning)
        if self._cache is not None and record.fingerprint:
            self._cache.mark_evaluated(record.fingerprint, self._settings)
        record.status = "succeeded"
        record.stats = dict(output.stats)
        record.results = metrics_of(output.results)
        record.higher_is_better = dict(output.results.get("higher_is_better") or {})
        return output

    def _record(self, record: CheckpointRecord) -> CheckpointRecord:
        self.summary.add(record)
        if self._target is not None:
            self.summary.write(Path(self._target.local_path))
            self._target.publish()  # a no-op for a local path
        return record

    def _model_config(self, checkpoint: str) -> EvaluationConfig:
        """The evaluation of one checkpoint: ``checkpoint=`` it, or ``peft=`` it (an adapter)."""
        if self._adapters:
            return self._config.model_copy(
                update={"model_args": {**self._config.model_args, "peft": checkpoint}}
            )
        return self._config.with_checkpoint(checkpoint)

    def _fingerprint(self, checkpoint: Path) -> str:
        path = Path(checkpoint).resolve()
        if self._adapters is None:
            found = inspect_dir(path)
            self._adapters = found is not None and found.format is CheckpointFormat.ADAPTER
        return model_fingerprint(self._model_config(str(path)).model_args)

    def close(self) -> None:
        """Release the ranks, the cache and a staged output directory. Safe to call twice."""
        if self._lm is not None:
            self._lm.close()
            self._lm = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._target is not None:
            self._target.close()

    def __enter__(self) -> Sweep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_sweep(
    config: EvaluationConfig,
    host: HostOptions,
    checkpoints: Sequence[str | Path],
    on_checkpoint: Callable[[CheckpointRecord], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_warning: OnWarning | None = None,
) -> SweepSummary:
    """Evaluate every checkpoint in turn on one engine; every one is checked first.

    Args:
        config: The evaluation (``pretrained`` names the config and tokenizer).
        host: Where it runs and writes (``output_path``: a directory).
        checkpoints: DCP directories or HF weight directories, in evaluation order.
        on_checkpoint: Called with each checkpoint's record as it is done.
        on_progress: Called after every finished step.
        on_warning: Called when a task has requests whose tokens do not measure it.

    Returns:
        The sweep's summary (also ``OUT/sweep.json`` with an output path).

    Raises:
        ConfigError: a checkpoint does not fit the model (before any rank starts).
        RayEvalError: the engine failed; the summary file keeps what was done.
    """
    paths = [Path(p) for p in checkpoints]
    names = labels(paths)
    with Sweep(config, host, on_progress=on_progress, on_warning=on_warning) as sweep:
        sweep.check(paths)
        for path in paths:
            record = sweep.evaluate(path, names[path])
            if on_checkpoint is not None:
                on_checkpoint(record)
        return sweep.summary
