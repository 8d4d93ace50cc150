"""Admission: which queued evaluations may start now, in the order fair share offers them.

The queue comes ordered by :func:`rayeval.service.jobs.fairness.fair_order` (each user in turn,
priorities within a user's own queue). The head starts when the cluster's free resources cover
its layout, or at once on kept (warm) replicas loaded for the same model and layout; nobody
overtakes it. Free means what
Ray reports available minus what evaluations already admitted will reserve but have not yet
(their placement group is not created), bounded by the service's own books (cluster total minus
everything admitted or kept), so one free slot is never handed to two evaluations even while
Ray's view lags.
Kept replicas hold their resources until the head of the queue needs them: then the least
recently kept are released first. Only when releasing every kept replica would not make room,
running preemptible evaluations of lower priority than the head are preempted (lowest priority
first, then the most recently started), as few as make room, and every kept replica is released
with them: warm replicas always go before a running evaluation does. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

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
    """One round's decisions: evaluations to start (on kept replicas or new ones), kept
    replicas to release because the head of the queue needs their room, and running
    evaluations to preempt for it (after the kept replicas are released)."""

    start: list[tuple[EvaluationRecord, Kept | None]]
    release: list[Kept]
    preempt: list[EvaluationRecord] = field(default_factory=list)
    head: EvaluationRecord | None = None


def plan(
    queued: Iterable[EvaluationRecord],
    free: Mapping[str, float],
    kept: Sequence[Kept],
    key_of: Callable[[EvaluationRecord], str],
    running: Sequence[EvaluationRecord] = (),
    made_room_for: Collection[str] = (),
) -> Admission:
    """Admit in the given order, using kept replicas where they match and their room (then
    preemptible evaluations' room) where the head needs it.

    Args:
        queued: Queued evaluations in the order to offer them (fair share's).
        free: Free resources (:func:`free_resources`; kept replicas' are not in it).
        kept: Kept replicas, least recently kept first.
        key_of: An evaluation's replica key
            (:func:`rayeval.service.engine.dispatch.warm.replica_key`).
        running: Starting or running evaluations (the preemptible ones may give way).
        made_room_for: Heads that room was made for in an earlier round (no more is made for
            them while Ray catches up with what was released).
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
        # The head does not fit: it starts in a later round, once Ray has released the room.
        if record.id in made_room_for:
            return Admission(start, [], head=record)
        release, remaining = _release_kept(pool, remaining, record)
        if covers(remaining, record.resources):
            return Admission(start, release, head=record)
        victims = _victims(running, remaining, record)
        if victims:
            return Admission(start, pool, victims, head=record)
        return Admission(start, [], head=record)
    return Admission(start, [])


#: What admission can take room from: kept replicas, or running evaluations to preempt.
_Holder = TypeVar("_Holder", Kept, EvaluationRecord)


def _release_kept(
    pool: Sequence[Kept], remaining: Mapping[str, float], head: EvaluationRecord
) -> tuple[list[Kept], dict[str, float]]:
    """Kept replicas to release for ``head``, oldest first, until it fits (or all of them)."""
    return _take_until_fits(pool, remaining, head)


def _victims(
    running: Sequence[EvaluationRecord], room: Mapping[str, float], head: EvaluationRecord
) -> list[EvaluationRecord]:
    """The fewest preemptible evaluations of lower priority than ``head`` whose room (with
    ``room``, every kept replica's included) fits it: lowest priority first, then the most
    recently started; none if even all of them would not do."""
    priority = head.scheduling.priority
    candidates = sorted(
        (r for r in running if r.scheduling.preemptible and r.scheduling.priority < priority),
        key=lambda r: (r.scheduling.priority, -(r.started_at or _EPOCH).timestamp()),
    )
    victims, room = _take_until_fits(candidates, room, head)
    return victims if covers(room, head.resources) else []


def _take_until_fits(
    candidates: Sequence[_Holder], room: Mapping[str, float], head: EvaluationRecord
) -> tuple[list[_Holder], dict[str, float]]:
    """Candidates taken in order, each adding the resources it holds to ``room``, until ``head``
    fits (or none is left); the ones taken and the room they make."""
    room = dict(room)
    taken: list[_Holder] = []
    for candidate in candidates:
        if covers(room, head.resources):
            break
        taken.append(candidate)
        for key, amount in candidate.resources.items():
            room[key] = room.get(key, 0.0) + amount
    return taken, room


_EPOCH = datetime.fromtimestamp(0).astimezone()
