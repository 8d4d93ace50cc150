"""Admission: which queued evaluations may start now, in strict FIFO order.

The head of the queue starts when the cluster's free resources cover its layout, or at once on
kept (warm) replicas loaded for the same model and layout; nobody overtakes it. Free means what
Ray reports available minus what evaluations already admitted will reserve but have not yet
(their placement group is not created), bounded by the service's own books (cluster total minus
everything admitted or kept), so one free slot is never handed to two evaluations even while
Ray's view lags.
Kept replicas hold their resources until the head of the queue needs them: then the least
recently kept are released first. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import ray

from rayeval.service.jobs.ray_resources import group_name
from rayeval.service.jobs.store import EvaluationRecord


def free_resources(
    active: Iterable[EvaluationRecord],
    owners: Mapping[str, str] | None = None,
    kept: Iterable[Kept] = (),
) -> dict[str, float]:
    """What is free for the queue: the smaller of Ray's view and this service's own books.

    Ray's view is what it reports available, minus what ``active`` evaluations will reserve but
    have not yet. It sees other users of the cluster, but it lags: a placement group already
    CREATED may not show in ``ray.available_resources()`` yet, and in that window the same CPUs
    would look free twice. The books (the cluster's total, minus every active evaluation and
    every kept replica) never lag for what this service holds. Taking the smaller of the two
    never hands one slot to two evaluations; a lag the other way only delays a start by a round.

    ``owners`` maps an evaluation running on kept replicas to the evaluation whose placement
    group they are (named after it).
    """
    owners = owners or {}
    active = list(active)
    seen = {k: float(v) for k, v in ray.available_resources().items()}
    placed = {
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info.get("state") == "CREATED"
    }
    books = {k: float(v) for k, v in ray.cluster_resources().items()}
    for record in active:
        unplaced = group_name(owners.get(record.id, record.id)) not in placed
        for key, amount in record.resources.items():
            books[key] = books.get(key, 0.0) - amount
            if unplaced:
                seen[key] = seen.get(key, 0.0) - amount
    for entry in kept:
        for key, amount in entry.resources.items():
            books[key] = books.get(key, 0.0) - amount
    return {key: min(seen.get(key, 0.0), books.get(key, 0.0)) for key in seen.keys() | books}


def covers(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    """True when ``free`` holds at least ``need`` of every resource."""
    return all(free.get(key, 0.0) >= amount for key, amount in need.items())


@dataclass(frozen=True)
class Kept:
    """Loaded replicas kept after an evaluation: whose they are, what they serve, what they hold."""

    owner: str
    key: str
    resources: Mapping[str, float]


@dataclass(frozen=True)
class Admission:
    """One round's decisions: evaluations to start (on kept replicas or new ones), and kept
    replicas to release because the head of the queue needs their room."""

    start: list[tuple[EvaluationRecord, Kept | None]]
    release: list[Kept]


def plan(
    queued: Iterable[EvaluationRecord],
    free: Mapping[str, float],
    kept: Sequence[Kept],
    key_of: Callable[[EvaluationRecord], str],
) -> Admission:
    """Admit in FIFO order, using kept replicas where they match and their room where needed.

    Args:
        queued: Queued evaluations, oldest first.
        free: Free resources (:func:`free_resources`; kept replicas' are not in it).
        kept: Kept replicas, least recently kept first.
        key_of: An evaluation's replica key (:func:`rayeval.service.engine.warm.replica_key`).
    """
    remaining = dict(free)
    pool = list(kept)
    start: list[tuple[EvaluationRecord, Kept | None]] = []
    for record in queued:
        match = next((k for k in pool if k.key == key_of(record)), None) if pool else None
        if match is not None:
            pool.remove(match)
            start.append((record, match))
            continue
        if covers(remaining, record.resources):
            start.append((record, None))
            remaining = {k: v - record.resources.get(k, 0.0) for k, v in remaining.items()}
            continue
        # The head does not fit: free kept replicas, oldest first, if that makes room. It starts
        # in a later round, once Ray has released them.
        release: list[Kept] = []
        for candidate in pool:
            if covers(remaining, record.resources):
                break
            release.append(candidate)
            for key, amount in candidate.resources.items():
                remaining[key] = remaining.get(key, 0.0) + amount
        if covers(remaining, record.resources):
            return Admission(start, release)
        return Admission(start, [])
    return Admission(start, [])
