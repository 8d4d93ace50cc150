"""Loaded replicas carried from one evaluation to the next of the same model and layout.

Starting rank processes and loading the model is most of an evaluation's start-up. The service
may keep an evaluation's worker group after it succeeds (:class:`KeptReplicas`) and hand it to
the next evaluation whose :func:`replica_key` is the same: everything that decides what the
ranks hold and how they compute — the model's fingerprint (path or hub id made absolute, every
model argument such as ``revision`` and ``dtype``, the model's defining files and the size, time
and head of its weight files), the device, the layout and the collective timeout. The ranks are
re-seeded for every evaluation (:meth:`rayeval.actors.group.WorkerGroup.begin_evaluation`), so
results are the same warm or cold. torch-free: the service computes keys too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayeval.service.engine.response_cache import model_fingerprint
from rayeval.service.vocabulary.config import EngineConfig, EvaluationConfig

if TYPE_CHECKING:
    from rayeval.actors.group import WorkerGroup

logger = logging.getLogger(__name__)


def replica_key(config: EngineConfig | dict[str, Any]) -> str:
    """What a kept group must match to serve an evaluation (a hex digest).

    Args:
        config: The evaluation's config, or its ``to_json()`` form (as the service stores it).
    """
    if isinstance(config, dict):
        config = EvaluationConfig.from_json(config)
    payload = {
        "model": model_fingerprint(config.model_args),
        "device": config.device,
        "parallelism": config.parallelism.model_dump(mode="json"),
        "collective_s": config.timeouts.collective_s,
        "logits_budget_mib": config.logits_budget_mib,
        # A sweep starts its own ranks and keeps none: no kept group ever serves one.
        "sweep": getattr(config, "sweep", None) is not None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class KeptReplicas:
    """A slot for a loaded worker group, shared by the evaluations of one runner.

    Given to :class:`rayeval.service.engine.lm.RayEvalLM`: a group here whose ``key`` matches is
    used instead of starting ranks; with ``keep``, the group of an evaluation that succeeds is left
    here instead of shut down (a failed evaluation always shuts its group down).

    Attributes:
        keep: Keep the group after a successful evaluation.
        group: The kept group, if any.
        key: Its :func:`replica_key`.
        reused: Whether the last evaluation ran on a kept group.
    """

    keep: bool = False
    group: WorkerGroup | None = None
    key: str | None = None
    reused: bool = False

    def take(self, key: str) -> WorkerGroup | None:
        """The kept group if it matches ``key`` (it leaves the slot); a mismatch is shut down."""
        group, self.group = self.group, None
        if group is not None and self.key != key:
            group.shutdown()
            group = None
        self.key = None
        return group

    def take_ready(self, key: str, seed: int, timeout_s: float) -> WorkerGroup | None:
        """The kept group if it matches ``key`` and its ranks answer, seeded for a new
        evaluation with ``seed``; None otherwise (a group that does not answer is shut down).
        Records in :attr:`reused` whether a group was handed out."""
        from rayeval.actors.errors import RayEvalError

        group = self.take(key)
        if group is not None:
            try:
                group.begin_evaluation(seed, timeout_s=timeout_s)
            except RayEvalError as exc:
                logger.warning("the kept replicas cannot be reused (%s): starting new ones", exc)
                group.shutdown()
                group = None
        self.reused = group is not None
        return group

    def put(self, group: WorkerGroup, key: str) -> None:
        """Keep ``group`` (loaded for ``key``) for the next evaluation."""
        if self.group is not None and self.group is not group:
            self.group.shutdown()
        self.group, self.key = group, key

    def shutdown(self) -> None:
        """Release the kept group, if any."""
        if self.group is not None:
            self.group.shutdown()
        self.group, self.key = None, None
