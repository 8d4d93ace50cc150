"""Multi-node placement: which bundle holds which rank, and which GPU each rank computes on.

The pure parts (:func:`rayeval.actors.placement.assign_ranks`, ``choose_strategy``,
``cuda_device_index``) are unit-tested directly. The rest runs on a real multi-node Ray:
``ray.cluster_utils.Cluster`` with three simulated nodes (2 CPUs and 2 declared GPUs each, plus a
custom resource naming the node). It runs in a subprocess — this module run as a script — because a
process joins only one Ray cluster and the session's own local Ray (the ``ray_session`` fixture,
which these tests never request) may already be up. The subprocess gets its own ``RAY_TMPDIR``:
``Cluster`` records its address in ``<tmp>/ray/ray_current_cluster``, where any other
``ray.init()`` on the machine would
find it and join it. It reports what it saw as JSON and the tests assert on that report:

* where every rank of several layouts landed (CPU ranks, and GPU ranks on the declared GPUs);
* two GPU rank actors sharing a node: each holds its own GPU, sees it as
  ``CUDA_VISIBLE_DEVICES`` and computes on the right local index (torch has no CUDA here, so the
  actors then fail to load the model, with a clean error);
* a real 2x2 evaluation across the nodes, equal to lm-eval's own ``hf`` backend in one process.
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
#: (R, G, device) of the layouts whose placement the cluster run records (no actors started).
PLACED_LAYOUTS = {
    "cpu-3x1": (3, 1, "cpu"),
    "cpu-2x2": (2, 2, "cpu"),
    "cpu-1x4": (1, 4, "cpu"),
    "cpu-2x3": (2, 3, "cpu"),
    "cuda-4x1": (4, 1, "cuda"),
    "cuda-1x3": (1, 3, "cuda"),
}
NODES = ("node_a", "node_b", "node_c")
EVAL_TASKS = ["demo_cloze", "demo_gen_short"]
EVAL_RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}
EVAL_NAME = "placement-eval"
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
    """Run this module as a script against a 3-node ``Cluster``; return what it recorded."""
    out = tmp_path_factory.mktemp("placement")
    report, log = out / "report.json", out / "cluster.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))  # short: Ray's socket paths
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["RAY_TMPDIR"] = str(ray_tmp)
    # On a loaded machine the raylets' agents can take longer to start than Ray's defaults allow.
    env.setdefault("RAY_agent_register_timeout_ms", "120000")
    env.setdefault("RAY_worker_register_timeout_seconds", "120")
    command = [sys.executable, "-m", "tests.test_placement", "--report", str(report),
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
    # torch has no CUDA here: loading fails at once with a clean error, it does not hang.
    load_error = cluster_report["gpu_group"]["load_error"]
    assert load_error.startswith("a rank failed while loading the model"), load_error
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


# ------------------------------------------------ the cluster side (run as a subprocess)
def _cluster_main(argv: list[str]) -> int:
    """Start a 3-node ``Cluster``, record placements and one evaluation, write the report."""
    parser = argparse.ArgumentParser(prog="python -m tests.test_placement")
    parser.add_argument("--report", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tasks-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("tests.test_placement")

    import ray
    from ray.cluster_utils import Cluster

    log.info("starting a %d-node cluster", len(NODES))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": 2,
            "resources": {NODES[0]: 1},
            "include_dashboard": False,
        },
    )
    try:
        for node in NODES[1:]:
            cluster.add_node(num_cpus=2, num_gpus=2, resources={node: 1})
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False)
        names = {
            info["NodeID"]: next(key for key in info["Resources"] if key in NODES)
            for info in ray.nodes()
            if info["Alive"]
        }
        log.info("cluster up: %s", sorted(names.values()))
        report: dict[str, Any] = {
            "placements": {
                key: _record_placement(key, spec, names) for key, spec in PLACED_LAYOUTS.items()
            }
        }
        report["gpu_group"] = _record_gpu_group(args.model_dir, names)
        _wait_until_all_free()
        report["gpu_unisolated"] = _record_unisolated_gpu()
        _wait_until_all_free()
        log.info("GPU checks done; evaluating 2x2 across the nodes")
        report["evaluation"] = _record_evaluation(args.model_dir, args.tasks_dir, names)
        log.info("evaluation done")
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(args.report).write_text(json.dumps(report, default=str))
    return 0


def _record_placement(
    key: str, spec: tuple[int, int, str], names: dict[str, str]
) -> dict[str, Any]:
    from ray.util.placement_group import remove_placement_group

    from rayeval.actors.placement import reserve

    replicas, shard_size, device = spec
    layout = ParallelLayout(replicas, shard_size, device=DeviceKind(device))
    placement = reserve(f"place-{key}", layout, timeout_s=120)
    try:
        return {
            "strategy": placement.strategy.value,
            "ranks": [(names[site.node_id], site.device) for site in placement.sites],
        }
    finally:
        remove_placement_group(placement.pg)
        _wait_until_all_free()


def _wait_until_all_free(timeout_s: float = 60) -> None:
    """Removing a placement group frees its resources asynchronously; the next layout must see
    an empty cluster, or Ray places it around the leftovers (and may split its replicas)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(key, 0) >= total[key] for key in ("CPU", "GPU")):
            return
        time.sleep(0.2)
    raise TimeoutError(f"resources not released within {timeout_s}s: {ray.available_resources()}")


def _record_gpu_group(model_dir: str, names: dict[str, str]) -> dict[str, Any]:
    """Start a real 1x2 GPU worker group on the declared GPUs and ask every rank where it is."""
    import ray

    from rayeval.actors.batches import ModelSpec
    from rayeval.actors.errors import ModelLoadError
    from rayeval.actors.group import WorkerGroup
    from rayeval.actors.layout import Timeouts

    layout = ParallelLayout(1, 2, device=DeviceKind.CUDA)
    timeouts = Timeouts(placement_s=120, load_s=180, step_s=60, collective_s=60)
    group = WorkerGroup.create("gpu-group", layout, ModelSpec(pretrained=model_dir), timeouts)
    try:
        assert group.placement is not None
        workers = [w for replica in group.replicas for w in replica.workers]
        infos = ray.get([w.node_info.remote() for w in workers], timeout=120)
        records = []
        for coord, info in zip(layout.coords(), infos, strict=True):
            site = group.placement.sites[coord.global_rank]
            records.append(
                {
                    "name": f"gpu-group-r{coord.replica}-s{coord.shard_rank}",
                    "node": names[info["node_id"]],
                    "gpu_ids": info["gpu_ids"],
                    "cuda_visible_devices": info["cuda_visible_devices"],
                    "cuda_device": info["cuda_device"],
                    "placed_node": names[site.node_id],
                    "placed_device": site.device,
                }
            )
        for record in records:  # the names the dashboard shows resolve to these actors
            named = ray.get_actor(record["name"])
            assert ray.get(named.node_info.remote(), timeout=60)["gpu_ids"] == record["gpu_ids"]
        try:
            group.wait_ready()
            load_error = ""
        except ModelLoadError as exc:
            load_error = str(exc)
        return {"workers": records, "load_error": load_error}
    finally:
        group.shutdown()


def _record_unisolated_gpu() -> dict[str, Any]:
    """One GPU task with Ray's per-actor CUDA_VISIBLE_DEVICES turned off."""
    import ray

    def probe() -> dict[str, Any]:
        gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {
            "gpu_ids": gpu_ids,
            "cuda_visible_devices": visible,
            "cuda_device": cuda_device_index(gpu_ids, visible),
        }

    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    remote = ray.remote(probe).options(num_gpus=1, num_cpus=0, runtime_env={"env_vars": env})
    return dict(ray.get(remote.remote(), timeout=120))


def _record_evaluation(model_dir: str, tasks_dir: str, names: dict[str, str]) -> dict[str, Any]:
    """A real 2x2 CPU evaluation over the simulated nodes, with where each rank ran."""
    import ray
    from lm_eval.tasks import TaskManager

    from rayeval.actors.layout import Timeouts
    from rayeval.service.engine.lm import RayEvalLM
    from tests.helpers import evaluate

    task_manager = TaskManager(include_defaults=False, include_path=tasks_dir)
    timeouts = Timeouts(placement_s=120, load_s=300, step_s=300, collective_s=300)
    with RayEvalLM(
        pretrained=model_dir,
        num_replicas=2,
        shard_size=2,
        device="cpu",  # the simulated nodes declare GPUs that do not exist
        dtype="float32",
        batch_size="auto",
        max_batch_tokens=256,
        timeouts=timeouts,
        name=EVAL_NAME,
    ) as lm:
        results = evaluate(lm, task_manager, EVAL_TASKS, **EVAL_RUN)
        ranks = []
        for replica in range(2):
            for shard in range(2):
                name = f"{EVAL_NAME}-r{replica}-s{shard}"
                info = ray.get(ray.get_actor(name).node_info.remote(), timeout=60)
                ranks.append({"name": name, "node": names[info["node_id"]]})
        groups = [
            info["name"]
            for info in ray.util.placement_group_table().values()
            if info["state"] == "CREATED"
        ]
    return {
        "results": json.loads(json.dumps(results, default=str)),
        "ranks": ranks,
        "placement_group": groups[0] if len(groups) == 1 else groups,
    }


if __name__ == "__main__":
    sys.exit(_cluster_main(sys.argv[1:]))
