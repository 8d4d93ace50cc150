"""One evaluation's experiment trackers: lm-eval's W&B logger and an MLflow run.

:class:`ExperimentLog` is set up before the evaluation (``wandb.init`` happens then, as in
``lm_eval run``) and records the finished evaluation after lm-eval's files are written. W&B runs
for ``--wandb_args`` (``rayeval run``, lm-eval's own flag) or, on the service, for an evaluation
that asks to be tracked (``tracking``) when the server has a W&B project; MLflow for an
evaluation that asks to be tracked when the host has a tracking URI (``rayeval run
--mlflow_tracking_uri`` asks for itself). What a tracker fails to do is a warning, logged and
handed to ``on_warning`` as :class:`rayeval.service.vocabulary.events.TrackerWarning`: the results
never depend on a tracker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError
from rayeval.service.trackers import TrackerError, log_to_mlflow, wandb_init_args
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.events import OnWarning, TrackerWarning

logger = logging.getLogger(__name__)


class ExperimentLog:
    """The trackers one evaluation is recorded in.

    Args:
        config: The evaluation.
        host: Where it runs: ``host.trackers`` and lm-eval's ``wandb_args``.
        cfg: lm-eval's ``EvaluatorConfig`` of the evaluation (its W&B arguments).
        on_warning: Called with each tracker warning.

    Raises:
        ConfigError: W&B is asked for and wandb is not installed, or ``--trackio_args`` given.
    """

    def __init__(
        self,
        config: EvaluationConfig,
        host: HostOptions,
        cfg: Any,
        on_warning: OnWarning | None = None,
    ) -> None:
        self._config = config
        self._host = host
        self._on_warning = on_warning
        self._wandb = self._start_wandb(cfg)

    def _start_wandb(self, cfg: Any) -> Any:
        """lm-eval's ``WandbLogger`` (None: no W&B, or it could not start: a warning)."""
        if cfg.trackio_args:
            raise ConfigError(
                "--trackio_args is not supported by rayeval yet: log with --wandb_args or "
                "--mlflow_tracking_uri, or read the results file (--output_path)"
            )
        init_args = dict(cfg.wandb_args or {})
        trackers = self._host.trackers
        if not init_args and self._config.tracking is not None and trackers.wandb_project:
            init_args = wandb_init_args(self._config, trackers)
        if not init_args:
            return None
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(
                "W&B logging needs wandb: pip install 'rayeval[wandb]' (or pip install wandb)"
            ) from None
        from lm_eval.loggers import WandbLogger

        config_args = dict(cfg.wandb_config_args or {})
        if trackers.evaluation_id is not None:
            config_args.setdefault("rayeval_evaluation_id", trackers.evaluation_id)
            config_args.setdefault("rayeval_url", trackers.evaluation_url)
        try:
            return WandbLogger(init_args, config_args)
        except Exception as exc:  # no API key, no network: the evaluation goes on
            self._warn(
                "wandb",
                f"W&B did not start a run: {exc}; check WANDB_API_KEY, or set WANDB_MODE=offline "
                "and sync later",
            )
            return None

    @contextlib.contextmanager
    def abandoned_on_error(self) -> Iterator[None]:
        """A W&B run started for an evaluation that fails ends as failed (a runner that runs
        another evaluation next must not log into it)."""
        try:
            yield
        except BaseException:
            self._finish_wandb(exit_code=1)
            raise

    def record_wandb(self, results: dict[str, Any] | None, samples: dict[str, Any] | None) -> None:
        """Results (and samples) to W&B as ``lm_eval run`` logs them; the run is finished (None:
        lm-eval returned no results, the run just ends)."""
        if self._wandb is None:
            return
        try:
            if results is not None:
                self._wandb.post_init(results)
                self._wandb.log_eval_result()
                if samples is not None:
                    self._wandb.log_eval_samples(samples)
        except Exception as exc:  # as lm-eval: a logging failure does not lose the results
            self._warn("wandb", f"logging to W&B failed: {exc}")
        finally:
            self._finish_wandb(exit_code=0)

    def _finish_wandb(self, exit_code: int) -> None:
        run, self._wandb = (self._wandb.run if self._wandb else None), None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:
            self._warn("wandb", f"finishing the W&B run failed: {exc}")

    def record_mlflow(
        self,
        results: Mapping[str, Any],
        samples: Mapping[str, Any] | None,
        files: list[Path],
    ) -> None:
        """The evaluation as one MLflow run (:func:`record_mlflow`)."""
        record_mlflow(self._config, self._host, results, samples, files, self._on_warning)

    def _warn(self, tracker: str, message: str) -> None:
        _warn(tracker, message, self._on_warning)


def record_mlflow(
    config: EvaluationConfig,
    host: HostOptions,
    results: Mapping[str, Any],
    samples: Mapping[str, Any] | None,
    files: list[Path],
    on_warning: OnWarning | None = None,
) -> None:
    """A finished evaluation as one MLflow run, if it asked to be tracked and the host has an
    MLflow server; a failure is a warning.

    Args:
        config: The evaluation (for a checkpoint of a sweep: with its ``checkpoint`` model arg).
        host: Where it ran (``host.trackers``).
        results: lm-eval's results.
        samples: lm-eval's samples (None: not logged).
        files: lm-eval's files as written; when it wrote none, the results and samples are
            written to a temporary directory for the run.
        on_warning: Called with a warning when MLflow did not record it.
    """
    if config.tracking is None or not host.trackers.mlflow_tracking_uri:
        return
    with tempfile.TemporaryDirectory(prefix="rayeval-mlflow-") as scratch:
        if not files:
            files = _write_files(Path(scratch), results, samples)
        try:
            url = log_to_mlflow(config, host.trackers, results, files)
        except TrackerError as exc:
            _warn("mlflow", str(exc), on_warning)
        else:
            logger.info("recorded in MLflow: %s", url)


def _warn(tracker: str, message: str, on_warning: OnWarning | None) -> None:
    logger.warning("%s: %s", tracker, message)
    if on_warning is not None:
        on_warning(TrackerWarning(tracker=tracker, message=message))


def written_files(tracker: Any, results: Mapping[str, Any]) -> list[Path]:
    """The results file and samples files lm-eval's ``EvaluationTracker`` just wrote (none
    without an output path), named as it names them."""
    if not tracker.output_path or not getattr(tracker, "date_id", None):
        return []
    base, date_id = Path(tracker.output_path), tracker.date_id
    if base.suffix == ".json":
        results_file = base.with_name(f"{base.stem}_{date_id}.json")
        folder = base.parent
    else:
        folder = base / str(tracker.general_config_tracker.model_name_sanitized)
        results_file = folder / f"results_{date_id}.json"
    samples = [folder / f"samples_{task}_{date_id}.jsonl" for task in results.get("configs", {})]
    return [path for path in (results_file, *samples) if path.is_file()]


def _write_files(
    folder: Path, results: Mapping[str, Any], samples: Mapping[str, Any] | None
) -> list[Path]:
    """The results and samples as lm-eval's files would hold them, under ``folder``."""
    from lm_eval.utils import handle_non_serializable

    results_file = folder / "results.json"
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    results_file.write_text(text, encoding="utf-8")
    files = [results_file]
    for task, rows in (samples or {}).items():
        path = folder / f"samples_{task}.jsonl"
        lines = [json.dumps(row, default=handle_non_serializable) for row in rows]
        path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        files.append(path)
    return files
