"""What the job service holds on Ray, by name: runner actors, rank actors, placement groups.

An evaluation's Ray objects are named after its id (:func:`runner_name`, :func:`group_name`), so a
restarted API finds them again and a cancel can release whatever is left. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

logger = logging.getLogger(__name__)


def runner_name(evaluation_id: str) -> str:
    """Name of the detached runner actor of an evaluation."""
    return f"rayeval-runner-{evaluation_id}"


def find_runner(evaluation_id: str, namespace: str) -> Any | None:
    """The runner actor of an evaluation, looked up by its name (None: it does not exist)."""
    try:
        return ray.get_actor(runner_name(evaluation_id), namespace=namespace)
    except ValueError:
        return None


def group_name(evaluation_id: str) -> str:
    """Name of the evaluation's placement group, and prefix of its rank actors' names."""
    return f"rayeval-{evaluation_id}"


@dataclass(frozen=True)
class Leftovers:
    """What Ray still holds for one evaluation: named actors (name, namespace), placement groups."""

    actors: list[tuple[str, str]]
    placement_groups: list[PlacementGroup]

    @property
    def empty(self) -> bool:
        """True when nothing of the evaluation is alive."""
        return not self.actors and not self.placement_groups


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


def release(evaluation_id: str, runner: Any | None, timeout_s: float) -> bool:
    """Kill the runner, then every rank actor and placement group of the evaluation.

    Returns:
        True once Ray shows none of them alive; False if some remain after ``timeout_s``.
    """
    if runner is not None:
        kill(runner)
    deadline = time.monotonic() + timeout_s
    while True:
        leftovers = leftover_resources(evaluation_id)
        if leftovers.empty:
            return True
        if time.monotonic() > deadline:
            logger.warning("evaluation %s: still alive after release: %s", evaluation_id, leftovers)
            return False
        for name, namespace in leftovers.actors:
            with contextlib.suppress(ValueError):  # ValueError: it died meanwhile
                kill(ray.get_actor(name, namespace=namespace))
        for pg in leftovers.placement_groups:
            remove_placement_group(pg)
        time.sleep(0.2)


class Releaser:
    """Releases evaluations' Ray objects (:func:`release`), now or in a small background pool,
    so that the manager's polling thread never waits for Ray to let go.

    Args:
        timeout_s: Bound on each release.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rayeval-release")

    def now(self, evaluation_id: str, runner: Any | None) -> bool:
        """:func:`release`, in this thread."""
        return release(evaluation_id, runner, self.timeout_s)

    def later(self, evaluation_id: str, runner: Any | None) -> None:
        """:func:`release`, in the background (here once the pool is shut down)."""
        try:
            self._pool.submit(release, evaluation_id, runner, self.timeout_s)
        except RuntimeError:  # shutting down: release here rather than leak the actors
            release(evaluation_id, runner, self.timeout_s)

    def shutdown(self) -> None:
        """Stop taking work; releases under way finish in the background."""
        self._pool.shutdown(wait=False)


def kill(handle: Any) -> None:
    """Kill an actor for good; one that is already gone needs nothing."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already dead: nothing to release
        logger.debug("actor already gone")


def brief(exc: BaseException, limit: int = 500) -> str:
    """An exception as one short line (Ray's actor errors carry whole tracebacks)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
