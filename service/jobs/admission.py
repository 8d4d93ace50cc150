"""Admission: which queued evaluations may start now, in strict FIFO order.

The head of the queue starts when the cluster's free resources cover its layout; nobody overtakes
it. Free means what Ray reports available minus what evaluations already admitted will reserve but
have not yet (their placement group is not created), so one free slot is never handed to two
evaluations. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import ray

from service.jobs.ray_resources import group_name
from service.jobs.store import EvaluationRecord


def free_resources(active: Iterable[EvaluationRecord]) -> dict[str, float]:
    """What Ray reports free, minus what ``active`` evaluations will reserve but have not yet."""
    free = {k: float(v) for k, v in ray.available_resources().items()}
    placed = {
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info.get("state") == "CREATED"
    }
    for record in active:
        if group_name(record.id) not in placed:
            for key, amount in record.resources.items():
                free[key] = free.get(key, 0.0) - amount
    return free


def admissible(
    queued: Iterable[EvaluationRecord], free: Mapping[str, float]
) -> Iterator[EvaluationRecord]:
    """The queued evaluations that fit, head first, stopping at the first that does not.

    The caller starts each one it is given (or skips it, when it was cancelled meanwhile); what a
    started one reserves is taken off ``free`` before the next is considered.
    """
    remaining = dict(free)
    for record in queued:
        if not covers(remaining, record.resources):
            return  # strict FIFO: nobody overtakes the head of the queue
        yield record
        remaining = {k: v - record.resources.get(k, 0.0) for k, v in remaining.items()}


def covers(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    """True when ``free`` holds at least ``need`` of every resource."""
    return all(free.get(key, 0.0) >= amount for key, amount in need.items())
