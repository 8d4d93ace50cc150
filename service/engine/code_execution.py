"""Where an evaluation's model-written code runs: lm-eval's ``code_eval`` put in the sandbox.

lm-eval scores ``humaneval*``/``mbpp*`` by running each generated program; it needs
``confirm_run_unsafe_code`` for such tasks and loads HF evaluate's ``code_eval`` from the Hub
when their ``utils.py`` is imported. Under :attr:`CodeExecution.SANDBOX` (the service, and
``rayeval run --confirm_run_unsafe_code``) :func:`code_execution` confirms lm-eval's flag and
hands those tasks the sandboxed metric for the whole evaluation (task loading and scoring); tasks
that run code some other way (cruxeval's own ``exec``, longproc's g++) are refused before any
rank starts. Results then record where the code ran (``results["code_execution"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from rayeval.actors.errors import ConfigError
from rayeval.service.vocabulary.config import CodeExecution

logger = logging.getLogger(__name__)

#: Said once per evaluation that runs model-written code outside the sandbox.
UNSANDBOXED_WARNING = (
    "running model-written code WITHOUT a sandbox (--run_unsafe_code_unsandboxed): candidates "
    "run in this host's processes with its network, files and environment (tokens included), "
    "under HF evaluate's reliability_guard, which is not a security sandbox"
)


#: Code tasks where code execution is off, at either door.
OFF_REFUSAL = (
    "tasks: {tasks} run model-written code to score it (unsafe_code in their config) and code "
    "execution is off: `rayeval run --confirm_run_unsafe_code` runs every candidate in a "
    "bubblewrap sandbox; a server runs them only where its operator allows it with "
    "--allow-code-execution (RAYEVAL_ALLOW_CODE_EXECUTION=1)"
)

#: What the running evaluation records about where its code ran (empty: no code task).
_RECORD: ContextVar[dict[str, Any] | None] = ContextVar("rayeval_code_execution", default=None)


def current_record() -> dict[str, Any]:
    """``results["code_execution"]`` of the evaluation running in this context (empty: none)."""
    return _RECORD.get() or {}


@contextmanager
def code_execution(mode: CodeExecution, cfg: Any, task_manager: Any) -> Iterator[None]:
    """Run an evaluation's model-written code where ``mode`` says, for the whole evaluation.

    Under :attr:`CodeExecution.SANDBOX`, with code tasks among ``cfg.tasks``, the sandbox is
    started once first (fail closed: no rank starts where bwrap cannot run) and what results
    record is set (:func:`current_record`). Under :attr:`CodeExecution.OFF` code tasks are
    refused before any rank starts (a server whose operator turned code execution off since the
    evaluation was accepted runs none of its code).

    Args:
        mode: Where code runs.
        cfg: lm-eval's ``EvaluatorConfig``, tasks resolved (its ``confirm_run_unsafe_code`` is
            set to match ``mode``).
        task_manager: The evaluation's lm-eval ``TaskManager``.

    Raises:
        ConfigError: code tasks with code execution off; a task runs code other than through
            ``code_eval`` (sandbox mode).
        SandboxUnavailableError: code tasks, and bwrap cannot run here.
    """
    from rayeval.service.jobs.tasks import CODE_EVAL, OTHER_CODE, other_code_refusal, unsafe_names

    cfg.confirm_run_unsafe_code = mode is not CodeExecution.OFF
    if mode is CodeExecution.HOST:
        logger.warning(UNSANDBOXED_WARNING)
        yield
        return
    found = unsafe_names(task_manager, names=[str(t) for t in cfg.tasks])
    if mode is CodeExecution.OFF:
        if found:
            raise ConfigError(OFF_REFUSAL.format(tasks=sorted(found)))
        yield
        return
    from rayeval.service.sandbox.metric import record, sandboxed_code_eval

    other = sorted(name for name, kind in found.items() if kind == OTHER_CODE)
    if other:
        raise ConfigError(other_code_refusal(other))
    if CODE_EVAL not in found.values():
        yield
        return
    with sandboxed_code_eval() as metric:
        token = _RECORD.set(record(metric.sandbox))
        try:
            yield
        finally:
            _RECORD.reset(token)
