"""Admission with kept (warm) replicas: FIFO, reuse where the key matches, room made when needed."""

from __future__ import annotations

from pathlib import Path

from service.jobs.admission import Kept, plan
from service.jobs.store import EvaluationRecord, EvaluationStore


def _queue(tmp_path: Path, *needs: tuple[str, float]) -> list[EvaluationRecord]:
    store = EvaluationStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.create_schema()
    for key, cpus in needs:
        store.create({"key": key}, {"CPU": cpus})
    return store.queued()


def _key(record: EvaluationRecord) -> str:
    return str(record.config["key"])


def test_matching_kept_replicas_start_first_in_fifo_order(tmp_path: Path) -> None:
    a, b, c = _queue(tmp_path, ("m1", 2), ("m2", 2), ("m3", 4))
    kept = [Kept("old", "m2", {"CPU": 2})]
    decided = plan([a, b, c], {"CPU": 2}, kept, _key)
    # a takes the free CPUs, b the kept replicas; c does not fit and nothing is left to free.
    assert [(r.id, k.owner if k else None) for r, k in decided.start] == [
        (a.id, None),
        (b.id, "old"),
    ]
    assert decided.release == []


def test_the_head_gets_the_room_of_kept_replicas_oldest_first(tmp_path: Path) -> None:
    (head, after) = _queue(tmp_path, ("m9", 3), ("m1", 1))
    kept = [Kept("oldest", "m1", {"CPU": 1}), Kept("newer", "m2", {"CPU": 2})]
    decided = plan([head, after], {"CPU": 1}, kept, _key)
    # Strict FIFO: the head waits for room (oldest kept replicas freed first, only as many as
    # needed) and nobody overtakes it, not even an evaluation the kept replicas would serve.
    assert decided.start == []
    assert [k.owner for k in decided.release] == ["oldest", "newer"]
    decided = plan([head], {"CPU": 2}, kept, _key)
    assert [k.owner for k in decided.release] == ["oldest"]


def test_no_release_when_even_all_kept_room_would_not_do(tmp_path: Path) -> None:
    (head,) = _queue(tmp_path, ("m9", 8))
    decided = plan([head], {"CPU": 1}, [Kept("k", "m1", {"CPU": 2})], _key)
    assert decided.start == [] and decided.release == []
