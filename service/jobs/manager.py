"""The evaluation manager: submission, the follow-and-admit loop, cancellation and recovery.

One :class:`EvaluationManager` per API process. Submissions are checked
(:mod:`rayeval.service.jobs.validation`) and stored as ``queued``; a background thread then, every
``poll_interval_s``:

1. asks each active evaluation's runner actor for its new events without waiting for slow ones
   (at most one call per runner in flight, a round waits a fraction of a second for answers),
   stores progress, and on the runner's final event stores lm-eval's result and sample files —
   which that event carries — and the terminal state in one transaction;
2. admits queued evaluations (:mod:`rayeval.service.jobs.admission`), on warm replicas where it can.

Warm replicas (``warm_replicas`` > 0): the runner of an evaluation that succeeded keeps its loaded
ranks and placement group; the next evaluation of the same model and layout
(:func:`rayeval.service.engine.warm.replica_key`) runs on that runner without starting or loading
anything. At most ``warm_replicas`` runners are kept; they are released when a queued evaluation
needs their room (oldest first), and when the manager stops. An evaluation on a kept runner is
known by its owner: the evaluation whose names the runner, ranks and placement group carry.

Releasing an ended evaluation's actors and placement group waits for Ray, so the loop hands it to
a small pool and goes on: no thread is held for long by one evaluation. A cancel releases in the
request's own thread (bounded) and answers once Ray shows nothing left. On start, evaluations that
were active are re-attached when their detached runner actor still exists, else marked failed.
No torch here: runners are created from a class reference and import torch in their own process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from rayeval.actors.process import runner_environment
from rayeval.service.config import EvaluationConfig
from rayeval.service.engine.cluster import pick_device
from rayeval.service.engine.warm import replica_key
from rayeval.service.errors import EvaluationNotFoundError, EvaluationStateError
from rayeval.service.events import (
    PhaseReport,
    ProgressEvent,
    RunnerEvent,
    RunnerFailed,
    RunnerProgress,
    RunnerStatus,
    RunnerSucceeded,
    RunnerWarning,
    RunOutputs,
    TaskResultEvent,
    WarningEvent,
)
from rayeval.service.jobs.admission import Kept, free_resources, plan
from rayeval.service.jobs.ray_resources import brief, release, runner_name
from rayeval.service.jobs.runner_actor import EvaluationRunner
from rayeval.service.jobs.states import EvaluationStatus
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore, NewEvent
from rayeval.service.jobs.tasks import TaskCatalog
from rayeval.service.jobs.validation import ServerPolicy, check_submission

logger = logging.getLogger(__name__)

#: How long one round waits for runners' answers (unanswered calls stay in flight).
_ANSWER_WAIT_S = 0.2


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
        self._lock = threading.Lock()  # guards admission, terminal transitions and _cancelling
        self._cancelling: set[str] = set()
        self._runners: dict[str, Any] = {}
        # Owned by the polling thread: evaluation id -> (pending events_since call, sent at),
        # and when its runner last reported something new.
        self._inflight: dict[str, tuple[Any, float]] = {}
        self._heard: dict[str, float] = {}
        # Evaluations running on a kept runner -> the evaluation that owns its resources.
        self._owners: dict[str, str] = {}
        # Kept runners, least recently kept first: owner -> (kept replicas, runner handle).
        self._kept: OrderedDict[str, tuple[Kept, Any]] = OrderedDict()
        self._keys: dict[str, str] = {}  # queued evaluation -> replica key
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._releaser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rayeval-release")

    # -------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Re-attach or fail the evaluations a previous API process left active; start polling."""
        self._recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rayeval-manager", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop polling (runner actors keep running and are re-attached by the next start);
        release the kept runners."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("the manager thread did not stop within %.0fs", timeout_s)
            self._thread = None
        for owner, (_, handle) in list(self._kept.items()):
            release(owner, handle, self._timeout_s)
        self._kept.clear()
        self._releaser.shutdown(wait=False)

    # ------------------------------------------------------------------- operations
    def submit(self, config: EvaluationConfig) -> EvaluationRecord:
        """Check an evaluation against the server and the cluster, then queue it.

        Raises:
            ConfigError: bad model, tasks or options (every problem in one message).
            LayoutError: the layout can never fit the cluster (requested vs available).
            ServiceNotReadyError: the task index is not ready yet (retry shortly).
        """
        config = config.with_device(pick_device(config.device))
        check_submission(
            config,
            self._catalog,
            ray.cluster_resources(),
            self._options.task_index_wait_s,
            self._options.policy,
            node_totals=[node["Resources"] for node in ray.nodes() if node["Alive"]],
        )
        layout = config.layout()
        record = self._store.create(config.to_json(), layout.total_resources())
        logger.info(
            "queued evaluation %s (%s, tasks %s)", record.id, layout.describe(), config.tasks
        )
        self._wake.set()  # admit now, not at the next round
        return record

    def retry(self, evaluation_id: str) -> EvaluationRecord:
        """Queue a failed or cancelled evaluation again, as a new evaluation with its config.

        With the server's response cache, the new run takes every answer the old one computed
        from it and computes only the rest.

        Raises:
            EvaluationNotFoundError: unknown id.
            EvaluationStateError: the evaluation has not failed or been cancelled.
        """
        record = self._store.get(evaluation_id)
        if record.status not in (EvaluationStatus.FAILED, EvaluationStatus.CANCELLED):
            raise EvaluationStateError(
                f"evaluation {evaluation_id} is {record.status.value}: only a failed or "
                "cancelled evaluation can be retried"
            )
        retried = self.submit(EvaluationConfig.from_json(record.config))
        logger.info("evaluation %s retries %s", retried.id, evaluation_id)
        return retried

    def cancel(self, evaluation_id: str) -> EvaluationRecord:
        """Cancel an evaluation; return it once Ray has released it (bounded wait).

        Raises:
            EvaluationNotFoundError: unknown id.
            EvaluationStateError: the evaluation already ended.
        """
        with self._lock:
            record = self._store.get(evaluation_id)
            if record.status.is_terminal:
                raise EvaluationStateError(
                    f"evaluation {evaluation_id} already {record.status.value}: nothing to cancel"
                )
            if record.status is EvaluationStatus.QUEUED:
                self._store.transition(
                    evaluation_id, EvaluationStatus.CANCELLED, only_from=[EvaluationStatus.QUEUED]
                )
                return self._store.get(evaluation_id)
            self._cancelling.add(evaluation_id)
        try:
            released = self._release(evaluation_id)
            note = (
                None
                if released
                else (
                    f"cancelled, but Ray had not released every actor within "
                    f"{self._options.cancel_timeout_s:g}s; check `ray list actors`"
                )
            )
            self._store.transition(evaluation_id, EvaluationStatus.CANCELLED, error=note)
            logger.info("cancelled evaluation %s", evaluation_id)
        finally:
            with self._lock:
                self._cancelling.discard(evaluation_id)
        return self._store.get(evaluation_id)

    # ----------------------------------------------------------------- background loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._options.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._follow_active()
                self._admit()
            except Exception:  # one bad round must not stop the service
                logger.exception("manager round failed; retrying")

    def _admit(self) -> None:
        queued = self._store.queued()
        if not queued:
            return
        kept = [entry for entry, _ in self._kept.values()]
        decided = plan(
            queued, free_resources(self._store.active(), self._owners, kept), kept, self._key_of
        )
        for freed in decided.release:
            logger.info(
                "releasing the kept replicas of %s: a queued evaluation needs room", freed.owner
            )
            self._release_kept(freed.owner)
        for record, entry in decided.start:
            # Under the lock, so that a cancel sees either a queued evaluation or a runner handle.
            with self._lock:
                if self._store.transition(record.id, EvaluationStatus.STARTING):
                    self._keys.pop(record.id, None)
                    if entry is None or not self._start_on_kept(record, entry.owner):
                        self._start_runner(record)

    def _key_of(self, record: EvaluationRecord) -> str:
        key = self._keys.get(record.id)
        if key is None:
            key = self._keys[record.id] = replica_key(record.config)
        return key

    def _start_on_kept(self, record: EvaluationRecord, owner: str) -> bool:
        """Run ``record`` on the runner kept by ``owner``; False (and it is released) if not."""
        _, handle = self._kept.pop(owner)
        timeout_s = EvaluationConfig.from_json(record.config).timeouts.control_s
        try:
            started = ray.get(handle.start_next.remote(record.id, record.config), timeout=timeout_s)
        except Exception as exc:  # the runner died while kept: start anew
            logger.warning("the kept runner of %s cannot be reused: %s", owner, brief(exc))
            started = False
        if not started:
            self._release_in_background(owner, handle)
            return False
        self._runners[record.id] = handle
        self._owners[record.id] = owner
        self._heard[record.id] = time.monotonic()
        logger.info("started evaluation %s on the replicas kept by %s", record.id, owner)
        return True

    def _keep(self, evaluation_id: str, record: EvaluationRecord) -> bool:
        """Keep the evaluation's runner and its loaded ranks for the next evaluation."""
        if self._options.warm_replicas <= 0:
            return False
        handle = self._forget_runner(evaluation_id)
        if handle is None:  # gone: the caller releases by the owner's names
            return False
        owner = self._owners.pop(evaluation_id, evaluation_id)
        entry = Kept(owner, replica_key(record.config), dict(record.resources))
        for other, (kept, _) in list(self._kept.items()):  # one kept runner per key
            if kept.key == entry.key:
                self._release_kept(other)
        self._kept[owner] = (entry, handle)
        while len(self._kept) > self._options.warm_replicas:
            self._release_kept(next(iter(self._kept)))
        logger.info("keeping the replicas of %s loaded for the next evaluation", owner)
        return True

    def _release_kept(self, owner: str) -> None:
        _, handle = self._kept.pop(owner)
        self._release_in_background(owner, handle)

    def _start_runner(self, record: EvaluationRecord) -> None:
        env = runner_environment()
        try:
            handle = (
                ray.remote(EvaluationRunner)
                .options(
                    name=runner_name(record.id),
                    namespace=self._options.namespace,
                    lifetime="detached",
                    get_if_exists=True,
                    num_cpus=0,
                    max_restarts=0,
                    runtime_env={"env_vars": env},
                )
                .remote(
                    record.id,
                    record.config,
                    list(self._catalog.include_paths),
                    self._options.response_cache,
                    self._options.warm_replicas > 0,
                )
            )
        except Exception as exc:  # e.g. a bad runtime_env: the evaluation cannot start
            error = f"could not start the runner actor: {brief(exc)}"
            self._store.transition(record.id, EvaluationStatus.FAILED, error=error)
            return
        self._runners[record.id] = handle
        self._heard[record.id] = time.monotonic()
        logger.info("started evaluation %s", record.id)

    def _follow_active(self) -> None:
        """Ask every active runner for its new events; apply the answers that are back.

        At most one call per runner is in flight and a round waits only briefly for answers, so
        a runner that is slow to start (or stuck) delays neither the others nor admission.
        """
        for record in self._store.active():
            if record.id in self._inflight or self._is_cancelling(record.id):
                continue
            runner = self._runner(record.id)
            if runner is None:
                self._fail(
                    record.id,
                    "the runner actor of this evaluation no longer exists on the Ray cluster (it "
                    "died or the cluster restarted): resubmit the evaluation",
                )
                continue
            call = runner.events_since.remote(record.runner_cursor, record.id)
            self._inflight[record.id] = (call, time.monotonic())
        if not self._inflight:
            return
        calls = {call: evaluation_id for evaluation_id, (call, _) in self._inflight.items()}
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=_ANSWER_WAIT_S)
        for call in answered:
            evaluation_id = calls[call]
            del self._inflight[evaluation_id]
            record = self._store.get(evaluation_id)
            if not record.status.is_active or self._is_cancelling(evaluation_id):
                continue
            try:
                events = ray.get(call, timeout=0)
            except ray.exceptions.RayError as exc:
                self._fail(evaluation_id, f"the runner actor died: {brief(exc)}")
                continue
            if events:
                self._heard[evaluation_id] = time.monotonic()
                self._apply(record, events)
        self._fail_stalled()
        now = time.monotonic()
        for evaluation_id, (_, sent) in list(self._inflight.items()):
            if now - sent > self._options.runner_unreachable_s:
                del self._inflight[evaluation_id]
                self._fail(
                    evaluation_id,
                    f"the runner actor did not answer for {self._options.runner_unreachable_s:g}s:"
                    " check the Ray cluster (dashboard, `ray status`) and resubmit",
                )

    def _fail_stalled(self) -> None:
        """Fail active evaluations whose runner answers but reports no progress (a stuck metric,
        a hung child process): the runner-unreachable check cannot see those."""
        now = time.monotonic()
        for record in self._store.active():
            if self._is_cancelling(record.id):
                continue
            silent = now - self._heard.setdefault(record.id, now)
            timeouts = EvaluationConfig.from_json(record.config).timeouts
            own = (
                timeouts.step_s
                if record.progress.phases
                else timeouts.placement_s + timeouts.load_s
            )
            limit = self._options.stall_timeout_s + own
            if silent > limit:
                self._fail(
                    record.id,
                    f"no progress for {silent:.0f}s (limit {limit:.0f}s: the server's stall "
                    f"timeout plus the evaluation's own timeout); it stopped {_where(record)}. "
                    "Its actors were released; retry it, or raise the stall timeout "
                    "(--stall-timeout) if this step is legitimately slow",
                )

    def _is_cancelling(self, evaluation_id: str) -> bool:
        with self._lock:
            return evaluation_id in self._cancelling

    def _apply(self, record: EvaluationRecord, events: list[RunnerEvent]) -> None:
        latest: dict[str, PhaseReport] = {}
        warnings: list[NewEvent] = []
        ended: RunnerSucceeded | RunnerFailed | None = None
        for event in events:
            if isinstance(event, RunnerProgress):
                latest[event.progress.phase] = PhaseReport.of(event.progress, event.time)
            elif isinstance(event, RunnerWarning):
                warnings.append(WarningEvent.of_warning(event.warning))
            elif ended is None:
                ended = event
        if latest and record.status is EvaluationStatus.STARTING:
            self._store.transition(record.id, EvaluationStatus.RUNNING)
        progress = record.progress.with_reports(latest)
        progress_events: list[NewEvent] = warnings + [
            ProgressEvent.of_phase(report, progress) for report in latest.values()
        ]
        self._store.record_progress(record.id, progress, events[-1].seq, progress_events)
        if isinstance(ended, RunnerSucceeded):
            self._succeed(record.id, ended.outputs)
        elif ended is not None:
            self._fail(record.id, ended.error)

    def _succeed(self, evaluation_id: str, outputs: RunOutputs) -> None:
        results = json.loads(outputs.results_json)  # lm-eval's results file
        events: list[NewEvent] = [
            TaskResultEvent(task=task, metrics=metrics)
            for task, metrics in results.get("results", {}).items()
        ]
        with self._lock:
            if evaluation_id in self._cancelling:
                return
            stored = self._store.finish_succeeded(
                evaluation_id, outputs.results_json, outputs.samples, outputs.stats, events
            )
        if stored:
            logger.info("evaluation %s succeeded", evaluation_id)
        kept = outputs.replicas.kept
        if not (stored and kept and self._keep(evaluation_id, self._store.get(evaluation_id))):
            self._release_later(evaluation_id)

    def _fail(self, evaluation_id: str, error: str) -> None:
        with self._lock:
            if evaluation_id in self._cancelling:
                return
            failed = self._store.transition(evaluation_id, EvaluationStatus.FAILED, error=error)
        if failed:
            logger.warning("evaluation %s failed: %s", evaluation_id, error)
        self._release_later(evaluation_id)

    # ------------------------------------------------------------------- Ray actors
    def _runner(self, evaluation_id: str) -> Any | None:
        handle = self._runners.get(evaluation_id)
        if handle is None:
            try:
                name = runner_name(evaluation_id)
                handle = ray.get_actor(name, namespace=self._options.namespace)
            except ValueError:
                return None
            self._runners[evaluation_id] = handle
        return handle

    def _recover(self) -> None:
        running = self._scan_runners()
        for record in self._store.active():
            found = running.pop(record.id, None)
            if found is not None:
                handle, owner = found
                self._runners[record.id] = handle
                if owner != record.id:
                    self._owners[record.id] = owner
                logger.info("re-attached evaluation %s to its runner actor", record.id)
            elif self._runner(record.id) is not None:
                logger.info("re-attached evaluation %s to its runner actor", record.id)
            else:
                self._fail(
                    record.id,
                    "the API server restarted and the runner actor of this evaluation no longer "
                    "exists on the Ray cluster (the cluster restarted or the runner died): "
                    "resubmit the evaluation",
                )
        for evaluation_id, (handle, owner) in running.items():
            # Kept by the previous API process, or left over. A runner of an evaluation this
            # database does not know belongs to another service on the same cluster: not ours.
            try:
                ended = self._store.get(evaluation_id).status.is_terminal
            except EvaluationNotFoundError:
                continue
            if ended:
                logger.info("releasing runner %s (last ran %s): unfollowed", owner, evaluation_id)
                self._release_in_background(owner, handle)

    def _scan_runners(self) -> dict[str, tuple[Any, str]]:
        """The runner actors alive in this namespace: last evaluation -> (handle, owner)."""
        handles = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == self._options.namespace and entry["name"].startswith(
                runner_name("")
            ):
                with contextlib.suppress(ValueError):  # died meanwhile
                    handles.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        calls: dict[Any, Any] = {handle.current.remote(): handle for handle in handles}
        if not calls:
            return {}
        timeout_s = self._options.runner_scan_timeout_s
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        found: dict[str, tuple[Any, str]] = {}
        for call in ready:
            try:
                current = ray.get(call, timeout=0)
            except ray.exceptions.RayError:
                continue  # a runner of an older version, or dying: found by name if needed
            if isinstance(current, RunnerStatus):
                found[current.evaluation_id] = (calls[call], current.owner)
        return found

    def _release(self, evaluation_id: str) -> bool:
        """Release the evaluation's runner, rank actors and placement group (bounded wait)."""
        owner = self._owners.pop(evaluation_id, evaluation_id)
        return release(owner, self._forget_runner(evaluation_id), self._timeout_s)

    def _release_later(self, evaluation_id: str) -> None:
        """Release in the background: the polling thread does not wait for Ray to let go."""
        owner = self._owners.pop(evaluation_id, evaluation_id)
        self._release_in_background(owner, self._forget_runner(evaluation_id))

    def _release_in_background(self, owner: str, handle: Any | None) -> None:
        try:
            self._releaser.submit(release, owner, handle, self._timeout_s)
        except RuntimeError:  # shutting down: release here rather than leak the actors
            release(owner, handle, self._timeout_s)

    @property
    def _timeout_s(self) -> float:
        return self._options.cancel_timeout_s

    def _forget_runner(self, evaluation_id: str) -> Any | None:
        """The evaluation's runner handle (if Ray still has it), no longer tracked here."""
        handle = self._runner(evaluation_id)
        self._runners.pop(evaluation_id, None)
        self._heard.pop(evaluation_id, None)
        return handle


def _where(record: EvaluationRecord) -> str:
    """Where an evaluation stopped, from its stored progress."""
    last = record.progress.latest()
    if last is None:
        return (
            "before its first batch (reserving resources, loading the model or building requests)"
        )
    where = f"after {last.done}/{last.total} {last.phase} requests"
    if record.progress.all_answered():
        iters = EvaluationConfig.from_json(record.config).bootstrap_iters
        where += (
            ": every request was answered, so lm-eval was computing metrics "
            f"(bootstrap_iters={iters}) or building the next request type"
        )
    return where
