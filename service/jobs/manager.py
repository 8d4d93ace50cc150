"""The evaluation manager: submission, the follow-and-admit loop, cancellation and recovery.

One :class:`EvaluationManager` per API process. Submissions are checked
(:mod:`rayeval.service.jobs.validation`) and stored as ``queued``; a background thread then, every
``poll_interval_s``:

1. asks each active evaluation's runner actor for its new events without waiting for slow ones
   (at most one call per runner in flight, a round waits a fraction of a second for answers),
   stores progress (and a sweep's checkpoints as they end), and on the runner's final event
   lm-eval's result and sample files, which it carries, and the terminal state, in one go;
2. admits queued evaluations (:mod:`rayeval.service.jobs.scheduler`: fair share of the queue,
   warm replicas where it can, preemption of preemptible evaluations for a more urgent one).

Every operation acts for a caller (:class:`rayeval.service.jobs.accounts.Principal`): members
submit and act on their own evaluations, viewers only read, admins do everything; what a caller
may not see answers as an unknown id. Submissions, cancels, retries and preemptions go to the
audit trail.

Around it: what the manager knows of each evaluation beyond the database is one object per
evaluation (:mod:`rayeval.service.jobs.followed`); when a followed evaluation fails is decided by
policies (:mod:`rayeval.service.jobs.following`), as admission is by
:func:`rayeval.service.jobs.admission.plan`; warm replicas (runners kept loaded for the next
evaluation of the same model and layout) are :class:`rayeval.service.jobs.kept.KeptRunners`; what a
restarted API does with what the previous one left is :mod:`rayeval.service.jobs.recovery`.

Releasing an ended evaluation's actors and placement group waits for Ray, so the loop hands it to
a small pool and goes on: no thread is held for long by one evaluation. A cancel releases in the
request's own thread (bounded) and answers once Ray shows nothing left. On start, evaluations that
were active are re-attached when their detached runner actor still exists, else marked failed.
No torch here (runner actors import it in their own process).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import ray

from rayeval.actors.errors import ConfigError
from rayeval.service.engine.dispatch.cluster import pick_device
from rayeval.service.engine.dispatch.warm import replica_key
from rayeval.service.jobs.accounts import (
    BUILTIN_PRINCIPAL,
    Principal,
    Share,
    check_access,
    read_only,
)
from rayeval.service.jobs.admission import Kept
from rayeval.service.jobs.audit import Action, submission
from rayeval.service.jobs.fairness import over_cap
from rayeval.service.jobs.followed import FollowedEvaluations
from rayeval.service.jobs.following import (
    RUNNER_GONE,
    RUNNER_GONE_AT_START,
    Watch,
    digest,
    runner_died,
    task_results,
    verdict,
)
from rayeval.service.jobs.kept import KeptRunners
from rayeval.service.jobs.options import ManagerOptions
from rayeval.service.jobs.ray_resources import Releaser, brief, find_runner
from rayeval.service.jobs.recovery import plan_recovery, scan_runners
from rayeval.service.jobs.scheduler import Scheduler
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore
from rayeval.service.jobs.tasks import TaskCatalog
from rayeval.service.jobs.validation import check_submission
from rayeval.service.vocabulary.config import EvaluationConfig
from rayeval.service.vocabulary.errors import (
    EvaluationNotFoundError,
    EvaluationStateError,
    PermissionDeniedError,
)
from rayeval.service.vocabulary.events import (
    PreemptedEvent,
    RunnerEvent,
    RunnerSucceeded,
    RunOutputs,
)
from rayeval.service.vocabulary.states import EvaluationStatus

__all__ = ["EvaluationManager", "ManagerOptions"]

logger = logging.getLogger(__name__)

#: How long one round waits for runners' answers (unanswered calls stay in flight).
_ANSWER_WAIT_S = 0.2


class EvaluationManager:
    """Validates, queues, starts, follows and cancels evaluations (one per API process).

    Args:
        store: The service's database.
        catalog: The task names evaluations may use.
        options: Intervals and timeouts.
    """

    def __init__(
        self, store: EvaluationStore, catalog: TaskCatalog, options: ManagerOptions
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._options = options
        # Guards admission, terminal transitions and the start of a cancel.
        self._lock = threading.Lock()
        self._followed = FollowedEvaluations()
        self._releaser = Releaser(options.cancel_timeout_s)
        self._kept = KeptRunners(options.warm_replicas, self._releaser.later)
        self._scheduler = Scheduler(
            store,
            self._followed,
            self._kept,
            options,
            list(catalog.include_paths),
            self._lock,
            self._preempt,
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Re-attach or fail the evaluations a previous API process left active; start polling."""
        self._recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rayeval-manager", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop polling (runners keep running, re-attached at the next start); free kept ones."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("the manager thread did not stop within %.0fs", timeout_s)
            self._thread = None
        self._kept.release_all(self._releaser.now)
        self._releaser.shutdown()

    # ------------------------------------------------------------------- operations
    def submit(
        self, config: EvaluationConfig, caller: Principal = BUILTIN_PRINCIPAL
    ) -> EvaluationRecord:
        """Check an evaluation against the server, the cluster and the caller's cap, then queue
        it as the caller's.

        Raises:
            PermissionDeniedError: the caller only reads (a viewer).
            ConfigError: bad model, tasks or options (every problem in one message), or a
                layout over the caller's cap of ranks.
            LayoutError: the layout can never fit the cluster (requested vs available).
            ServiceNotReadyError: the task index is not ready yet (retry shortly).
        """
        if not caller.may_change:
            raise PermissionDeniedError(read_only(caller))
        record = self._queue(config, caller.name)
        self._store.audit.record(caller.name, Action.SUBMIT, record.id, submission(config))
        return record

    def retry(self, evaluation_id: str, caller: Principal = BUILTIN_PRINCIPAL) -> EvaluationRecord:
        """Queue a failed or cancelled evaluation again, as a new evaluation of the same owner
        with its config.

        With the server's response cache, the new run takes every answer the old one computed
        from it and computes only the rest.

        Raises:
            EvaluationNotFoundError: unknown id, or one the caller may not see.
            PermissionDeniedError: the caller only reads.
            EvaluationStateError: the evaluation has not failed or been cancelled.
        """
        record = check_access(self._store.get(evaluation_id), caller, change=True)
        if record.status not in (EvaluationStatus.FAILED, EvaluationStatus.CANCELLED):
            raise EvaluationStateError(
                f"evaluation {evaluation_id} is {record.status.value}: only a failed or "
                "cancelled evaluation can be retried"
            )
        retried = self._queue(record.config, record.owner)
        self._store.audit.record(caller.name, Action.RETRY, retried.id, {"of": evaluation_id})
        logger.info("evaluation %s retries %s", retried.id, evaluation_id)
        return retried

    def _queue(self, config: EvaluationConfig, owner: str) -> EvaluationRecord:
        """Check and store an evaluation of ``owner``; admission is woken."""
        config = config.with_device(pick_device(config.device))
        config = check_submission(
            config,
            self._catalog,
            ray.cluster_resources(),
            self._options.task_index_wait_s,
            self._options.policy,
            node_totals=[node["Resources"] for node in ray.nodes() if node["Alive"]],
        )
        layout = config.layout()
        capped = over_cap(layout.world, owner, self._store.accounts.shares().get(owner, Share()))
        if capped is not None:
            raise ConfigError(capped)
        record = self._store.create(config.to_json(), layout.total_resources(), owner)
        logger.info(
            "queued evaluation %s of %s (%s, tasks %s)",
            record.id,
            owner,
            layout.describe(),
            config.tasks,
        )
        self._wake.set()  # admit now, not at the next round
        return record

    def queue_position(self, record: EvaluationRecord) -> int | None:
        """1 for the next evaluation fair share offers to admission; None unless queued."""
        if record.status is not EvaluationStatus.QUEUED:
            return None
        return self._scheduler.position(record.id) or self._store.queue_position(record)

    def cancel(self, evaluation_id: str, caller: Principal = BUILTIN_PRINCIPAL) -> EvaluationRecord:
        """Cancel an evaluation; return it once Ray has released it (bounded wait).

        Raises:
            EvaluationNotFoundError: unknown id, or one the caller may not see.
            PermissionDeniedError: the caller only reads.
            EvaluationStateError: the evaluation already ended.
        """
        with self._lock:
            record = check_access(self._store.get(evaluation_id), caller, change=True)
            if record.status.is_terminal:
                raise EvaluationStateError(
                    f"evaluation {evaluation_id} already {record.status.value}: nothing to cancel"
                )
            self._store.audit.record(caller.name, Action.CANCEL, evaluation_id)
            if record.status is EvaluationStatus.QUEUED:
                self._store.transition(
                    evaluation_id, EvaluationStatus.CANCELLED, only_from=[EvaluationStatus.QUEUED]
                )
                self._followed.drop(evaluation_id)
                return self._store.get(evaluation_id)
            self._followed[evaluation_id].cancelling = True
        try:
            note = (
                None
                if self._release(evaluation_id)
                else (
                    f"cancelled, but Ray had not released every actor within "
                    f"{self._options.cancel_timeout_s:g}s; check `ray list actors`"
                )
            )
            self._store.transition(evaluation_id, EvaluationStatus.CANCELLED, error=note)
            logger.info("cancelled evaluation %s", evaluation_id)
        finally:
            with self._lock:
                self._followed.drop(evaluation_id)
        return self._store.get(evaluation_id)

    def _preempt(self, victim: EvaluationRecord, head: EvaluationRecord) -> None:
        """Release a running preemptible evaluation and queue it again, for ``head``."""
        with self._lock:
            followed = self._followed[victim.id]
            if followed.cancelling:
                return
            followed.cancelling = True  # nothing else ends it meanwhile
        try:
            logger.info("preempting %s to make room for %s", victim.id, head.id)
            if self._release(victim.id):
                self._store.requeue(
                    victim.id, PreemptedEvent(by=head.id, done=victim.progress.done)
                )
            else:
                error = (
                    f"preempted for {head.id}, but Ray had not released every actor within "
                    f"{self._options.cancel_timeout_s:g}s; check `ray list actors` and retry it"
                )
                self._store.transition(victim.id, EvaluationStatus.FAILED, error=error)
            self._store.audit.record("scheduler", Action.PREEMPT, victim.id, {"by": head.id})
        finally:
            with self._lock:
                self._followed.drop(victim.id)

    # ----------------------------------------------------------------- background loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._options.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._follow_active()
                self._forget_ended()
                self._scheduler.admit()
            except Exception:  # one bad round must not stop the service
                logger.exception("manager round failed; retrying")

    def _forget_ended(self) -> None:
        """Drop what is known of evaluations that are neither queued nor active any more."""
        waiting = {record.id for record in (*self._store.active(), *self._store.queued())}
        with self._lock:  # a cancel marks its evaluation under the same lock
            self._followed.keep_only(waiting)

    def _follow_active(self) -> None:
        """Ask every active runner for its new events; apply the answers that are back; fail
        what the watchdog says failed.

        At most one call per runner is in flight and a round waits only briefly for answers, so
        a runner that is slow to start (or stuck) delays neither the others nor admission.
        """
        for record in self._store.active():
            followed = self._followed[record.id]
            if followed.call is not None or self._is_cancelling(record.id):
                continue
            runner = self._runner(record.id)
            if runner is None:
                self._fail(record.id, RUNNER_GONE)
                continue
            call = runner.events_since.remote(record.runner_cursor, record.id)
            followed.ask(call, time.monotonic())
        self._collect_answers()
        self._watch(self._store.active())

    def _collect_answers(self) -> None:
        """Apply the events of the calls answered within a fraction of a second."""
        calls = {followed.call: followed for followed in self._followed.asking()}
        if not calls:
            return
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=_ANSWER_WAIT_S)
        for call in answered:
            followed = calls[call]
            followed.answered()
            record = self._store.get(followed.evaluation_id)
            if not record.status.is_active or self._is_cancelling(record.id):
                continue
            try:
                events = ray.get(call, timeout=0)
            except ray.exceptions.RayError as exc:
                self._fail(record.id, runner_died(brief(exc)))
                continue
            if events:
                followed.heard_at = time.monotonic()
                self._apply(record, events)

    def _watch(self, active: list[EvaluationRecord]) -> None:
        """Fail active evaluations whose runner does not answer, or answers but reports no
        progress (a stuck metric, a hung child process): no event says either."""
        now = time.monotonic()
        for record in active:
            if self._is_cancelling(record.id):
                continue
            followed = self._followed[record.id]
            if followed.heard_at is None:
                followed.heard_at = now
            watch = Watch.of(record, now, followed.heard_at, followed.asked_at)
            options = self._options
            error = verdict(watch, options.stall_timeout_s, options.runner_unreachable_s)
            if error is not None:
                followed.answered()
                self._fail(record.id, error)

    def _is_cancelling(self, evaluation_id: str) -> bool:
        with self._lock:
            followed = self._followed.get(evaluation_id)
            return followed is not None and followed.cancelling

    def _apply(self, record: EvaluationRecord, events: list[RunnerEvent]) -> None:
        digested = digest(record.progress, events)
        if digested.moved and record.status is EvaluationStatus.STARTING:
            self._store.transition(record.id, EvaluationStatus.RUNNING)
        self._store.record_progress(
            record.id, digested.progress, digested.cursor, digested.events, digested.checkpoints
        )
        if isinstance(digested.ended, RunnerSucceeded):
            self._succeed(record, digested.ended.outputs)
        elif digested.ended is not None:
            self._fail(record.id, digested.ended.error, digested.ended.traceback)

    def _succeed(self, record: EvaluationRecord, outputs: RunOutputs) -> None:
        events = task_results(outputs.results_json)
        with self._lock:
            if self._followed[record.id].cancelling:
                return
            stored = self._store.finish_succeeded(
                record.id, outputs.results_json, outputs.samples, outputs.stats, events
            )
        if stored:
            logger.info("evaluation %s succeeded", record.id)
        if not (stored and outputs.replicas.kept and self._kept.enabled):
            self._release_later(record.id)
            return
        owner, handle = self._let_go(record.id)
        if handle is None:  # gone: release what is left by the owner's names
            self._releaser.later(owner, handle)
            return
        self._kept.keep(Kept(owner, replica_key(record.config), dict(record.resources)), handle)

    def _fail(self, evaluation_id: str, error: str, traceback: str | None = None) -> None:
        with self._lock:
            if self._followed[evaluation_id].cancelling:
                return
            failed = self._store.transition(
                evaluation_id, EvaluationStatus.FAILED, error=error, traceback=traceback
            )
        if failed:
            logger.warning("evaluation %s failed: %s", evaluation_id, error)
        self._release_later(evaluation_id)

    # ------------------------------------------------------------------- Ray actors
    def _runner(self, evaluation_id: str) -> Any | None:
        """The evaluation's runner handle, found by name if not known yet (None: gone)."""
        followed = self._followed[evaluation_id]
        if followed.runner is None:
            followed.runner = find_runner(evaluation_id, self._options.namespace)
        return followed.runner

    def _ended(self, evaluation_id: str) -> bool | None:
        try:
            return self._store.get(evaluation_id).status.is_terminal
        except EvaluationNotFoundError:
            return None

    def _recover(self) -> None:
        found = scan_runners(self._options.namespace, self._options.runner_scan_timeout_s)
        by_name = functools.partial(find_runner, namespace=self._options.namespace)
        decided = plan_recovery(self._store.active(), found, by_name, self._ended)
        for evaluation_id, runner in decided.attach.items():
            self._followed.follow(evaluation_id, runner.handle, runner.owner, heard=False)
            logger.info("re-attached evaluation %s to its runner actor", evaluation_id)
        for evaluation_id in decided.lost:
            self._fail(evaluation_id, RUNNER_GONE_AT_START)
        for evaluation_id, runner in decided.release:
            logger.info(
                "releasing runner %s (last ran %s): unfollowed", runner.owner, evaluation_id
            )
            self._releaser.later(runner.owner, runner.handle)

    def _let_go(self, evaluation_id: str) -> tuple[str, Any | None]:
        """Stop following the evaluation: whose names its resources carry, and its runner's
        handle if Ray still has it."""
        self._runner(evaluation_id)
        with self._lock:
            followed = self._followed[evaluation_id]
            names, handle = followed.let_go()
            if not followed.cancelling:
                self._followed.drop(evaluation_id)
        return names, handle

    def _release(self, evaluation_id: str) -> bool:
        """Release the evaluation's runner, rank actors and placement group (bounded wait)."""
        return self._releaser.now(*self._let_go(evaluation_id))

    def _release_later(self, evaluation_id: str) -> None:
        """Release in the background: the polling thread does not wait for Ray to let go."""
        self._releaser.later(*self._let_go(evaluation_id))
