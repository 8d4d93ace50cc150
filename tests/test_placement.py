"""Multi-node placement: which bundle holds which rank, and which GPU each rank computes on.

The pure parts (:func:`rayeval.actors.placement.assign_ranks`, ``choose_strategy``,
``cuda_device_index``) are unit-tested directly. The rest runs on a real multi-node Ray:
``ray.cluster_utils.Cluster`` with three simulated nodes (2 CPUs and 2 declared GPUs each, plus a
custom resource naming the node). It runs in a subprocess (``tests/placement_cluster.py`` run as
a script) because a process joins only one Ray cluster and the session's own local Ray (the
``ray_session`` fixture, which these tests never request) may already be up. The subprocess gets
its own ``RAY_TMPDIR``: ``Cluster`` records its address in ``<tmp>/ray/ray_current_cluster``,
where any other ``ray.init()`` on the machine would find it and join it. It reports what it saw
as JSON and the tests assert on that report:

* where every rank of several layouts landed (CPU ranks, and GPU ranks on the declared GPUs);
* two GPU rank actors sharing a node: each holds its own GPU, sees it as
  ``CUDA_VISIBLE_DEVICES`` and computes on the right local index (torch has no CUDA here, so the
  actors then fail to load the model, with a clean error);
* a real 2x2 evaluation across the nodes, equal to lm-eval's own ``hf`` backend in one process.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.errors import LayoutError, ResourcesUnavailableError
from rayeval.actors.layout import DeviceKind, ParallelLayout, PlacementPolicy
from rayeval.actors.placement import (
    BundleSite,
    PlacementStrategy,
    assign_ranks,
    choose_strategy,
    cuda_device_index,
)
from tests.helpers import kill_processes_naming, stop_process_group
from tests.placement_cluster import EVAL_NAME, EVAL_RUN, EVAL_TASKS, NODES

REPO = Path(__file__).resolve().parents[1]
CLUSTER_RUN_TIMEOUT_S = 420


# ----------------------------------------------------------------------------- pure functions
def _sites(*spec: tuple[str, str | None]) -> list[BundleSite]:
    return [BundleSite(node, device) for node, device in spec]


def _replicas(order: list[int], layout: ParallelLayout) -> list[list[int]]:
    by_replica: dict[int, list[int]] = {}
    for coord in layout.coords():
        by_replica.setdefault(coord.replica, []).append(order[coord.global_rank])
    return [by_replica[r] for r in sorted(by_replica)]


@pytest.mark.unit
def test_strategy_spreads_plain_replicas_and_packs_sharded_ones() -> None:
    assert choose_strategy(ParallelLayout(4, 1)) is PlacementStrategy.SPREAD
    assert choose_strategy(ParallelLayout(1, 2)) is PlacementStrategy.PACK
    assert choose_strategy(ParallelLayout(3, 8, device=DeviceKind.CUDA)) is PlacementStrategy.PACK


@pytest.mark.unit
def test_placement_policy_overrides_the_strategy_when_asked() -> None:
    spread, pack = PlacementPolicy.SPREAD, PlacementPolicy.PACK
    assert choose_strategy(ParallelLayout(1, 2, placement=spread)) is PlacementStrategy.SPREAD
    assert choose_strategy(ParallelLayout(4, 1, placement=pack)) is PlacementStrategy.PACK
    assert choose_strategy(ParallelLayout(2, 2, placement=pack)) is PlacementStrategy.PACK


@pytest.mark.unit
def test_replica_takes_its_ranks_from_one_node_in_device_order() -> None:
    # Ray interleaved the bundles over two nodes; each node's GPUs were reserved out of order.
    sites = _sites(("b", "3"), ("a", "1"), ("b", "2"), ("a", "0"))
    layout = ParallelLayout(2, 2, device=DeviceKind.CUDA)
    order = assign_ranks(sites, layout)
    assert [(sites[b].node_id, sites[b].device) for b in order] == [
        ("a", "0"),
        ("a", "1"),
        ("b", "2"),
        ("b", "3"),
    ]
    assert _replicas(order, layout) == [[3, 1], [2, 0]]


@pytest.mark.unit
def test_devices_sort_numerically_then_by_name() -> None:
    sites = _sites(("a", "10"), ("a", "2"), ("a", "GPU-b"), ("a", "GPU-a"))
    order = assign_ranks(sites, ParallelLayout(1, 4, device=DeviceKind.CUDA))
    assert [sites[b].device for b in order] == ["2", "10", "GPU-a", "GPU-b"]


@pytest.mark.unit
def test_nodes_with_more_bundles_come_first_and_cpu_bundles_keep_their_order() -> None:
    sites = _sites(("a", None), ("b", None), ("b", None), ("b", None))
    assert assign_ranks(sites, ParallelLayout(4, 1)) == [1, 2, 3, 0]


@pytest.mark.unit
def test_replica_larger_than_a_node_spans_nodes_in_node_then_device_order() -> None:
    sites = _sites(("b", "0"), ("a", "1"), ("b", "1"), ("a", "0"), ("c", "0"), ("c", "1"))
    order = assign_ranks(sites, ParallelLayout(2, 3, device=DeviceKind.CUDA))
    placed = [(sites[b].node_id, sites[b].device) for b in order]
    assert placed == [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1"), ("c", "0"), ("c", "1")]


@pytest.mark.unit
def test_whole_replicas_first_then_leftovers_joined() -> None:
    # Node order a, b, c would split both replicas (a|b, b|c); b can hold one replica whole.
    sites = _sites(("a", "0"), ("b", "0"), ("b", "1"), ("c", "0"))
    layout = ParallelLayout(2, 2, device=DeviceKind.CUDA)
    replicas = _replicas(assign_ranks(sites, layout), layout)
    assert [[sites[b].node_id for b in replica] for replica in replicas] == [
        ["b", "b"],
        ["a", "c"],
    ]


@pytest.mark.unit
def test_assignment_is_a_permutation_with_the_most_single_node_replicas() -> None:
    rng = random.Random(7)
    for _ in range(200):
        shard_size = rng.randint(1, 5)
        layout = ParallelLayout(rng.randint(1, 5), shard_size)
        sites = [BundleSite(rng.choice("abcd")) for _ in range(layout.world)]
        order = assign_ranks(sites, layout)
        assert sorted(order) == list(range(layout.world))
        single_node = sum(
            len({sites[b].node_id for b in replica}) == 1 for replica in _replicas(order, layout)
        )
        counts = [sum(s.node_id == node for s in sites) for node in "abcd"]
        assert single_node == min(layout.num_replicas, sum(c // shard_size for c in counts))


@pytest.mark.unit
def test_wrong_number_of_bundles_is_an_error() -> None:
    with pytest.raises(LayoutError, match="needs 4 bundles, the placement group has 3"):
        assign_ranks(_sites(("a", None), ("a", None), ("a", None)), ParallelLayout(2, 2))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("gpu_ids", "visible", "index"),
    [
        (["3"], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to this actor's GPU (the default)
        ([3], None, 3),  # not narrowed and unset: every GPU visible, ids are CUDA indices
        (["3"], "0,1,2,3", 3),  # not narrowed (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
        (["3"], "2, 3", 1),  # node started with a subset of its GPUs
        (["GPU-b"], "GPU-a,GPU-b", 1),  # GPUs named by UUID
    ],
)
def test_cuda_device_index(gpu_ids: list[Any], visible: str | None, index: int) -> None:
    assert cuda_device_index(gpu_ids, visible) == index


@pytest.mark.unit
@pytest.mark.parametrize(
    ("gpu_ids", "visible", "message"),
    [
        ([], "0", "exactly one GPU, Ray assigned none"),
        (["0", "1"], "0,1", r"exactly one GPU, Ray assigned \['0', '1'\]"),
        (["3"], "0,1", "CUDA_VISIBLE_DEVICES is '0,1'"),
        (["3"], "", "CUDA_VISIBLE_DEVICES is ''"),
        (["GPU-a"], None, "CUDA_VISIBLE_DEVICES is unset"),
    ],
)
def test_cuda_device_index_errors(gpu_ids: list[Any], visible: str | None, message: str) -> None:
    with pytest.raises(ResourcesUnavailableError, match=message):
        cuda_device_index(gpu_ids, visible)


# ------------------------------------------------------------------- the simulated cluster
@pytest.fixture(scope="module")
def cluster_report(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run tests/placement_cluster.py against a 3-node ``Cluster``; return what it recorded."""
    out = tmp_path_factory.mktemp("placement")
    report, log = out / "report.json", out / "cluster.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))  # short: Ray's socket paths
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["RAY_TMPDIR"] = str(ray_tmp)
    # On a loaded machine the raylets' agents can take longer to start than Ray's defaults allow.
    env.setdefault("RAY_agent_register_timeout_ms", "120000")
    env.setdefault("RAY_worker_register_timeout_seconds", "120")
    command = [sys.executable, "-m", "tests.placement_cluster", "--report", str(report),
               "--model-dir", str(demo.model_dir), "--tasks-dir", str(demo.tasks_dir)]  # fmt: skip
    started = time.monotonic()
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            process.wait(timeout=CLUSTER_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process_group(process)
        finally:
            kill_processes_naming(str(ray_tmp))
            shutil.rmtree(ray_tmp, ignore_errors=True)
    logging.getLogger(__name__).info("cluster run took %.0fs", time.monotonic() - started)
    if process.returncode != 0 or not report.exists():
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"the cluster run failed (exit {process.returncode}):\n{tail}")
    return json.loads(report.read_text())


def _placed(report: dict[str, Any], key: str) -> list[tuple[str, str | None]]:
    return [(node, device) for node, device in report["placements"][key]["ranks"]]


def _node_runs(nodes: list[str]) -> list[str]:
    """The nodes in rank order with repeats collapsed: ranks are ordered by node iff no repeats."""
    return [node for i, node in enumerate(nodes) if i == 0 or nodes[i - 1] != node]


@pytest.mark.e2e
def test_unsharded_replicas_spread_over_nodes(cluster_report: dict[str, Any]) -> None:
    cpu = _placed(cluster_report, "cpu-3x1")
    assert cluster_report["placements"]["cpu-3x1"]["strategy"] == "SPREAD"
    assert sorted(node for node, _ in cpu) == list(NODES), cpu
    gpu = _placed(cluster_report, "cuda-4x1")
    assert {node for node, _ in gpu} == set(NODES), gpu
    assert len(set(gpu)) == 4, f"two ranks on one GPU: {gpu}"
    assert len(_node_runs([node for node, _ in gpu])) == 3, f"not ordered by node: {gpu}"


@pytest.mark.e2e
def test_sharded_replicas_sit_on_one_node_each(cluster_report: dict[str, Any]) -> None:
    nodes = [node for node, _ in _placed(cluster_report, "cpu-2x2")]
    assert cluster_report["placements"]["cpu-2x2"]["strategy"] == "PACK"
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes
    assert nodes[0] != nodes[2], f"a node holds 2 CPUs, so replicas must differ: {nodes}"


@pytest.mark.e2e
def test_replica_larger_than_a_node_spans_nodes_in_order(cluster_report: dict[str, Any]) -> None:
    one = [node for node, _ in _placed(cluster_report, "cpu-1x4")]
    assert len(_node_runs(one)) == 2 and one[0] == one[1] and one[2] == one[3], one
    two = [node for node, _ in _placed(cluster_report, "cpu-2x3")]
    assert sorted(_node_runs(two)) == list(NODES), f"ranks not ordered by node: {two}"
    assert len(set(two[:3])) == 2 and len(set(two[3:])) == 2, two
    gpu = _placed(cluster_report, "cuda-1x3")
    first, second = gpu[0][0], gpu[2][0]
    assert gpu[1][0] == first != second, gpu
    assert [gpu[0][1], gpu[1][1]] == ["0", "1"], f"not ordered by device: {gpu}"


@pytest.mark.e2e
def test_gpu_ranks_sharing_a_node_each_get_their_own_gpu(cluster_report: dict[str, Any]) -> None:
    """A 1x2 GPU worker group: actor names, node, GPUs, CUDA_VISIBLE_DEVICES, device index."""
    workers = cluster_report["gpu_group"]["workers"]
    assert [w["name"] for w in workers] == ["gpu-group-r0-s0", "gpu-group-r0-s1"]
    assert workers[0]["node"] == workers[1]["node"], workers
    assert [w["gpu_ids"] for w in workers] == [["0"], ["1"]], f"not in device order: {workers}"
    for worker in workers:
        assert worker["gpu_ids"] == [worker["placed_device"]], worker
        assert worker["node"] == worker["placed_node"], worker
        assert worker["cuda_visible_devices"] == worker["gpu_ids"][0], worker
        assert worker["cuda_device"] == 0, worker
    # torch has no CUDA here: loading fails at once with a clean error naming the install
    # command, it does not hang.
    load_error = cluster_report["gpu_group"]["load_error"]
    assert "is a CPU build" in load_error and "--device cpu" in load_error, load_error
    unisolated = cluster_report["gpu_unisolated"]
    assert unisolated["cuda_visible_devices"] is None
    assert unisolated["cuda_device"] == int(unisolated["gpu_ids"][0])


@pytest.mark.e2e
def test_evaluation_across_nodes_matches_lm_eval_hf(
    cluster_report: dict[str, Any], demo: Any, task_manager: Any
) -> None:
    from tests.helpers import assert_same_results, hf_reference

    evaluation = cluster_report["evaluation"]
    assert evaluation["placement_group"] == EVAL_NAME
    ranks = evaluation["ranks"]
    assert [r["name"] for r in ranks] == [f"{EVAL_NAME}-r{r}-s{s}" for r in (0, 1) for s in (0, 1)]
    assert ranks[0]["node"] == ranks[1]["node"] != ranks[2]["node"] == ranks[3]["node"], ranks
    reference = hf_reference(demo.model_dir, task_manager, EVAL_TASKS, **EVAL_RUN)
    reference = json.loads(json.dumps(reference, default=str))  # as lm-eval's files hold it
    assert_same_results(reference, evaluation["results"])
    assert set(evaluation["results"]["samples"]) == set(EVAL_TASKS)
