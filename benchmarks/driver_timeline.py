"""Where a replica's time goes between the driver and its rank (``bench_driver.py --grid``).

Replica utilisation alone does not say whether the driver is what idles a replica: on one small
machine the simulated ranks' own CPU (Ray's call path, unpickling, making answers) competes with
the driver's. Here each replica's wall time is split by *who it waited for*, from two clocks on
the same machine (``time.monotonic`` is system-wide on Linux, so a rank's times and the driver's
compare): :class:`SubmitLog` notes when the driver sent each bulk call to a replica
(``Replica.submit_many``), and the simulated rank notes when each call ran and how much of it was
modelled compute (``SimulatedRank.call_times``). A Ray actor runs one caller's calls in the order
they were sent, so the k-th call sent is the k-th that ran.

Per replica, from the first call the driver sent to any replica until the last call ended:

- ``computing``: the modelled step time (what utilisation counts);
- ``rank_overhead``: the rest of each call on the rank (unpickling, answers, pickling, a late
  wake-up from its sleep);
- ``waiting_for_driver``: between the end of a call (or the start) and the moment the driver sent
  the next one: the replica had nothing queued;
- ``sent_not_running``: the next call was sent but had not started on the rank yet (Ray's transport
  and the rank process waiting for a CPU);
- ``tail``: after its last call, while other replicas finished theirs.

Only the replica's first rank is read (the grid's replicas have one rank each).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: One call on a rank: (started, ended, modelled compute seconds), monotonic clock.
Call = tuple[float, float, float]

SHARES = ("computing", "rank_overhead", "waiting_for_driver", "sent_not_running", "tail")


class SubmitLog:
    """When the driver sent each bulk call, per replica (monotonic clock)."""

    def __init__(self) -> None:
        self.sent: dict[int, list[float]] = defaultdict(list)

    @contextmanager
    def recording(self) -> Iterator[SubmitLog]:
        """Note every ``Replica.submit_many`` of this process while the block runs."""
        from rayeval.actors.group import Replica

        original = Replica.submit_many
        log = self.sent

        def submit_many(replica: Replica, method: str, steps: list[Any]) -> list[Any]:
            log[replica.index].append(time.monotonic())
            return original(replica, method, steps)

        Replica.submit_many = submit_many  # type: ignore[method-assign]
        try:
            yield self
        finally:
            Replica.submit_many = original  # type: ignore[method-assign]


def rank_calls(replicas: Sequence[Any], timeout_s: float = 60.0) -> dict[int, list[Call]]:
    """Each replica's first rank's calls since it was last asked (``SimulatedRank.call_times``)."""
    import ray

    refs = [replica.workers[0].call_times.remote() for replica in replicas]
    values = ray.get(refs, timeout=timeout_s)
    return {r.index: [tuple(c) for c in v] for r, v in zip(replicas, values, strict=True)}


def time_shares(sent: dict[int, list[float]], calls: dict[int, list[Call]]) -> dict[str, float]:
    """The replicas' wall time split into :data:`SHARES` (fractions summing to 1).

    ``sent[r]`` and ``calls[r]`` are replica ``r``'s calls in order; a replica whose counts differ
    (a call lost with its replica) is left out.
    """
    pairs = {r: (sent[r], c) for r, c in calls.items() if c and len(sent.get(r, ())) == len(c)}
    if not pairs:
        return dict.fromkeys(SHARES, 0.0)
    start = min(times[0] for times, _ in pairs.values())
    end = max(c[-1][1] for _, c in pairs.values())
    totals = dict.fromkeys(SHARES, 0.0)
    for times, replica_calls in pairs.values():
        free_since = start  # when the replica last had nothing to run
        for sent_at, (began, ended, modelled) in zip(times, replica_calls, strict=True):
            gap = max(0.0, began - free_since)
            waiting = min(gap, max(0.0, sent_at - free_since))
            totals["waiting_for_driver"] += waiting
            totals["sent_not_running"] += gap - waiting
            totals["computing"] += modelled
            totals["rank_overhead"] += max(0.0, ended - began - modelled)
            free_since = max(free_since, ended)
        totals["tail"] += end - free_since
    whole = sum(totals.values())
    return {key: value / whole for key, value in totals.items()} if whole > 0 else totals
