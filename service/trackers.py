"""Experiment trackers: where teams keep their runs (MLflow, W&B), and what an evaluation adds.

Two sides, as with every option (:mod:`rayeval.service.vocabulary.config`):

- :class:`Tracking` is the evaluation's own choice (``"tracking": {...}`` in a REST body,
  ``--tracking`` on the command line): record me, in this experiment, under this name, with these
  tags. Without it an evaluation is recorded nowhere.
- :class:`Trackers` is the host's: which MLflow server and W&B project exist at all (the server
  operator's ``--mlflow-tracking-uri`` / ``--wandb-project``, or ``rayeval run
  --mlflow_tracking_uri``), and the evaluation's id and link back, which only the service knows.

:func:`log_to_mlflow` records one finished evaluation as one MLflow run: the configuration as
params, every metric and its stderr as metrics, lm-eval's results and samples files as artifacts,
the evaluation's id and URL as tags. :func:`wandb_init_args` is the same choice for lm-eval's W&B
logger. A tracker that cannot be reached raises :class:`TrackerError`, which callers report as a
warning: the evaluation's results never depend on a tracker. ``mlflow`` is imported only when a
run is logged (``pip install 'rayeval[mlflow]'``). No torch here.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from rayeval.actors.errors import RayEvalError

if TYPE_CHECKING:
    from rayeval.service.vocabulary.config import EvaluationConfig

#: The experiment runs go in when the evaluation names none.
DEFAULT_EXPERIMENT = "rayeval"
#: MLflow's limits: params and metrics per ``log_batch`` call, a param value's length.
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _PARAM_CHARS = 100, 1000, 6000
#: Characters MLflow accepts in metric, param and tag names; others become ``_``.
_NAME_UNSAFE = re.compile(r"[^\w\-. /:]")
#: Unless the host says otherwise, a tracker that is down costs seconds, not MLflow's default
#: of seven retries with exponential backoff (minutes).
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}

_TagKey = Annotated[str, StringConstraints(min_length=1, max_length=250, pattern=r"^[\w\-. /:]+$")]
_TagValue = Annotated[str, StringConstraints(max_length=5000)]
_Name = Annotated[str, StringConstraints(min_length=1, max_length=250)]


class TrackerError(RayEvalError):
    """An experiment tracker could not record the evaluation (reported as a warning)."""


#: The help of the evaluation's ``tracking`` field (REST schema and ``--tracking``).
TRACKING_HELP = (
    "Record the evaluation as one run in the host's experiment trackers (MLflow, W&B): {} for "
    'the defaults, or {"experiment": ..., "run_name": ..., "tags": {...}} (on the command line: '
    "experiment=NAME,run_name=NAME); refused by a server with no tracker."
)


class Tracking(BaseModel):
    """Record this evaluation as one run in the host's experiment trackers (MLflow, W&B)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment: _Name | None = Field(
        default=None,
        description=f"MLflow experiment (W&B group) of the run; default {DEFAULT_EXPERIMENT!r}.",
    )
    run_name: _Name | None = Field(
        default=None, description="The run's name; default: the model's (its last path part)."
    )
    tags: dict[_TagKey, _TagValue] = Field(
        default_factory=dict, max_length=64, description="Extra tags on the run."
    )

    @field_validator("experiment", "run_name", mode="before")
    @classmethod
    def _names_as_text(cls, value: Any) -> Any:
        # `--tracking run_name=100` arrives as a number (lm-eval's key=value parsing).
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return str(value) if number else value


@dataclass(frozen=True)
class Trackers:
    """The experiment trackers a host records evaluations in, and what links a run back.

    Args:
        mlflow_tracking_uri: The MLflow tracking server (None: no MLflow).
        wandb_project: The server's W&B project (None: none; ``rayeval run`` uses lm-eval's own
            ``--wandb_args`` instead).
        server_url: The rayeval server's address people use (runs link back to it).
        evaluation_id: The service's id of the evaluation (None outside the service).
    """

    mlflow_tracking_uri: str | None = None
    wandb_project: str | None = None
    server_url: str | None = None
    evaluation_id: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The trackers configured (``mlflow``, ``wandb``)."""
        named = (("mlflow", self.mlflow_tracking_uri), ("wandb", self.wandb_project))
        return tuple(name for name, target in named if target)

    @property
    def evaluation_url(self) -> str | None:
        """The evaluation's page on the server's dashboard, when both are known."""
        if self.server_url is None or self.evaluation_id is None:
            return None
        return f"{self.server_url.rstrip('/')}/#{self.evaluation_id}"

    def to_json(self) -> dict[str, Any]:
        """Plain data (what the runner actor is handed); ``Trackers(**data)`` reads it back."""
        return {
            "mlflow_tracking_uri": self.mlflow_tracking_uri,
            "wandb_project": self.wandb_project,
            "server_url": self.server_url,
            "evaluation_id": self.evaluation_id,
        }


# ------------------------------------------------------------------------- what is recorded
def run_name(config: EvaluationConfig) -> str:
    """The run's name: the evaluation's choice, else the last path part of its checkpoint (a
    sweep's checkpoints are named by their directories) or of its model."""
    if config.tracking is not None and config.tracking.run_name:
        return config.tracking.run_name
    source = config.checkpoint or config.pretrained
    return Path(source.rstrip("/")).name or source


def run_tags(config: EvaluationConfig, trackers: Trackers) -> dict[str, str]:
    """The evaluation's own tags, then rayeval's (which win): the model, the checkpoint, the
    evaluation's id and URL."""
    tags = dict(config.tracking.tags) if config.tracking is not None else {}
    tags["rayeval.model"] = config.pretrained
    if config.checkpoint:
        tags["rayeval.checkpoint"] = config.checkpoint
    if trackers.evaluation_id is not None:
        tags["rayeval.evaluation_id"] = trackers.evaluation_id
    if trackers.evaluation_url is not None:
        tags["rayeval.url"] = trackers.evaluation_url
    return tags


def run_params(config: EvaluationConfig) -> dict[str, str]:
    """The configuration flattened to ``dotted.name -> text`` (nested groups and model args
    expanded; lists as JSON), as MLflow params; the tracking choice itself is left out."""
    import json

    flat: dict[str, str] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[_safe_name(prefix)] = text[:_PARAM_CHARS]

    data = config.to_json()
    data.pop("tracking", None)
    add("", data)
    return flat


def run_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric metric of lm-eval's results, tasks and groups, its stderr included:
    ``acc,none`` of ``demo_mc`` is ``demo_mc/acc``, ``acc_stderr,none`` is
    ``demo_mc/acc_stderr``, a filter other than ``none`` is appended (``.../exact_match/strict``).
    Stderrs lm-eval could not compute (``N/A``) are absent."""
    metrics: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, comma, filter_ = key.partition(",")
                if not comma or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                name = f"{task}/{metric}" + (f"/{filter_}" if filter_ != "none" else "")
                metrics[_safe_name(name)] = float(value)
    return metrics


def wandb_init_args(config: EvaluationConfig, trackers: Trackers) -> dict[str, Any]:
    """``wandb.init`` arguments of the server's W&B project for this evaluation (lm-eval's
    ``--wandb_args``): the run's name, its experiment as the group, the tags and the link back in
    its notes."""
    tracking = config.tracking
    tags = run_tags(config, trackers)
    return {
        "project": trackers.wandb_project,
        "name": run_name(config),
        "group": (tracking.experiment if tracking else None) or DEFAULT_EXPERIMENT,
        "job_type": "eval",
        "tags": [f"{key}={value}"[:64] for key, value in tags.items()],
        "notes": f"rayeval evaluation {trackers.evaluation_id}: {trackers.evaluation_url}"
        if trackers.evaluation_id
        else None,
    }


# --------------------------------------------------------------------------------- MLflow
def log_to_mlflow(
    config: EvaluationConfig,
    trackers: Trackers,
    results: Mapping[str, Any],
    files: Sequence[Path],
) -> str:
    """Record one finished evaluation as one MLflow run.

    Args:
        config: The evaluation (its ``tracking`` names the experiment, run and tags).
        trackers: The host's trackers (``mlflow_tracking_uri`` must be set) and the link back.
        results: lm-eval's results (metrics and stderrs).
        files: lm-eval's results and samples files, logged as artifacts.

    Returns:
        The run's address on the tracking server.

    Raises:
        TrackerError: MLflow is not installed, or the server refused or could not be reached
            (the message names the fix).
    """
    uri = trackers.mlflow_tracking_uri
    if not uri:
        raise TrackerError("no MLflow tracking URI: set --mlflow-tracking-uri")
    for key, value in _MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise TrackerError(
            "MLflow tracking needs the mlflow package where evaluations run: "
            "pip install 'rayeval[mlflow]'"
        ) from None
    experiment = (config.tracking.experiment if config.tracking else None) or DEFAULT_EXPERIMENT
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = _experiment_id(client, experiment)
        run = client.create_run(
            experiment_id, run_name=run_name(config), tags=run_tags(config, trackers)
        )
        _fill_run(client, run.info.run_id, config, results, files)
    except TrackerError:
        raise
    except Exception as exc:  # MlflowException, requests' and OS errors: all "not recorded"
        raise TrackerError(
            f"the evaluation was not recorded in MLflow at {uri}: {_brief(exc)}. Check that the "
            "tracking server runs and that the nodes running evaluations reach it"
        ) from None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run.info.run_id}"


def _experiment_id(client: Any, name: str) -> str:
    """The id of the experiment ``name``, created if missing (by another run meanwhile too)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:  # created by a concurrent run between the two calls
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _fill_run(
    client: Any,
    run_id: str,
    config: EvaluationConfig,
    results: Mapping[str, Any],
    files: Sequence[Path],
) -> None:
    """Params, metrics and artifacts of the run; it ends FINISHED, or FAILED if one failed."""
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    try:
        params = [Param(k, v) for k, v in run_params(config).items()]
        for chunk in _chunks(params, _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=chunk)
        metrics = [Metric(k, v, now, 0) for k, v in run_metrics(results).items()]
        for chunk in _chunks(metrics, _METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=chunk)
        for path in files:
            client.log_artifact(run_id, str(path))
    except Exception:
        with contextlib.suppress(Exception):  # the server is gone: the first error says why
            client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _safe_name(name: str) -> str:
    return _NAME_UNSAFE.sub("_", name)[:250]


def _brief(exc: Exception) -> str:
    """An exception in one line of reasonable length."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
