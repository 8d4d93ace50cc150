"""The evaluations of ``rayeval parity``: lm-eval's own ``hf`` backend at several batch sizes, then
rayeval at each layout, all on the same samples, each layout judged against lm-eval hf's spread
(:mod:`rayeval.service.parity`).

lm-eval hf runs in this process, on this machine's device; rayeval's ranks run on Ray (an
existing cluster, or one embedded here and sized for the largest layout). Every run gets the same
lm-eval options and seeds, as ``lm_eval run`` passes them (:mod:`.runner`); samples are always
logged, no response cache answers, and no file is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.tasks import TaskManager

from rayeval.actors.errors import RayEvalError
from rayeval.actors.layout import DeviceKind
from rayeval.service.engine.dispatch.cluster import connect, embedded_cpus, preflight
from rayeval.service.engine.runner import _simple_evaluate_kwargs, resolve_tasks
from rayeval.service.parity import Judgement, Spread
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions

logger = logging.getLogger(__name__)


def resolve_device(requested: str | None) -> str:
    """What lm-eval hf and the ranks run on: ``cpu`` or ``cuda`` as asked; ``auto`` (or None):
    ``cuda`` where this machine has a GPU, else ``cpu``."""
    if requested in (None, "", "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(requested).split(":")[0]


@dataclass(frozen=True)
class Samples:
    """What every run of one parity check shares: lm-eval's configuration and its resolved tasks
    (the same documents, prompts and few-shot examples for each run)."""

    config: EvaluationConfig
    host: HostOptions
    evaluator: EvaluatorConfig
    task_manager: TaskManager

    @classmethod
    def resolve(cls, config: EvaluationConfig, host: HostOptions) -> Samples:
        """The tasks of ``config``, resolved as ``lm_eval run`` resolves them.

        Raises:
            ConfigError: unknown tasks, or options lm-eval refuses (the message names them).
        """
        evaluator = config.evaluator_config(host)
        return cls(config, host, evaluator, resolve_tasks(evaluator))

    def evaluate(self, model: Any, **overrides: Any) -> dict[str, Any]:
        """``lm_eval.simple_evaluate`` of ``model`` (``"hf"`` or an ``LM``) on these samples,
        with ``overrides`` (batch size, device) over ``lm_eval run``'s arguments; samples are
        always logged (in memory: nothing is written)."""
        from lm_eval import simple_evaluate

        kwargs = _simple_evaluate_kwargs(self.config, self.evaluator, self.task_manager)
        kwargs["log_samples"] = True
        results: dict[str, Any] = simple_evaluate(model=model, **(kwargs | overrides))
        return results


def hf_spread(samples: Samples, batch_sizes: Sequence[int], device: str) -> Spread:
    """lm-eval hf on ``samples`` at each of ``batch_sizes``, on ``device``.

    Returns:
        The runs, as :class:`~rayeval.service.parity.Spread` (its ``dtype`` is the one asked for
        in the model args; :func:`check_layouts` judges with the model's resolved dtype).
    """
    runs = []
    for size in batch_sizes:
        logger.info("lm-eval hf at batch size %d on %s", size, device)
        runs.append(samples.evaluate("hf", batch_size=size, max_batch_size=None, device=device))
    config = samples.config
    dtype = str(config.model_args.get("dtype", "auto"))
    label = f"{Path(config.pretrained).name} {dtype}"
    return Spread(label, dtype, tuple(batch_sizes), tuple(runs))


@dataclass(frozen=True)
class LayoutCheck:
    """One layout's outcome: judged against lm-eval hf's spread, or refused by rayeval before it
    ran (``refused``: the message), or run but not paired with lm-eval hf's samples
    (``unpaired``: what differed).

    Attributes:
        label: The layout as the user wrote it (``1x2:tp``).
        strategy: How its replicas sharded the model (``fsdp``, ``tp``; None unsharded or not run).
        seconds: How long the layout took (placing, loading, evaluating).
    """

    label: str
    judgement: Judgement | None = None
    strategy: str | None = None
    refused: str | None = None
    unpaired: str | None = None
    seconds: float = 0.0

    @property
    def holds(self) -> bool:
        """Judged, and no further from lm-eval hf than lm-eval hf is from itself."""
        return self.judgement is not None and self.judgement.holds

    def to_json(self) -> dict[str, Any]:
        """The outcome as plain JSON (``rayeval parity --output_path``)."""
        judged = self.judgement
        return {
            "layout": self.label,
            "strategy": self.strategy,
            "holds": self.holds,
            "refused": self.refused,
            "unpaired": self.unpaired,
            "seconds": round(self.seconds, 3),
            "nearest": dict(judged.nearest) if judged else None,
            "beyond": dict(judged.beyond) if judged else None,
            "where": list(judged.where) if judged else None,
        }


def check_layouts(
    spread: Spread,
    samples: Samples,
    configs: Mapping[str, EvaluationConfig],
    oversubscribe: bool = False,
) -> Iterator[LayoutCheck]:
    """rayeval at each layout of ``configs`` (label to evaluation), judged against ``spread``.

    Every layout is checked against this machine first (:func:`preflight`, for an embedded Ray);
    Ray is then joined, or started here with room for the largest layout that fits. A layout
    rayeval refuses (a :class:`RayEvalError`: too large, a strategy the model cannot take) is
    reported as refused and the next one runs.

    Yields:
        One :class:`LayoutCheck` per layout, in order, as each finishes.
    """
    refused: dict[str, str] = {}
    for label, config in configs.items():
        try:
            preflight(config, samples.host.address, oversubscribe)
        except RayEvalError as exc:
            refused[label] = str(exc)
    placeable = [config for label, config in configs.items() if label not in refused]
    if placeable:
        cpus = max(embedded_cpus(config.layout(DeviceKind.CPU)) for config in placeable)
        connect(samples.host.address, embedded_cpus=cpus)
    for label, config in configs.items():
        if label in refused:
            yield LayoutCheck(label, refused=refused[label])
        else:
            yield check_layout(spread, replace(samples, config=config), label)


def check_layout(spread: Spread, samples: Samples, label: str) -> LayoutCheck:
    """rayeval at ``samples.config``'s layout, judged against ``spread`` in the model's dtype."""
    from rayeval.service.engine.lm import RayEvalLM

    started = time.monotonic()
    config = samples.config
    logger.info("rayeval at layout %s", label)
    try:
        # lm-eval may have changed model args (--trust_remote_code): the engine uses its copy.
        engine_config = config.model_copy(update={"model_args": dict(samples.evaluator.model_args)})
        with RayEvalLM.from_config(engine_config, samples.host) as lm:
            ours = samples.evaluate(lm)
            engine = lm.engine
            strategy = engine.shard_strategy.value if engine.layout.sharded else None
            dtype = str(engine.dtype).removeprefix("torch.")
    except RayEvalError as exc:
        return LayoutCheck(label, refused=str(exc), seconds=time.monotonic() - started)
    seconds = time.monotonic() - started
    try:
        judgement = replace(spread, dtype=dtype).judge(ours)
    except AssertionError as exc:  # parity's way to say two runs did not answer the same samples
        return LayoutCheck(label, strategy=strategy, unpaired=str(exc), seconds=seconds)
    return LayoutCheck(label, judgement, strategy, seconds=seconds)
