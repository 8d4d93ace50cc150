"""A rank process that dies while loading the model has the group's ranks started again, once.

Issue 41's soak SIGKILLed ranks (and removed nodes) while they loaded: each time the whole
evaluation failed, though loading changes nothing outside the ranks and can be repeated. Real
Ray, real rank actors loading the tiny model (a replica of two: a gloo process group); the one
seam is the rank class, whose shard rank 0 ends its own process in ``setup``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ModelLoadError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import ParallelLayout, Timeouts
from rayeval.actors.worker import ShardWorker

pytestmark = pytest.mark.service

TIMEOUTS = Timeouts(placement_s=60, load_s=120, step_s=60, collective_s=60)


class _DiesWhileLoading(ShardWorker):
    """Shard rank 0 dies in ``setup``, as a SIGKILL there would: the first time only when
    ``MARKER`` names a file (created as it dies), every time when it is empty."""

    MARKER = ""

    def setup(self, rendezvous: tuple[str, int]) -> Any:
        if self._coord.global_rank == 0:
            marker = Path(self.MARKER) if self.MARKER else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.touch()
                os._exit(1)
        return super().setup(rendezvous)


def _rank_class(marker: str) -> type:
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not find tests/
    return type("DiesWhileLoading", (_DiesWhileLoading,), {"MARKER": marker})


def _pids(group: WorkerGroup) -> list[int]:
    import ray

    workers = [w for replica in group.replicas for w in replica.workers]
    return [info.pid for info in ray.get([w.node_info.remote() for w in workers], timeout=60)]


def test_a_rank_that_dies_while_loading_is_started_again(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    marker = tmp_path / "died-once"
    group = WorkerGroup.create(
        "load-restart", ParallelLayout(1, 2), ModelSpec(pretrained=str(demo.model_dir)),
        TIMEOUTS, rank_class=_rank_class(str(marker)),
    )  # fmt: skip
    try:
        reports = group.wait_ready()
        assert marker.exists() and len(reports) == 2
        assert all(report.local_parameters > 0 for report in reports)
        assert len(set(_pids(group))) == 2  # both ranks answer, in processes of their own
    finally:
        group.shutdown()


def test_a_rank_that_dies_again_fails_the_load_naming_both_deaths(
    demo: Any, ray_session: None
) -> None:
    group = WorkerGroup.create(
        "load-restart-twice", ParallelLayout(1, 1), ModelSpec(pretrained=str(demo.model_dir)),
        TIMEOUTS, rank_class=_rank_class(""),
    )  # fmt: skip
    try:
        with pytest.raises(ModelLoadError, match="died while loading the model, after its ranks"):
            group.wait_ready()
    finally:
        group.shutdown()
