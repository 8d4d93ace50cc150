"""The cluster side of tests/test_placement.py, run as ``python -m tests.placement_cluster``.

It starts a ``ray.cluster_utils.Cluster`` with three simulated nodes (2 CPUs and 2 declared GPUs
each, plus a custom resource naming the node), records where the ranks of several layouts land,
what two GPU rank actors sharing a node see, and a real 2x2 evaluation across the nodes, and
writes it all as JSON for the tests to assert on. It runs in its own process because a process
joins only one Ray cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from rayeval.actors.layout import DeviceKind, ParallelLayout
from rayeval.actors.placement import cuda_device_index

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


def _cluster_main(argv: list[str]) -> int:
    """Start a 3-node ``Cluster``, record placements and one evaluation, write the report."""
    parser = argparse.ArgumentParser(prog="python -m tests.placement_cluster")
    parser.add_argument("--report", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tasks-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("tests.placement_cluster")

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
                    "node": names[info.node_id],
                    "gpu_ids": info.gpu_ids,
                    "cuda_visible_devices": info.cuda_visible_devices,
                    "cuda_device": info.cuda_device,
                    "placed_node": names[site.node_id],
                    "placed_device": site.device,
                }
            )
        for record in records:  # the names the dashboard shows resolve to these actors
            named = ray.get_actor(record["name"])
            assert ray.get(named.node_info.remote(), timeout=60).gpu_ids == record["gpu_ids"]
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
                ranks.append({"name": name, "node": names[info.node_id]})
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
