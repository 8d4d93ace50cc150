"""Fair share of the queue: the order in which queued evaluations are offered to admission.

Each user's own queue is ordered by priority (higher first), then by submission (oldest first).
The users are served in turn by weighted fair share of the ranks they hold: the next evaluation
comes from the user whose ranks held (running now, plus those ordered ahead of it) divided by
their weight is the smallest; ties go to the user served least recently (never served first),
then to the one whose next evaluation is oldest. So with equal weights one user's twenty queued
evaluations alternate with another's one, a user of weight 2 gets about twice the ranks of a user
of weight 1 while both have work queued, and when there are more users than room (each holding
nothing between their evaluations) they still take turns rather than the oldest queue winning
every tie. A user whose next
evaluation would take their ranks over their cap waits (their whole queue: nobody overtakes
within it) until their running evaluations end; the others go on.

:func:`fair_order` is a pure function over typed values, as admission's ``plan`` is; admission then
starts the evaluations of that order while the cluster has room, the first one that does not fit
waiting for it (no backfilling: a large evaluation is never starved by small
ones). No Ray and no torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from rayeval.service.jobs.accounts import Share
from rayeval.service.jobs.records import EvaluationRecord

_EVERYONE = Share()


@dataclass(frozen=True)
class FairOrder:
    """The queue as fair share serves it.

    Attributes:
        order: Queued evaluations in the order admission offers them.
        capped: Evaluations waiting for their owner's ranks to drop under the owner's cap, in
            the order they would come.
    """

    order: list[EvaluationRecord] = field(default_factory=list)
    capped: list[EvaluationRecord] = field(default_factory=list)

    @property
    def positions(self) -> dict[str, int]:
        """Each queued evaluation's place: 1 is offered first, capped ones come last."""
        return {r.id: place for place, r in enumerate([*self.order, *self.capped], start=1)}


def fair_order(
    queued: Iterable[EvaluationRecord],
    held: Mapping[str, int],
    shares: Mapping[str, Share],
    served: Mapping[str, int] | None = None,
) -> FairOrder:
    """Order the queue by weighted fair share, priorities and caps.

    Args:
        queued: Every queued evaluation, in any order.
        held: Ranks each user's starting or running evaluations hold now.
        shares: Each user's weight and cap (a user not listed: weight 1, no cap).
        served: When each user last had an evaluation started, as increasing numbers (a user
            not listed: never); breaks ties of fair share, least recently served first.

    Returns:
        The order admission offers them in, and those held back by a cap.
    """
    queues: dict[str, deque[EvaluationRecord]] = {}
    for record in sorted(queued, key=_within_owner):
        queues.setdefault(record.owner, deque()).append(record)
    usage = {owner: float(held.get(owner, 0)) for owner in queues}
    last = served or {}
    decided = FairOrder()
    while queues:
        owner = min(
            queues,
            key=lambda u: (
                usage[u] / _share(shares, u).weight,
                last.get(u, -1),
                queues[u][0].number,
            ),
        )
        record = queues[owner][0]
        cap = _share(shares, owner).max_ranks
        if cap is not None and usage[owner] + record.ranks > cap:
            decided.capped.extend(queues.pop(owner))
            continue
        queues[owner].popleft()
        decided.order.append(record)
        usage[owner] += record.ranks
        if not queues[owner]:
            del queues[owner]
    return decided


def room_made_first(decided: FairOrder, reserved: Collection[str]) -> FairOrder:
    """The order with the evaluations that running ones were preempted for first: the room was
    made for them, and the preempted ones, queued again, must not take it back."""
    first = [r for r in decided.order if r.id in reserved]
    rest = [r for r in decided.order if r.id not in reserved]
    return FairOrder([*first, *rest], decided.capped)


def held_ranks(active: Iterable[EvaluationRecord]) -> dict[str, int]:
    """Ranks each user's active evaluations hold."""
    held: dict[str, int] = {}
    for record in active:
        held[record.owner] = held.get(record.owner, 0) + record.ranks
    return held


def over_cap(ranks: int, owner: str, share: Share) -> str | None:
    """Why an evaluation of ``ranks`` can never start under its owner's cap (it needs more ranks
    than the cap alone), else None."""
    if share.max_ranks is None or ranks <= share.max_ranks:
        return None
    return (
        f"parallelism: this evaluation needs {ranks} ranks (num_replicas x shard_size) and "
        f"{owner}'s cap is {share.max_ranks} ranks at once: lower num_replicas or shard_size, "
        f"or ask an admin to raise the cap (`rayeval users set {owner} --max-ranks N`)"
    )


def _within_owner(record: EvaluationRecord) -> tuple[int, int]:
    return (-record.scheduling.priority, record.number)


def _share(shares: Mapping[str, Share], owner: str) -> Share:
    return shares.get(owner, _EVERYONE)
