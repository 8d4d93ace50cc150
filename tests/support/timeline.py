"""How a replica's wall time splits by what it waited for, from when the driver sent each bulk
call and when the rank ran it (``benchmarks/driver_timeline.py`` records both)."""

from __future__ import annotations

#: One call on a rank: (started, ended, modelled compute seconds), monotonic clock.
Call = tuple[float, float, float]

SHARES = ("computing", "rank_overhead", "waiting_for_driver", "sent_not_running", "tail")


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
