"""Running one evaluation end to end, as ``lm_eval run`` does, but on Ray.

:func:`run_evaluation` takes the evaluation's
:class:`rayeval.service.vocabulary.config.EvaluationConfig` and the
:class:`rayeval.service.vocabulary.config.HostOptions` of where it runs, turns them into lm-eval's
own ``EvaluatorConfig`` (so every lm-eval option means what it means in lm-eval), resolves the
tasks, evaluates with :class:`rayeval.service.engine.lm.RayEvalLM` and writes what ``lm_eval``
writes, where it writes it: ``OUT/<model>/results_<ts>.json`` and, with ``--log_samples``,
``samples_<task>_<ts>.jsonl``; and records it where it asks to be recorded (W&B, MLflow:
:mod:`rayeval.service.engine.experiments`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.tasks import TaskManager

from rayeval.actors.errors import ConfigError, RayEvalError
from rayeval.actors.protocol import RankSite
from rayeval.service.engine.code_execution import code_execution, current_record
from rayeval.service.engine.dispatch.warm import KeptReplicas
from rayeval.service.engine.experiments import ExperimentLog, written_files
from rayeval.service.engine.lm import RayEvalLM
from rayeval.service.engine.outputs import OutputTarget
from rayeval.service.engine.response_cache import settings_digest
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.events import OnWarning, Progress, Stage

logger = logging.getLogger(__name__)


@dataclass
class EvaluationOutput:
    """lm-eval's results dict (``samples`` removed), the samples, rayeval's figures, where
    each rank ran (``Engine.rank_sites``), and the files written (the results file first,
    then the samples files; URLs when ``--output_path`` is one; none without an output path)."""

    results: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] | None
    stats: dict[str, Any]
    ranks: list[RankSite] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def resolve_tasks(cfg: EvaluatorConfig) -> TaskManager:
    """Resolve ``cfg.tasks`` to lm-eval task names/configs, as ``lm_eval run`` does.

    When every requested name is found under ``--include_path`` alone, lm-eval's scan of its
    built-in task index (seconds) is skipped; the outcome is the same.

    Raises:
        ConfigError: naming the tasks that were not found.
    """
    names = [str(name) for name in cfg.tasks]
    if cfg.include_path and names and not any(n.endswith(".yaml") for n in names):
        local = TaskManager(
            include_defaults=False, include_path=cfg.include_path, metadata=cfg.metadata or {}
        )
        matched = {name: local.match_tasks([name]) for name in names}
        if all(matched.values()):
            cfg.tasks = list(dict.fromkeys(t for found in matched.values() for t in found))
            return local
    try:
        return cfg.process_tasks(cfg.metadata)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}{_nearest_tasks(cfg, names)}. List available tasks with `lm_eval ls tasks`, "
            "or point --include_path at the directory holding your task YAMLs."
        ) from None


def _nearest_tasks(cfg: EvaluatorConfig, names: list[str]) -> str:
    """``: 'x' (did you mean y?)`` for each name no task, group or tag matches, as the service
    says it (lm-eval's index is scanned again: seconds, on this error's path only)."""
    from rayeval.service.vocabulary.nearest import unknown_name

    manager = TaskManager(include_path=cfg.include_path, metadata=cfg.metadata or {})
    names = [name for task in names for name in task.split(",") if name]
    unknown = [name for name in names if not manager.match_tasks([name])]
    known = manager.all_tasks
    return (": " + "; ".join(unknown_name(name, known) for name in unknown)) if unknown else ""


def run_evaluation(
    config: EvaluationConfig,
    host: HostOptions,
    on_progress: Callable[[Progress], None] | None = None,
    on_warning: OnWarning | None = None,
    replicas: KeptReplicas | None = None,
    on_stage: Callable[[Stage], None] | None = None,
) -> EvaluationOutput | None:
    """Evaluate like ``lm_eval run --model hf`` with the model spread over Ray actors.

    Beyond lm-eval's output, ``results["request_warnings"]`` lists, per task and kind, the
    loglikelihood requests whose tokens do not measure the task
    (:mod:`rayeval.service.engine.plan.checks`); the key is absent when there are none, so a
    clean run's files have lm-eval's keys only.

    Args:
        config: The evaluation.
        host: Where it runs and writes: results and samples go under ``host.output_path`` when
            it is set (a local path, or an fsspec URL such as ``s3://bucket/evals`` with its
            package installed).
        on_progress: Called after every finished step.
        on_warning: Called when a task has such requests (a ``RequestWarning``), and
            when an experiment tracker did not record the evaluation (``{tracker, message}``:
            :mod:`rayeval.service.engine.experiments`; the evaluation still succeeds).
        replicas: Loaded replicas to use if they match, and to keep these ones in after a
            successful evaluation (the service's warm replicas:
            :mod:`rayeval.service.engine.dispatch.warm`).
        on_stage: Called with each stage between batches: the start-up's (placing, loading m/n
            ranks while lm-eval builds its requests) and lm-eval's metrics after the last
            request type.

    Returns:
        The results, or None where lm-eval returns None.

    Raises:
        ConfigError: bad model, model args or tasks; a ``sweep`` (run it with
            :func:`rayeval.service.engine.sweep.run_sweep` or ``watch``).
        RayEvalError: any other failure, with a message naming the fix.
    """
    if config.sweep is not None:
        raise ConfigError(
            "this evaluation is a checkpoint sweep: run it with rayeval.service.engine.sweep."
            "run_sweep (or engine.watch.watch), `rayeval run --checkpoints` or the service"
        )
    cfg = config.evaluator_config(host)
    task_manager = resolve_tasks(cfg)
    with code_execution(host.code_execution, cfg, task_manager):
        # A URL (s3://...) is checked now, staged locally for lm-eval's tracker, copied at the
        # end.
        target = OutputTarget(cfg.output_path) if cfg.output_path else None
        try:
            reports = (on_progress, on_warning, on_stage)
            return _evaluate(config, host, cfg, task_manager, target, reports, replicas)
        finally:
            if target is not None:
                target.close()


def _evaluate(
    config: EvaluationConfig,
    host: HostOptions,
    cfg: EvaluatorConfig,
    task_manager: TaskManager,
    target: OutputTarget | None,
    reports: tuple[
        Callable[[Progress], None] | None,
        OnWarning | None,
        Callable[[Stage], None] | None,
    ],
    replicas: KeptReplicas | None,
) -> EvaluationOutput | None:
    on_progress, on_warning, on_stage = reports
    tracker = make_tracker(cfg, target.local_path if target is not None else None)
    # The trackers, set up before the run as `lm_eval run` does (wandb.init happens here).
    experiments = ExperimentLog(config, host, cfg, on_warning)
    # lm-eval may have changed model args (--trust_remote_code): the engine uses its copy.
    with (
        experiments.abandoned_on_error(),
        RayEvalLM.from_config(
            config.model_copy(update={"model_args": dict(cfg.model_args)}),
            host,
            on_progress=on_progress,
            on_warning=on_warning,
            replicas=replicas,
            on_stage=on_stage,
            # Evaluated to the end before with these settings: ranks start only if an answer
            # is not in the response cache.
            settings=settings_digest(config),
        ) as lm,
    ):
        output = evaluate_on(lm, config, cfg, task_manager, tracker)
        if output is not None:
            lm.engine.mark_evaluated()
    if output is None:
        experiments.record_wandb(None, None)
        return None
    experiments.record_wandb(output.results, output.samples)
    save(tracker, output.results, output.samples)
    files = written_files(tracker, output.results)
    experiments.record_mlflow(output.results, output.samples, files)
    output.files = [str(path) for path in files]
    if target is not None:
        published = target.publish()
        output.files = published if target.remote else output.files
    return output


def make_tracker(cfg: EvaluatorConfig, output_path: str | None) -> Any:
    """lm-eval's ``EvaluationTracker`` as ``lm_eval run`` makes it, writing under
    ``output_path`` (a local path; None: where ``--hf_hub_log_args`` says, else nowhere)."""
    from lm_eval.loggers import EvaluationTracker

    if output_path is not None:
        cfg.hf_hub_log_args["output_path"] = output_path
    if os.environ.get("HF_TOKEN"):
        cfg.hf_hub_log_args["token"] = os.environ["HF_TOKEN"]
    return EvaluationTracker(**cfg.hf_hub_log_args)


def evaluate_on(
    lm: RayEvalLM,
    config: EvaluationConfig,
    cfg: EvaluatorConfig,
    task_manager: Any,
    tracker: Any,
) -> EvaluationOutput | None:
    """lm-eval's ``simple_evaluate`` on a running engine (whatever weights its ranks hold), with
    the results recorded as lm-eval's HF backend records them; nothing is written yet.

    Returns:
        The results, or None where lm-eval returns None.
    """
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm,
        evaluation_tracker=tracker,
        **_simple_evaluate_kwargs(config, cfg, task_manager),
    )
    stats = {str(phase): phase_stats.report() for phase, phase_stats in lm.engine.stats.items()}
    request_warnings = lm.engine.request_report.as_dict()
    try:
        ranks = lm.engine.rank_sites()
    except RayEvalError as exc:  # the results are complete: say so, do not drop them
        logger.warning("could not ask the ranks where they ran: %s", exc)
        ranks = []
    if results is None:
        return None
    if request_warnings:
        results["request_warnings"] = request_warnings
    if record := current_record():  # where the model-written code ran: the sandbox, its limits
        results["code_execution"] = record
    # Record the run as lm-eval's HF backend would, so downstream tools see the same header.
    results["config"]["model"] = cfg.model
    tracker.general_config_tracker.model_source = cfg.model
    samples = results.pop("samples", None) if cfg.log_samples else None
    return EvaluationOutput(results=results, samples=samples, stats=stats, ranks=ranks)


def _simple_evaluate_kwargs(
    config: EvaluationConfig, cfg: EvaluatorConfig, task_manager: Any
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` arguments for this evaluation, as ``lm_eval run`` passes
    them (the model and the tracker aside)."""
    seed = cfg.seed or [None, None, None, None]
    return {
        "model_args": cfg.model_args,
        "tasks": cfg.tasks,
        "num_fewshot": cfg.num_fewshot,
        "batch_size": cfg.batch_size,
        "max_batch_size": cfg.max_batch_size,
        # --use_cache is rayeval's own cache, keyed by the model (engine.response_cache):
        # lm-eval's would hand one model's answers to another.
        "use_cache": None,
        "cache_requests": cfg.cache_requests.get("cache_requests", False),
        "rewrite_requests_cache": cfg.cache_requests.get("rewrite_requests_cache", False),
        "delete_requests_cache": cfg.cache_requests.get("delete_requests_cache", False),
        "limit": cfg.limit,
        "samples": cfg.samples,
        "check_integrity": cfg.check_integrity,
        "write_out": cfg.write_out,
        "log_samples": cfg.log_samples,
        "system_instruction": cfg.system_instruction,
        "apply_chat_template": cfg.apply_chat_template,
        "fewshot_as_multiturn": cfg.fewshot_as_multiturn,
        "gen_kwargs": cfg.gen_kwargs,
        "task_manager": task_manager,
        "predict_only": cfg.predict_only,
        "bootstrap_iters": config.bootstrap_iters,
        "random_seed": seed[0],
        "numpy_random_seed": seed[1],
        "torch_random_seed": seed[2],
        "fewshot_random_seed": seed[3],
        "confirm_run_unsafe_code": cfg.confirm_run_unsafe_code,
        "metadata": cfg.metadata,
    }


def save(tracker: Any, results: dict[str, Any], samples: dict[str, Any] | None) -> None:
    """lm-eval's files of one evaluation, as `lm_eval run` writes them: the tracker writes where
    its output_path says (--output_path, or --hf_hub_log_args output_path=...; nothing without
    one) and pushes to the hub if asked."""
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if tracker.push_results_to_hub or tracker.push_samples_to_hub:
        tracker.recreate_metadata_card()
