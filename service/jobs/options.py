"""How the evaluation manager runs evaluations: the server's side of following and admitting.

:class:`ManagerOptions` is what the server's settings (:class:`rayeval.api.settings.Settings`,
``rayeval serve``'s flags) set for :class:`rayeval.service.jobs.manager.EvaluationManager`:
polling, the server's timeouts, the request policy, the response cache, warm replicas and the
experiment trackers. An evaluation's own waits are its config's
(:class:`rayeval.service.vocabulary.config.TimeoutSettings`). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayeval.service.jobs.validation import ServerPolicy
from rayeval.service.trackers import Trackers


@dataclass(frozen=True)
class ManagerOptions:
    """How the manager runs evaluations.

    Args:
        namespace: Ray namespace of the runner actors (fixed, so a restarted API finds them).
        poll_interval_s: Pause between two rounds of polling and admission.
        runner_unreachable_s: A runner that does not answer for this long fails its evaluation
            (it includes the runner actor's start).
        cancel_timeout_s: Bound on waiting for Ray to release an ended or cancelled evaluation.
        task_index_wait_s: Bound on waiting for lm-eval's task index when validating tasks.
        policy: What a request may do (models, remote code, generation settings).
        response_cache: Path prefix of the response cache runners read and fill (None: none).
        stall_timeout_s: An evaluation whose runner reports nothing new for this long, beyond
            its own load (before the first batch) or step timeout, fails naming where it
            stopped, and is released.
        warm_replicas: Most runners kept loaded after their evaluation succeeded, for the next
            evaluation of the same model and layout (0: release at once).
        runner_scan_timeout_s: Bound on waiting for the runner actors found at start to say
            which evaluation they run (re-attaching after a restart).
        trackers: The experiment trackers evaluations that ask to be tracked are recorded in.
        rank_niceness: The OS niceness of the rank processes (None: Ray's default for its
            workers, 15), so that on a node shared with the API server, the runners and the
            database, compute yields to them.
    """

    namespace: str = "rayeval"
    poll_interval_s: float = 0.5
    runner_unreachable_s: float = 120.0
    cancel_timeout_s: float = 30.0
    task_index_wait_s: float = 20.0
    policy: ServerPolicy = field(default_factory=ServerPolicy)
    response_cache: str | None = None
    stall_timeout_s: float = 1800.0
    warm_replicas: int = 0
    runner_scan_timeout_s: float = 10.0
    trackers: Trackers = field(default_factory=Trackers)
    rank_niceness: int | None = None
