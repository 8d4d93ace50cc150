"""The server's checks of a submitted evaluation, before it is queued.

An :class:`service.config.EvaluationConfig` is already well-formed; what is checked here is what
only the server can judge: task names (never paths) that its catalog knows, model paths that exist
on it, options lm-eval accepts together, and a layout the cluster can ever hold. Every problem is
collected into one message. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from actors.errors import ConfigError, LayoutError, ServiceNotReadyError
from service.config import EvaluationConfig, HostOptions
from service.jobs.tasks import TaskCatalog


def check_submission(
    config: EvaluationConfig,
    catalog: TaskCatalog,
    cluster_total: Mapping[str, float],
    task_index_wait_s: float,
) -> None:
    """Refuse an evaluation that could not run here, naming every problem at once.

    Args:
        config: The evaluation, its device resolved against the cluster.
        catalog: The task names evaluations may use.
        cluster_total: Ray's ``cluster_resources()``.
        task_index_wait_s: How long to wait for lm-eval's task index if a name is not local.

    Raises:
        ConfigError: bad model, tasks or options.
        LayoutError: the layout can never fit the cluster (requested vs available), when it
            is the only problem.
        ServiceNotReadyError: the task index is not ready yet and nothing else is wrong.
    """
    problems = model_problems(config) + task_problems(config)
    try:
        config.evaluator_config(
            HostOptions(output_path="unused", include_paths=catalog.include_paths)
        )
    except ConfigError as exc:
        problems.append(str(exc))
    if not task_problems(config):
        try:
            catalog.check(config.tasks, wait_s=task_index_wait_s)
        except ConfigError as exc:
            problems.append(str(exc))
        except ServiceNotReadyError:
            if not problems:
                raise
    try:
        config.layout().check_fits(cluster_total)
    except LayoutError as exc:
        if not problems:
            raise
        problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


def task_problems(config: EvaluationConfig) -> list[str]:
    """Task files come only from the server's include paths: a request names tasks, not files."""
    paths = [n for n in config.tasks if "/" in n or "\\" in n or n.endswith((".yaml", ".yml"))]
    if not paths:
        return []
    return [
        f"tasks: {paths} look like paths: give task names; task files come only from the "
        "server's --include-path"
    ]


def model_problems(config: EvaluationConfig) -> list[str]:
    """Local model and tokenizer paths that do not exist on the server."""
    problems = []
    for key in ("pretrained", "tokenizer"):
        value = config.model_args.get(key)
        if isinstance(value, str) and _looks_local(value) and not Path(value).expanduser().exists():
            problems.append(
                f"model_args.{key}: {value!r} does not exist on the server: pass a path that "
                "exists on the server and every Ray node, or a Hugging Face hub id (org/name)"
            )
    return problems


def _looks_local(value: str) -> bool:
    """A path, not a hub id: absolute, home- or dot-relative, or more than one ``/``."""
    return value.startswith(("/", "~", "./", "../")) or value.count("/") > 1
