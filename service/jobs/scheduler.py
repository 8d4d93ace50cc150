"""One admission round of the manager: fair order, warm replicas, preemption, starting runners.

Every round the queue is ordered by fair share (:func:`rayeval.service.jobs.fairness.fair_order`:
each user in turn by weight, priorities within a user's queue, caps), then admitted
(:func:`rayeval.service.jobs.admission.plan`): evaluations start on kept replicas of their model
and layout or on new runners while the cluster has room; kept replicas the head of the queue needs
are released, and only then running preemptible evaluations of lower priority are preempted for
it (the manager releases them and puts them back in the queue); until it starts, that head goes
first, so the preempted ones cannot take the room back. The order is kept for
``queue_position``. Used by the manager's polling thread. No torch here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rayeval.service.engine.dispatch.warm import replica_key
from rayeval.service.jobs.admission import free_resources, plan
from rayeval.service.jobs.fairness import FairOrder, fair_order, held_ranks, room_made_first
from rayeval.service.jobs.followed import FollowedEvaluations
from rayeval.service.jobs.kept import KeptRunners
from rayeval.service.jobs.options import ManagerOptions
from rayeval.service.jobs.ray_resources import brief
from rayeval.service.jobs.runner_actor import launch_runner
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore
from rayeval.service.vocabulary.states import EvaluationStatus

logger = logging.getLogger(__name__)

#: Preempts a running evaluation for the head of the queue: ``preempt(victim, head)``.
Preempt = Callable[[EvaluationRecord, EvaluationRecord], None]
#: How long no more room is made for a head that room was made for (Ray's view catching up).
ROOM_GRACE_S = 30.0


class Scheduler:
    """Admits queued evaluations, one round at a time.

    Args:
        store: The service's database.
        followed: The manager's per-evaluation state.
        kept: The kept runners.
        options: The manager's options (namespace, response cache, ...).
        include_paths: The server's task directories (for new runners).
        lock: The manager's lock: a start happens under it, so a cancel sees either a queued
            evaluation or a runner handle.
        preempt: Releases a running evaluation and queues it again.
    """

    def __init__(
        self,
        store: EvaluationStore,
        followed: FollowedEvaluations,
        kept: KeptRunners,
        options: ManagerOptions,
        include_paths: list[str],
        lock: threading.Lock,
        preempt: Preempt,
    ) -> None:
        self._store = store
        self._followed = followed
        self._kept = kept
        self._options = options
        self._include_paths = include_paths
        self._lock = lock
        self._preempt = preempt
        self._positions: dict[str, int] = {}
        self._made_room: dict[str, float] = {}
        #: When each user last had an evaluation started (fair share's tie-break; from 0 again
        #: after a restart).
        self._served: dict[str, int] = {}
        self._starts = 0

    def position(self, evaluation_id: str) -> int | None:
        """The evaluation's place in the last round's fair order (None: not known)."""
        return self._positions.get(evaluation_id)

    def admit(self) -> None:
        """One round: order the queue, release and preempt what the head needs, start."""
        queued = self._store.queued()
        if not queued:
            self._positions = {}
            return
        active = self._store.active()
        now = time.monotonic()
        self._made_room = {i: t for i, t in self._made_room.items() if now - t < ROOM_GRACE_S}
        shares = self._store.accounts.shares()
        fair = fair_order(queued, held_ranks(active), shares, self._served)
        fair = room_made_first(fair, self._made_room)
        kept = self._kept.entries()
        free = free_resources(active, self._followed.owners(), kept)
        decided = plan(fair.order, free, kept, self._key_of, active, self._made_room)
        starting = {record.id for record, _ in decided.start}
        left = [record for record in fair.order if record.id not in starting]
        self._positions = FairOrder(left, fair.capped).positions
        for freed in decided.release:
            logger.info(
                "releasing the kept replicas of %s: a queued evaluation needs room", freed.owner
            )
            self._kept.release(freed.owner)
        if decided.preempt and decided.head is not None:
            self._made_room[decided.head.id] = now
            for victim in decided.preempt:
                self._preempt(victim, decided.head)
        for record, entry in decided.start:
            with self._lock:
                if not self._store.transition(record.id, EvaluationStatus.STARTING):
                    continue
                self._starts += 1
                self._served[record.owner] = self._starts
                if entry is None or not self._start_on_kept(record, entry.owner):
                    self._start_runner(record)
            self._made_room.pop(record.id, None)

    def _key_of(self, record: EvaluationRecord) -> str:
        followed = self._followed[record.id]
        if followed.key is None:
            followed.key = replica_key(record.config)
        return followed.key

    def _start_on_kept(self, record: EvaluationRecord, owner: str) -> bool:
        """Run ``record`` on the runner kept by ``owner``; False (and it is released) if not."""
        timeout_s = record.config.timeouts.control_s
        handle = self._kept.hand_over(owner, record.id, record.config.to_json(), timeout_s)
        if handle is None:
            return False
        self._followed.follow(record.id, handle, owner, heard=True)
        logger.info("started evaluation %s on the replicas kept by %s", record.id, owner)
        return True

    def _start_runner(self, record: EvaluationRecord) -> None:
        handle: Any
        try:
            handle = launch_runner(
                record.id,
                record.config.to_json(),
                self._options.namespace,
                self._include_paths,
                self._options.response_cache,
                self._kept.enabled,
                self._options.trackers,
                self._options.rank_niceness,
                self._options.policy.allow_code_execution,
            )
        except Exception as exc:  # e.g. a bad runtime_env: the evaluation cannot start
            error = f"could not start the runner actor: {brief(exc)}"
            self._store.transition(record.id, EvaluationStatus.FAILED, error=error)
            return
        self._followed.follow(record.id, handle, record.id, heard=True)
        logger.info("started evaluation %s", record.id)
