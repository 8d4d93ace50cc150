"""Admission with kept (warm) replicas: FIFO, reuse where the key matches, room made when needed;
free resources that never count one slot twice, whatever Ray's lagging view says."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rayeval.service.jobs.admission import Kept, free_resources, plan
from rayeval.service.jobs.ray_resources import group_name
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore


def _queue(tmp_path: Path, *needs: tuple[str, float]) -> list[EvaluationRecord]:
    store = EvaluationStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.create_schema()
    for key, cpus in needs:
        store.create({"model_args": {"pretrained": key}, "tasks": ["t"]}, {"CPU": cpus})
    return store.queued()


def _key(record: EvaluationRecord) -> str:
    return record.config.pretrained  # its replica key in these tests


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_no_release_when_even_all_kept_room_would_not_do(tmp_path: Path) -> None:
    (head,) = _queue(tmp_path, ("m9", 8))
    decided = plan([head], {"CPU": 1}, [Kept("k", "m1", {"CPU": 2})], _key)
    assert decided.start == [] and decided.release == []


def _ray_cpus_free(want: float, timeout_s: float = 30.0) -> None:
    """Wait until Ray's own (lagging) view shows ``want`` CPUs available."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) != want:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.05)


@pytest.mark.service
@pytest.mark.usefixtures("ray_session")
def test_free_resources_count_each_slot_once_even_when_ray_lags(tmp_path: Path) -> None:
    """The service's books bound Ray's view: what Ray has not yet seen reserved (a placement group
    whose reservation has not reached ``available_resources``, kept replicas) is never free, and
    what Ray does show reserved is not subtracted a second time."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()["CPU"]
    _ray_cpus_free(total)
    placed, unplaced, reusing = _queue(tmp_path, ("m1", 2), ("m2", 1), ("m1", 2))
    # Nothing reserved on Ray yet: Ray's view alone would offer every CPU to the queue.
    free = free_resources([placed], kept=[Kept("kept", "m3", {"CPU": 1})])
    assert free["CPU"] == total - 2 - 1
    # An admitted evaluation whose placement group exists and shows in Ray's view: once.
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], name=group_name(placed.id))
    try:
        ray.get(pg.ready(), timeout=60)
        _ray_cpus_free(total - 2)
        assert free_resources([placed])["CPU"] == total - 2
        assert free_resources([placed, unplaced])["CPU"] == total - 3
        # The next evaluation of the same model, running on ``placed``'s group once it has ended
        # and been kept: that group's CPUs are counted once.
        assert free_resources([reusing], {reusing.id: placed.id})["CPU"] == total - 2
    finally:
        remove_placement_group(pg)
    _ray_cpus_free(total)
