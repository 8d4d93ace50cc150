"""Fair share of the queue, and preemption, as pure policies: tables of queues and clusters.

``fair_order`` serves users in turn by weighted fair share of the ranks they hold, priorities
within a user's own queue, caps per user; ``plan`` then admits in that order, releasing kept
replicas before it preempts anything. The same promises hold end to end on a real Ray cluster
in ``tests/test_team.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rayeval.service.jobs.accounts import Share
from rayeval.service.jobs.admission import Kept, plan
from rayeval.service.jobs.fairness import fair_order, held_ranks, over_cap, room_made_first
from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.vocabulary.config import EvaluationConfig
from rayeval.service.vocabulary.events import EvaluationProgress
from rayeval.service.vocabulary.states import EvaluationStatus

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def rec(
    name: str,
    owner: str,
    number: int,
    ranks: int = 1,
    priority: int = 0,
    preemptible: bool = False,
    status: EvaluationStatus = EvaluationStatus.QUEUED,
    started: int | None = None,
) -> EvaluationRecord:
    """Evaluation ``name`` of ``owner``, the ``number``-th submitted, of ``ranks`` 1-CPU ranks."""
    config = EvaluationConfig.from_json(
        {
            "model_args": {"pretrained": name},  # its replica key in these tests
            "tasks": ["t"],
            "parallelism": {"num_replicas": ranks, "shard_size": 1},
            "scheduling": {"priority": priority, "preemptible": preemptible},
        }
    )
    started_at = T0 + timedelta(seconds=started) if started is not None else None
    return EvaluationRecord(
        name, number, status, config, {"CPU": float(ranks)}, T0, started_at, None, None,
        EvaluationProgress(), 0, 0, owner,
    )  # fmt: skip


def names(records: list[EvaluationRecord]) -> list[str]:
    return [r.id for r in records]


# queued (name, owner, ranks, priority) in submission order; ranks held; shares; expected order
ORDERS = [
    pytest.param(
        [("a1", "ann", 1, 0), ("a2", "ann", 1, 0), ("a3", "ann", 1, 0), ("b1", "bob", 1, 0)],
        {},
        {},
        ["a1", "b1", "a2", "a3"],
        id="one user's many queued do not hold another's one behind them",
    ),
    pytest.param(
        [("a1", "ann", 1, 0), ("a2", "ann", 1, 0), ("b1", "bob", 1, 0), ("b2", "bob", 1, 0)],
        {"ann": 2},
        {},
        ["b1", "b2", "a1", "a2"],
        id="ranks already held count: the user holding none goes first",
    ),
    pytest.param(
        [(f"a{i}", "ann", 1, 0) for i in range(1, 7)]
        + [(f"b{i}", "bob", 1, 0) for i in range(1, 4)],
        {},
        {"ann": Share(weight=2.0)},
        ["a1", "b1", "a2", "a3", "b2", "a4", "a5", "b3", "a6"],
        id="weight 2 gets twice the ranks",
    ),
    pytest.param(
        [("a1", "ann", 1, 0), ("a2", "ann", 1, 5), ("a3", "ann", 1, 5), ("b1", "bob", 1, 9)],
        {},
        {},
        ["a2", "b1", "a3", "a1"],
        id="priority orders a user's own queue only, then oldest first",
    ),
    pytest.param(
        [("a1", "ann", 2, 0), ("a2", "ann", 1, 0), ("b1", "bob", 4, 0), ("b2", "bob", 1, 0)],
        {"ann": 1},
        {"ann": Share(max_ranks=2)},
        ["b1", "b2"],
        id="a cap holds back its user's whole queue, not the others",
    ),
    pytest.param(
        [("a1", "ann", 4, 0), ("b1", "bob", 1, 0), ("b2", "bob", 1, 0), ("b3", "bob", 1, 0)],
        {},
        {},
        ["a1", "b1", "b2", "b3"],
        id="a large evaluation is counted by its ranks",
    ),
]


def test_users_holding_nothing_take_turns_least_recently_served_first() -> None:
    """More users than room: each holds nothing between evaluations, so fair share alone ties
    every round and the oldest queue (ann's) would win each one; the least recently served wins."""
    queue = [rec(f"a{i}", "ann", i) for i in range(1, 4)]
    queue += [rec("b1", "bob", 4), rec("c1", "cat", 5)]
    assert names(fair_order(queue, {}, {}).order)[0] == "a1"
    assert names(fair_order(queue, {}, {}, {"ann": 1}).order)[:3] == ["b1", "c1", "a1"]
    assert names(fair_order(queue, {}, {}, {"ann": 2, "bob": 1}).order)[:3] == ["c1", "b1", "a1"]
    # Fair share comes first: a user holding ranks waits however long ago they were served.
    assert names(fair_order(queue, {"bob": 1}, {}, {"ann": 2, "bob": 1}).order)[:2] == ["c1", "a1"]


@pytest.mark.parametrize(("queued", "held", "shares", "expected"), ORDERS)
def test_fair_order(
    queued: list[tuple[str, str, int, int]],
    held: dict[str, int],
    shares: dict[str, Share],
    expected: list[str],
) -> None:
    records = [rec(n, o, i, r, p) for i, (n, o, r, p) in enumerate(queued, start=1)]
    decided = fair_order(reversed(records), held, shares)  # the input's order does not matter
    assert names(decided.order) == expected
    assert sorted(names(decided.order) + names(decided.capped)) == sorted(names(records))
    positions = decided.positions
    assert sorted(positions.values()) == list(range(1, len(records) + 1))


def test_capped_evaluations_wait_and_an_impossible_one_is_named() -> None:
    queue = [rec("a1", "ann", 1, 2), rec("a2", "ann", 2, 1)]
    decided = fair_order(queue, {}, {"ann": Share(max_ranks=2)})
    assert names(decided.order) == ["a1"] and names(decided.capped) == ["a2"]
    decided = fair_order(queue, {"ann": 1}, {"ann": Share(max_ranks=2)})
    assert decided.order == [] and names(decided.capped) == ["a1", "a2"], "no overtaking"
    assert held_ranks([rec("x", "ann", 1, 3), rec("y", "bob", 2, 1), rec("z", "ann", 3, 2)]) == {
        "ann": 5,
        "bob": 1,
    }
    message = over_cap(3, "ann", Share(max_ranks=2))
    assert message is not None and "3 ranks" in message and "--max-ranks" in message
    assert over_cap(2, "ann", Share(max_ranks=2)) is None and over_cap(9, "ann", Share()) is None


def _key(record: EvaluationRecord) -> str:
    return record.config.pretrained


RUNNING = EvaluationStatus.RUNNING
# queue (in fair order), free CPUs, kept (owner, CPUs), running (name, ranks, priority,
# preemptible, started), expected (started, released, preempted)
PLANS = [
    pytest.param(
        [("h", 3, 5)],
        1,
        [],
        [("p", 2, 0, True, 1)],
        ([], [], ["p"]),
        id="a preemptible evaluation of lower priority gives way",
    ),
    pytest.param(
        [("h", 3, 5)],
        1,
        [],
        [("p", 2, 0, False, 1)],
        ([], [], []),
        id="one not submitted as preemptible never does",
    ),
    pytest.param(
        [("h", 3, 5)],
        1,
        [],
        [("p", 2, 5, True, 1)],
        ([], [], []),
        id="nor one of the same priority",
    ),
    pytest.param(
        [("h", 3, 5)],
        1,
        [("k", 2)],
        [("p", 2, 0, True, 1)],
        ([], ["k"], []),
        id="kept replicas go first when their room is enough",
    ),
    pytest.param(
        [("h", 4, 5)],
        1,
        [("k", 1)],
        [("p", 1, 0, True, 1), ("q", 1, 1, True, 2)],
        ([], ["k"], ["p", "q"]),
        id="else every kept replica goes with the fewest victims, lowest priority first",
    ),
    pytest.param(
        [("h", 2, 5)],
        0,
        [],
        [("old", 2, 0, True, 1), ("new", 2, 0, True, 9)],
        ([], [], ["new"]),
        id="of equal priority the most recently started goes",
    ),
    pytest.param(
        [("h", 4, 5)],
        0,
        [],
        [("p", 1, 0, True, 1), ("q", 1, 0, False, 1)],
        ([], [], []),
        id="nothing is preempted when it would not make room",
    ),
    pytest.param(
        [("a", 1, 0), ("h", 3, 5), ("b", 1, 9)],
        2,
        [],
        [("p", 2, 0, True, 1)],
        (["a"], [], ["p"]),
        id="evaluations ahead start; the head that does not fit blocks the rest",
    ),
]


@pytest.mark.parametrize(("queue", "free", "kept", "running", "expected"), PLANS)
def test_plan_preempts_only_after_kept_replicas(
    queue: list[tuple[str, int, int]],
    free: int,
    kept: list[tuple[str, int]],
    running: list[tuple[str, int, int, bool, int]],
    expected: tuple[list[str], list[str], list[str]],
) -> None:
    queued = [rec(n, "ann", i, r, p) for i, (n, r, p) in enumerate(queue, start=1)]
    active = [
        rec(n, "bob", 100 + i, r, p, pre, RUNNING, started)
        for i, (n, r, p, pre, started) in enumerate(running)
    ]
    pool = [Kept(owner, f"other-{owner}", {"CPU": float(cpus)}) for owner, cpus in kept]
    decided = plan(queued, {"CPU": float(free)}, pool, _key, running=active)
    started = [r.id for r, _ in decided.start]
    assert (started, [k.owner for k in decided.release], names(decided.preempt)) == expected


def test_the_head_room_was_made_for_goes_first() -> None:
    """The preempted evaluation, queued again and older, must not take back the room made for
    the head it gave way to."""
    victim, head = rec("v", "ann", 1, 2, 0, True), rec("h", "bob", 2, 3, 9)
    decided = room_made_first(fair_order([victim, head], {}, {}), {"h"})
    assert names(decided.order) == ["h", "v"]
    assert names(room_made_first(fair_order([victim, head], {}, {}), set()).order) == ["v", "h"]


def test_no_more_room_is_made_while_the_released_room_comes_back() -> None:
    head = rec("h", "ann", 1, 3, 5)
    active = [rec("p", "bob", 2, 2, 0, True, RUNNING, 1)]
    decided = plan([head], {"CPU": 1.0}, [], _key, running=active, made_room_for={"h"})
    assert decided.preempt == [] and decided.head is head
