"""Recovery at start: what a new API process does with what the previous one left running.

Runner actors are detached and named after their first evaluation, so they outlive the API
process that started them. At start the manager scans them (:func:`scan_runners`: every runner in
its namespace says which evaluation it runs and whose names it carries) and
:func:`plan_recovery` decides, from the database: an active evaluation whose runner is found
is re-attached; one whose runner is gone fails (the message is
:data:`rayeval.service.jobs.following.RUNNER_GONE_AT_START`); a runner whose evaluation ended
(kept warm by the previous process, or left over) is released. A runner of an evaluation the
database does not know belongs to another service on the same cluster and is left alone. No
torch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from rayeval.service.jobs.ray_resources import runner_name
from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.vocabulary.events import RunnerStatus


@dataclass(frozen=True)
class FoundRunner:
    """A runner actor alive on the cluster, and whose names it carries."""

    handle: Any
    owner: str


@dataclass(frozen=True)
class Recovery:
    """What to do with what the previous API process left.

    Attributes:
        attach: Active evaluation -> its runner (follow it again).
        lost: Active evaluations whose runner is gone (fail them).
        release: Runners whose last evaluation ended, with that evaluation (release them).
    """

    attach: dict[str, FoundRunner] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    release: list[tuple[str, FoundRunner]] = field(default_factory=list)


def scan_runners(namespace: str, timeout_s: float) -> dict[str, FoundRunner]:
    """The runner actors alive in ``namespace``: their latest evaluation -> the runner.

    A runner that does not say within ``timeout_s`` (dying, or of another version) is not listed;
    it is still found by name if an active evaluation needs it.
    """
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(runner_name("")):
            with contextlib.suppress(ValueError):  # died meanwhile
                handles.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
    calls: dict[Any, Any] = {handle.current.remote(): handle for handle in handles}
    if not calls:
        return {}
    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    found: dict[str, FoundRunner] = {}
    for call in ready:
        try:
            current = ray.get(call, timeout=0)
        except ray.exceptions.RayError:
            continue  # a runner of an older version, or dying: found by name if needed
        if isinstance(current, RunnerStatus):
            found[current.evaluation_id] = FoundRunner(calls[call], current.owner)
    return found


def plan_recovery(
    active: Iterable[EvaluationRecord],
    found: Mapping[str, FoundRunner],
    by_name: Callable[[str], Any | None],
    ended: Callable[[str], bool | None],
) -> Recovery:
    """Decide what to do with the evaluations left active and the runners found.

    Args:
        active: The evaluations the database has as starting or running.
        found: What :func:`scan_runners` found.
        by_name: An evaluation's runner looked up by its name (None: gone); for runners that
            did not answer the scan.
        ended: Whether an evaluation ended (None: the database does not know it).
    """
    unclaimed = dict(found)
    decided = Recovery()
    for record in active:
        runner = unclaimed.pop(record.id, None)
        if runner is None:
            handle = by_name(record.id)
            runner = FoundRunner(handle, record.id) if handle is not None else None
        if runner is None:
            decided.lost.append(record.id)
        else:
            decided.attach[record.id] = runner
    for evaluation_id, runner in unclaimed.items():
        if ended(evaluation_id):  # None (another service's) and False stay as they are
            decided.release.append((evaluation_id, runner))
    return decided
