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

from tests.support.timeline import Call


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

        def submit_many(replica: Replica, steps: list[Any]) -> list[Any]:
            log[replica.index].append(time.monotonic())
            return original(replica, steps)

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
