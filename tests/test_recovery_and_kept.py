"""The manager's parts that hold no Ray call of their own: recovery's plan at start, the kept
(warm) runners, and the per-evaluation state (tables; handles are plain stand-ins)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rayeval.service.jobs.admission import Kept
from rayeval.service.jobs.followed import FollowedEvaluations
from rayeval.service.jobs.kept import KeptRunners
from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.jobs.recovery import FoundRunner, Recovery, plan_recovery
from rayeval.service.vocabulary.config import EvaluationConfig
from rayeval.service.vocabulary.events import EvaluationProgress
from rayeval.service.vocabulary.states import EvaluationStatus

pytestmark = pytest.mark.unit

CONFIG = EvaluationConfig.from_json({"model_args": {"pretrained": "m"}, "tasks": ["t"]})


def _active(evaluation_id: str) -> EvaluationRecord:
    now = datetime.now(UTC)
    return EvaluationRecord(
        evaluation_id, 1, EvaluationStatus.RUNNING, CONFIG, {}, now, now, None, None,
        EvaluationProgress(), 0, 0,
    )  # fmt: skip


#: What the database says of evaluations not active: ended (True), not ended (False), unknown.
ENDED = {"done": True, "queued": False}


@pytest.mark.parametrize(
    "active, found, by_name, expected",
    [
        # Found by the scan: re-attached, with the names its resources carry.
        (["a"], {"a": FoundRunner("h", "a")}, {}, Recovery(attach={"a": FoundRunner("h", "a")})),
        (["b"], {"b": FoundRunner("h", "o")}, {}, Recovery(attach={"b": FoundRunner("h", "o")})),
        # Not in the scan (it did not answer) but alive by name: re-attached as its own.
        (["a"], {}, {"a": "h-a"}, Recovery(attach={"a": FoundRunner("h-a", "a")})),
        # Gone: failed.
        (["a", "b"], {}, {"b": "h-b"}, Recovery(attach={"b": FoundRunner("h-b", "b")}, lost=["a"])),
        # Runners of ended evaluations (kept, or left over) are released; those of evaluations
        # not ended, or unknown to this database (another service's), are left alone.
        (
            [],
            {"done": FoundRunner("h1", "o1"), "queued": FoundRunner("h2", "q"),
             "other": FoundRunner("h3", "x")},
            {},
            Recovery(release=[("done", FoundRunner("h1", "o1"))]),
        ),
    ],
)  # fmt: skip
def test_recovery_reattaches_fails_and_releases(
    active: list[str], found: dict[str, FoundRunner], by_name: dict[str, str], expected: Recovery
) -> None:
    decided = plan_recovery([_active(i) for i in active], found, by_name.get, ENDED.get)
    assert decided == expected


def _kept(owner: str, key: str) -> Kept:
    return Kept(owner, key, {"CPU": 1.0})


def test_kept_runners_one_per_key_oldest_released_first() -> None:
    released: list[tuple[str, object]] = []
    kept = KeptRunners(2, lambda owner, handle: released.append((owner, handle)))
    assert kept.enabled and kept.entries() == []
    kept.keep(_kept("a", "k1"), "ha")
    kept.keep(_kept("b", "k2"), "hb")
    kept.keep(_kept("c", "k1"), "hc")  # same key as a: a gives way
    assert released == [("a", "ha")]
    kept.keep(_kept("d", "k3"), "hd")  # over capacity: the least recently kept (b) goes
    assert released == [("a", "ha"), ("b", "hb")]
    assert [e.owner for e in kept.entries()] == ["c", "d"]
    kept.release("c")
    shutdown: list[str] = []
    kept.release_all(lambda owner, handle: shutdown.append(owner))
    assert released[-1] == ("c", "hc") and shutdown == ["d"] and kept.entries() == []
    assert not KeptRunners(0, lambda owner, handle: None).enabled


def test_one_state_per_evaluation() -> None:
    followed = FollowedEvaluations()
    a = followed["a"]
    assert followed["a"] is a and followed.get("b") is None
    a.runner, a.owner = "h", "o"
    followed["b"].ask("call", now=5.0)
    assert followed.owners() == {"a": "o"}
    assert [f.evaluation_id for f in followed.asking()] == ["b"]
    assert a.let_go() == ("o", "h") and (a.runner, a.owner, a.names) == (None, None, "a")
    followed["c"].cancelling = True
    followed.keep_only({"b"})  # a goes; c is being cancelled and stays
    assert {f.evaluation_id for f in followed.all()} == {"b", "c"}
    followed.drop("c")
    assert followed.get("c") is None
