"""The evaluation manager: admission, runner actors, progress, cancellation and recovery.

One :class:`EvaluationManager` per API process. Submissions are validated and stored as
``queued``; a background thread then, every ``poll_interval_s``:

1. polls each active evaluation's runner actor for new events, stores progress (the latest report
   per request type), and on completion stores lm-eval's result and sample files and the terminal
   state in one transaction;
2. admits queued evaluations in strict FIFO order while the cluster's free resources cover the
   head of the queue's layout. Resources of evaluations admitted here whose placement group is
   not yet created are subtracted from what Ray reports free, so one free slot is never handed to
   two evaluations.

Cancelling kills the runner actor, then any rank actor or placement group of the evaluation still
alive (looked up by name), and waits — bounded — until Ray shows none. On start, evaluations that
were active are re-attached when their detached runner actor still exists, else marked failed.
No torch here: runners are created from a class reference and import torch in their own process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from actors.errors import (
    ConfigError,
    EvaluationStateError,
    LayoutError,
    RayEvalError,
    ServiceNotReadyError,
)
from actors.group import FORWARDED_ENV
from service.cluster import pick_device
from service.model_args import HF_MODEL_NAMES, unsupported_model_args
from service.runner_actor import (
    FAILED,
    PROGRESS,
    SUCCEEDED,
    EvaluationRunner,
    group_name,
    runner_name,
)
from service.spec import ACTIVE_STATUSES, EvaluationSpec, EvaluationStatus
from service.store import EvaluationRecord, EvaluationStore, NewEvent
from service.tasks import TaskCatalog

logger = logging.getLogger(__name__)

_QUEUED = [EvaluationStatus.QUEUED]
_ACTIVE = list(ACTIVE_STATUSES)
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
        result_timeout_s: Bound on fetching a finished evaluation's results from its runner.
        cancel_timeout_s: Bound on waiting for Ray to release a cancelled evaluation.
        task_index_wait_s: Bound on waiting for lm-eval's task index when validating tasks.
    """

    namespace: str = "rayeval"
    poll_interval_s: float = 0.5
    runner_unreachable_s: float = 120.0
    result_timeout_s: float = 120.0
    cancel_timeout_s: float = 30.0
    task_index_wait_s: float = 20.0


def connect_ray(address: str | None, num_cpus: int | None, namespace: str) -> bool:
    """Make this process a Ray driver; reuse an initialised Ray session.

    Args:
        address: An existing cluster (``auto``, ``host:6379``, ``ray://...``); None:
            ``$RAY_ADDRESS`` or else an embedded local Ray.
        num_cpus: Logical CPUs of an embedded Ray (None: the machine's cores).
        namespace: The driver's Ray namespace.

    Returns:
        True if this call started or joined Ray (the caller shuts it down), False if reused.
    """
    if ray.is_initialized():
        logger.info("using the Ray session already initialised in this process")
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        logger.info("connected to the Ray cluster at %s", address)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False)
        logger.info("started an embedded Ray with %s logical CPUs", num_cpus or os.cpu_count())
    return True


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
        # Owned by the polling thread: evaluation id -> (pending events_since call, sent at).
        self._inflight: dict[str, tuple[Any, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Re-attach or fail the evaluations a previous API process left active; start polling."""
        self._recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rayeval-manager", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop polling (runner actors keep running and are re-attached by the next start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("the manager thread did not stop within %.0fs", timeout_s)
            self._thread = None

    # ------------------------------------------------------------------- operations
    def submit(self, spec: EvaluationSpec) -> EvaluationRecord:
        """Validate an evaluation against the server and the cluster, then queue it.

        Raises:
            ConfigError: bad model, tasks or options (every problem in one message).
            LayoutError: the layout can never fit the cluster (requested vs available).
            ServiceNotReadyError: the task index is not ready yet (retry shortly).
        """
        spec = spec.with_device(pick_device(spec.device))
        layout = spec.layout()
        problems = _model_problems(spec)
        try:
            spec.evaluator_config(output_path="unused", include_paths=self._catalog.include_paths)
        except ConfigError as exc:
            problems.append(str(exc))
        try:
            self._catalog.check(spec.tasks, wait_s=self._options.task_index_wait_s)
        except ConfigError as exc:
            problems.append(str(exc))
        except ServiceNotReadyError:
            if not problems:
                raise
        try:
            layout.check_fits(ray.cluster_resources())
        except LayoutError as exc:
            if not problems:
                raise
            problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))
        record = self._store.create(spec.to_dict(), layout.total_resources())
        logger.info("queued evaluation %s (%s, tasks %s)", record.id, layout.describe(), spec.tasks)
        return record

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
                self._store.transition(evaluation_id, EvaluationStatus.CANCELLED, _QUEUED)
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
            self._store.transition(evaluation_id, EvaluationStatus.CANCELLED, _ACTIVE, error=note)
            logger.info("cancelled evaluation %s", evaluation_id)
        finally:
            with self._lock:
                self._cancelling.discard(evaluation_id)
        return self._store.get(evaluation_id)

    # ----------------------------------------------------------------- background loop
    def _loop(self) -> None:
        while not self._stop.wait(self._options.poll_interval_s):
            try:
                self._follow_active()
                self._admit()
            except Exception:  # one bad round must not stop the service
                logger.exception("manager round failed; retrying")

    def _admit(self) -> None:
        queued = self._store.queued()
        if not queued:
            return
        free = self._free_resources()
        for record in queued:
            if not _covers(free, record.resources):
                break  # strict FIFO: nobody overtakes the head of the queue
            # Under the lock, so that a cancel sees either a queued evaluation or a runner handle.
            with self._lock:
                if not self._store.transition(record.id, EvaluationStatus.STARTING, _QUEUED):
                    continue  # cancelled meanwhile
                self._start_runner(record)
            free = {k: v - record.resources.get(k, 0.0) for k, v in free.items()}

    def _free_resources(self) -> dict[str, float]:
        """What Ray reports free, minus what admitted evaluations will reserve but have not yet."""
        free = {k: float(v) for k, v in ray.available_resources().items()}
        placed = {
            info["name"]
            for info in ray.util.placement_group_table().values()
            if info.get("state") == "CREATED"
        }
        for record in self._store.active():
            if group_name(record.id) not in placed:
                for key, amount in record.resources.items():
                    free[key] = free.get(key, 0.0) - amount
        return free

    def _start_runner(self, record: EvaluationRecord) -> None:
        env = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
        env["TOKENIZERS_PARALLELISM"] = "false"
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
                .remote(record.id, record.spec, list(self._catalog.include_paths))
            )
        except Exception as exc:  # e.g. a bad runtime_env: the evaluation cannot start
            error = f"could not start the runner actor: {_brief(exc)}"
            self._store.transition(record.id, EvaluationStatus.FAILED, _ACTIVE, error=error)
            return
        self._runners[record.id] = handle
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
            call = runner.events_since.remote(record.runner_cursor)
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
                self._fail(evaluation_id, f"the runner actor died: {_brief(exc)}")
                continue
            if events:
                self._apply(record, events)
        now = time.monotonic()
        for evaluation_id, (_, sent) in list(self._inflight.items()):
            if now - sent > self._options.runner_unreachable_s:
                del self._inflight[evaluation_id]
                self._fail(
                    evaluation_id,
                    f"the runner actor did not answer for {self._options.runner_unreachable_s:g}s:"
                    " check the Ray cluster (dashboard, `ray status`) and resubmit",
                )

    def _is_cancelling(self, evaluation_id: str) -> bool:
        with self._lock:
            return evaluation_id in self._cancelling

    def _apply(self, record: EvaluationRecord, events: list[dict[str, Any]]) -> None:
        phases = dict(record.progress.get("phases", {}))
        latest: dict[str, dict[str, Any]] = {}
        for event in events:
            if event["type"] == PROGRESS:
                data = dict(event["data"], updated_at=event["time"])
                phases[data["phase"]] = latest[data["phase"]] = data
        cursor = events[-1]["seq"]
        ended = next((e for e in events if e["type"] in (SUCCEEDED, FAILED)), None)
        if latest and record.status is EvaluationStatus.STARTING:
            self._store.transition(record.id, EvaluationStatus.RUNNING, [EvaluationStatus.STARTING])
        progress_events: list[NewEvent] = [
            ("progress", _progress_event(data, phases)) for data in latest.values()
        ]
        self._store.record_progress(record.id, {"phases": phases}, cursor, progress_events)
        if ended is not None and ended["type"] == SUCCEEDED:
            self._succeed(record.id)
        elif ended is not None:
            self._fail(record.id, ended["data"]["error"])

    def _succeed(self, evaluation_id: str) -> None:
        runner = self._runner(evaluation_id)
        try:
            if runner is None:
                raise RayEvalError("the runner actor vanished before its results were fetched")
            output = ray.get(runner.result.remote(), timeout=self._options.result_timeout_s)
        except (RayEvalError, ray.exceptions.RayError) as exc:
            self._fail(
                evaluation_id, f"the evaluation finished but its results were lost: {_brief(exc)}"
            )
            return
        results = json.loads(output["results_json"])
        events: list[NewEvent] = [
            ("task_result", {"task": task, "metrics": metrics})
            for task, metrics in results.get("results", {}).items()
        ]
        events.append(("result", results))
        with self._lock:
            if evaluation_id in self._cancelling:
                return
            stored = self._store.finish_succeeded(
                evaluation_id, output["results_json"], output["samples"], output["stats"], events
            )
        if stored:
            logger.info("evaluation %s succeeded", evaluation_id)
        self._release(evaluation_id)

    def _fail(self, evaluation_id: str, error: str) -> None:
        with self._lock:
            if evaluation_id in self._cancelling:
                return
            failed = self._store.transition(
                evaluation_id, EvaluationStatus.FAILED, _ACTIVE, error=error
            )
        if failed:
            logger.warning("evaluation %s failed: %s", evaluation_id, error)
        self._release(evaluation_id)

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
        for record in self._store.active():
            if self._runner(record.id) is not None:
                logger.info("re-attached evaluation %s to its runner actor", record.id)
            else:
                self._fail(
                    record.id,
                    "the API server restarted and the runner actor of this evaluation no longer "
                    "exists on the Ray cluster (the cluster restarted or the runner died): "
                    "resubmit the evaluation",
                )

    def _release(self, evaluation_id: str) -> bool:
        """Kill the runner, then every rank actor and placement group of the evaluation.

        Returns:
            True once Ray shows none of them alive; False if some remain after the timeout.
        """
        handle = self._runners.pop(evaluation_id, None) or self._runner(evaluation_id)
        self._runners.pop(evaluation_id, None)
        if handle is not None:
            _kill(handle)
        deadline = time.monotonic() + self._options.cancel_timeout_s
        while True:
            leftovers = leftover_resources(evaluation_id)
            if not leftovers.actors and not leftovers.placement_groups:
                return True
            if time.monotonic() > deadline:
                logger.warning(
                    "evaluation %s: still alive after release: %s", evaluation_id, leftovers
                )
                return False
            for name, namespace in leftovers.actors:
                with contextlib.suppress(ValueError):  # ValueError: it died meanwhile
                    _kill(ray.get_actor(name, namespace=namespace))
            for pg in leftovers.placement_groups:
                remove_placement_group(pg)
            time.sleep(0.2)


@dataclass(frozen=True)
class Leftovers:
    """What Ray still holds for one evaluation: named actors (name, namespace), placement groups."""

    actors: list[tuple[str, str]]
    placement_groups: list[PlacementGroup]


def leftover_resources(evaluation_id: str) -> Leftovers:
    """The evaluation's runner, rank actors and placement group that are still alive on Ray."""
    from ray._raylet import PlacementGroupID

    prefix = group_name(evaluation_id) + "-r"
    actors = [
        (entry["name"], entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"] == runner_name(evaluation_id) or entry["name"].startswith(prefix)
    ]
    # Placement groups are found by name in the cluster-wide table: the group was created by the
    # runner, whose Ray namespace need not be this process's.
    groups = [
        PlacementGroup(PlacementGroupID.from_hex(info["placement_group_id"]))
        for info in ray.util.placement_group_table().values()
        if info.get("name") == group_name(evaluation_id) and info.get("state") != "REMOVED"
    ]
    return Leftovers(actors=actors, placement_groups=groups)


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already dead: nothing to release
        logger.debug("actor already gone")


def _brief(exc: BaseException, limit: int = 500) -> str:
    """An exception as one short line (Ray's actor errors carry whole tracebacks)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _covers(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(key, 0.0) >= amount for key, amount in need.items())


def _progress_event(latest: dict[str, Any], phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A progress event: the phase that moved, plus totals over every phase seen so far."""
    return {
        **latest,
        "overall_done": sum(p["done"] for p in phases.values()),
        "overall_total": sum(p["total"] for p in phases.values()),
    }


def _model_problems(spec: EvaluationSpec) -> list[str]:
    """Model problems that can be seen from the API host: wrong backend, missing local paths."""
    problems = []
    if not spec.model_args.get("pretrained"):
        problems.append("model_args needs pretrained=<hub id or local path>")
    if spec.model not in HF_MODEL_NAMES:
        problems.append(
            f"model {spec.model!r} is not supported: rayeval runs lm-eval's Hugging Face "
            'backend, use "model": "hf"'
        )
    problems += [f"model_args.{problem}" for problem in unsupported_model_args(spec.model_args)]
    for key in ("pretrained", "tokenizer"):
        value = spec.model_args.get(key)
        if isinstance(value, str) and _looks_local(value) and not Path(value).expanduser().exists():
            problems.append(
                f"model_args.{key}: {value!r} does not exist on the server: pass a path that "
                "exists on the server and every Ray node, or a Hugging Face hub id (org/name)"
            )
    return problems


def _looks_local(value: str) -> bool:
    """A path, not a hub id: absolute, home- or dot-relative, or more than one ``/``."""
    return value.startswith(("/", "~", "./", "../")) or value.count("/") > 1
