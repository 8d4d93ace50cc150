"""Where the ranks of one evaluation run: its placement group and which bundle holds which rank.

An evaluation reserves one placement group, named by the evaluation, with one bundle per rank.
Once Ray has placed the bundles, :func:`assign_ranks` decides which bundle becomes which global
rank: a replica's G ranks are taken from one node whenever that node holds G bundles of the group,
and ranks are ordered by node, then device. Only then are the rank actors created, so an actor's
name (``<evaluation>-r<replica>-s<shard>``) always tells where it sits. :class:`ParallelLayout`
still owns the rank arithmetic; this module only maps its ranks onto bundles.

Why a strategy per shard size (:func:`choose_strategy`, placement policy ``auto``):

* G = 1: ``SPREAD``. Each replica is one rank, so spreading bundles spreads replicas over nodes:
  more host CPU, memory and PCIe bandwidth per replica, and a lost node takes fewer replicas with
  it. ``SPREAD`` is best effort, so a cluster with fewer free nodes than replicas still fits them.
* G > 1: ``PACK``. Ray has no "G bundles together" constraint inside one group: ``SPREAD`` would
  scatter a replica's ranks over nodes, and its FSDP all-gathers (one per layer, every forward)
  would then cross the network. ``PACK`` fills the nodes with the most room first, so on free
  nodes a replica lands on one node whenever a node can hold it, a replica larger than a node
  spans few nodes, and whole nodes stay free for other evaluations. The price: replicas share a
  node when one node holds several of them (they never talk to each other, so only host
  resources are shared), and spread over nodes only when a node cannot hold more. Ray places
  around whatever else holds parts of the nodes at that moment, so a busy cluster can still split
  a replica that one node could hold; :func:`reserve` then logs a warning (same results, slower).

That is the ``auto`` placement policy. A layout may ask for ``pack`` or ``spread`` instead
(:class:`rayeval.actors.layout.PlacementPolicy`, ``--placement``): ``spread`` with G > 1 puts a
replica's ranks on different nodes, which a test or a rehearsal of a multi-node replica needs
(``deploy/netns``); the rank assignment below is the same for every policy.

GPU ranks: a bundle reserves one specific GPU of its node, so a short probe task in each bundle
reads that GPU's id before any rank actor starts; this orders ranks by device. Inside an actor,
:func:`cuda_device_index` turns the id Ray assigned into the local CUDA index, whether or not Ray
narrowed ``CUDA_VISIBLE_DEVICES`` to that one GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayeval.actors.errors import LayoutError, ResourcesUnavailableError
from rayeval.actors.layout import DeviceKind, ParallelLayout, PlacementPolicy

logger = logging.getLogger(__name__)


class PlacementStrategy(StrEnum):
    """The Ray placement-group strategies rayeval uses (see the module docstring for why)."""

    PACK = "PACK"
    SPREAD = "SPREAD"


def choose_strategy(layout: ParallelLayout) -> PlacementStrategy:
    """The layout's placement policy as a Ray strategy; ``auto``: ``SPREAD`` for unsharded
    replicas (G = 1), ``PACK`` for sharded ones (G > 1)."""
    if layout.placement is PlacementPolicy.PACK:
        return PlacementStrategy.PACK
    if layout.placement is PlacementPolicy.SPREAD or layout.shard_size == 1:
        return PlacementStrategy.SPREAD
    return PlacementStrategy.PACK


@dataclass(frozen=True)
class BundleSite:
    """Where one bundle of the placement group landed.

    Args:
        node_id: The Ray node id (hex).
        device: The GPU id on that node as Ray reports it (``ray.get_gpu_ids()``); None for CPU
            ranks, which have no device of their own.
    """

    node_id: str
    device: str | None = None


def assign_ranks(sites: Sequence[BundleSite], layout: ParallelLayout) -> list[int]:
    """Choose the bundle of every global rank from where Ray placed the bundles.

    Nodes are taken in order (most bundles of this group first, then node id), and each node's
    bundles in device order. Every run of G bundles on one node becomes a replica of its own; the
    bundles left over on each node (fewer than G) are joined, in node order, into the replicas
    that must span nodes. No assignment has more replicas on a single node than this one, since a
    node holding ``c`` bundles can host at most ``c // G`` replicas. Inside every replica, shard
    ranks are ordered by node, then device; replicas on one node come first, in node order.

    Args:
        sites: Where each bundle landed, indexed by bundle.
        layout: The layout whose ranks the bundles hold.

    Returns:
        The bundle index of each global rank (index ``i`` is global rank ``i``).

    Raises:
        LayoutError: if the number of bundles is not the layout's world size.
    """
    if len(sites) != layout.world:
        raise LayoutError(
            f"layout {layout.describe()} needs {layout.world} bundles, the placement group has "
            f"{len(sites)}"
        )
    by_node: dict[str, list[int]] = {}
    for bundle, site in enumerate(sites):
        by_node.setdefault(site.node_id, []).append(bundle)
    nodes = sorted(by_node, key=lambda node: (-len(by_node[node]), node))
    size = layout.shard_size
    whole: list[list[int]] = []
    leftover: list[int] = []
    for node in nodes:
        bundles = sorted(by_node[node], key=lambda b: (_device_key(sites[b].device), b))
        cut = len(bundles) - len(bundles) % size
        whole += [bundles[start : start + size] for start in range(0, cut, size)]
        leftover += bundles[cut:]
    replicas = whole + [leftover[start : start + size] for start in range(0, len(leftover), size)]
    order = [0] * layout.world
    for coord in layout.coords():
        order[coord.global_rank] = replicas[coord.replica][coord.shard_rank]
    return order


def _device_key(device: str | None) -> tuple[int, int, str]:
    """Numeric GPU ids in numeric order (2 before 10), then any other id (UUIDs) by text."""
    if device is None:
        return (0, 0, "")
    if device.isdigit():
        return (1, int(device), "")
    return (2, 0, device)


@dataclass(frozen=True)
class Placement:
    """An evaluation's placement group and where each of its global ranks runs.

    Args:
        pg: The placement group (one bundle per rank, named by the evaluation).
        strategy: The strategy it was created with.
        bundles: The bundle index of each global rank.
        sites: Where each global rank runs (node and device), indexed by global rank.
    """

    pg: PlacementGroup
    strategy: PlacementStrategy
    bundles: tuple[int, ...]
    sites: tuple[BundleSite, ...]

    def scheduling(self, global_rank: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts a rank's actor into its bundle."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundles[global_rank]
        )

    def replica_sites(self, layout: ParallelLayout) -> list[list[BundleSite]]:
        """Where each replica's ranks run, in shard-rank order."""
        replicas: list[list[BundleSite]] = [[] for _ in range(layout.num_replicas)]
        for coord in layout.coords():
            replicas[coord.replica].append(self.sites[coord.global_rank])
        return replicas

    def split_replicas(self, layout: ParallelLayout) -> list[int]:
        """The replicas whose ranks landed on more than one node."""
        return [
            replica
            for replica, sites in enumerate(self.replica_sites(layout))
            if len({site.node_id for site in sites}) > 1
        ]

    def describe(self, layout: ParallelLayout) -> str:
        """One entry per replica for the logs, e.g. ``r0: 3f2a61c0[gpu 0] 3f2a61c0[gpu 1]``."""
        return "; ".join(
            f"r{r}: "
            + " ".join(
                site.node_id[:8] + (f"[gpu {site.device}]" if site.device is not None else "")
                for site in sites
            )
            for r, sites in enumerate(self.replica_sites(layout))
        )


def reserve(name: str, layout: ParallelLayout, timeout_s: float) -> Placement:
    """Create the evaluation's placement group, wait for it and assign its bundles to ranks.

    Args:
        name: The evaluation's name; names the placement group.
        layout: R x G ranks, one bundle each.
        timeout_s: Bound on waiting for the group (and, for GPU ranks, on reading its GPU ids).

    Returns:
        The placement; the caller removes ``placement.pg`` when the evaluation ends.

    Raises:
        ResourcesUnavailableError: if the group is not ready within the timeout, or a GPU bundle
            cannot be read. Nothing is left reserved on failure.
    """
    strategy = choose_strategy(layout)
    pg = placement_group([layout.bundle()] * layout.world, strategy=strategy.value, name=name)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            available = {k: v for k, v in ray.available_resources().items() if k in layout.bundle()}
            raise ResourcesUnavailableError(
                f"layout {layout.describe()} needs {layout.total_resources()} but only {available} "
                f"became free within {timeout_s:g}s: wait for other evaluations to finish, lower "
                "--num_replicas / --shard_size, or add nodes."
            )
        sites = _bundle_sites(pg, layout, timeout_s)
        bundles = assign_ranks(sites, layout)
    except BaseException:
        remove_placement_group(pg)
        raise
    placement = Placement(pg, strategy, tuple(bundles), tuple(sites[b] for b in bundles))
    logger.info("placed %s (%s): %s", name, strategy.value, placement.describe(layout))
    _warn_if_split(name, layout, placement)
    return placement


def _warn_if_split(name: str, layout: ParallelLayout, placement: Placement) -> None:
    """Say so when a replica spans nodes although one node could hold it (unless asked to).

    Ray places the bundles around whatever else holds parts of the nodes at that moment, and one
    placement group cannot require "these G bundles together"; such a replica still computes the
    same results, only its all-gathers cross the network.
    """
    if layout.placement is PlacementPolicy.SPREAD:
        return
    split = [
        r
        for r, sites in enumerate(placement.replica_sites(layout))
        if len({site.node_id for site in sites}) > 1
    ]
    if not split:
        return
    bundle = layout.bundle()
    largest = max(
        (
            min(int(node["Resources"].get(key, 0.0) // amount) for key, amount in bundle.items())
            for node in ray.nodes()
            if node["Alive"]
        ),
        default=0,
    )
    if largest >= layout.shard_size:
        logger.warning(
            "%s: replica(s) %s span nodes although a node can hold all %d ranks of a replica: "
            "other work held parts of the nodes when it was placed. Results are the same; the "
            "replicas' all-gathers cross the network, so they run slower.",
            name,
            split,
            layout.shard_size,
        )


def _bundle_sites(pg: PlacementGroup, layout: ParallelLayout, timeout_s: float) -> list[BundleSite]:
    """Each bundle's node (from the GCS) and, for GPU ranks, its GPU id (from a probe task)."""
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    if layout.device is not DeviceKind.CUDA:
        return [BundleSite(nodes[bundle]) for bundle in range(layout.world)]
    probe = ray.remote(_assigned_gpu_ids)
    refs = [
        probe.options(
            num_cpus=0,
            num_gpus=1,
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
        ).remote()
        for bundle in range(layout.world)
    ]
    try:
        gpu_ids = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.RayError as exc:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise ResourcesUnavailableError(
            f"the GPUs of the placement group could not be read within {timeout_s:g}s "
            f"({type(exc).__name__}): check that the GPU nodes can start Ray workers (see the Ray "
            "dashboard), or raise --placement_timeout."
        ) from None
    sites = []
    for bundle, ids in enumerate(gpu_ids):
        if len(ids) != 1:
            raise ResourcesUnavailableError(
                f"bundle {bundle} on node {nodes[bundle]} holds GPU ids {ids}, expected exactly "
                "one: check the GPU resources that node declares to Ray (--num-gpus)."
            )
        sites.append(BundleSite(nodes[bundle], ids[0]))
    return sites


def _assigned_gpu_ids() -> list[str]:
    """The ids of the GPUs Ray gave the calling task (run inside one bundle by the probe)."""
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def cuda_device_index(gpu_ids: Sequence[object], visible_devices: str | None) -> int:
    """The local CUDA index (for ``torch.cuda.set_device``) of the one GPU Ray gave this rank.

    Ray names the GPU it assigned by its node-level id (``ray.get_gpu_ids()``). By default it also
    sets ``CUDA_VISIBLE_DEVICES`` to just that id, so the GPU is local index 0, whatever its id and
    however many ranks share the node. Where Ray does not narrow the variable
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``, or a node started with a list of devices),
    the index is the id's position in ``CUDA_VISIBLE_DEVICES``, or the id itself when the variable
    is unset (every GPU visible, numbered as Ray numbers them).

    Args:
        gpu_ids: ``ray.get_gpu_ids()`` of the rank.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` of the rank's process (None: unset).

    Returns:
        The index of the rank's GPU among the devices its process can see.

    Raises:
        ResourcesUnavailableError: if the rank holds no GPU or several, or cannot see its GPU.
    """
    ids = [str(gpu).strip() for gpu in gpu_ids]
    if len(ids) != 1:
        raise ResourcesUnavailableError(
            f"a GPU rank must hold exactly one GPU, Ray assigned {ids or 'none'}: the layout asks "
            "for cuda ranks, so every rank actor needs num_gpus=1 (use --device cpu on a cluster "
            "without GPUs)."
        )
    (gpu,) = ids
    if visible_devices is None:
        if not gpu.isdigit():
            raise ResourcesUnavailableError(
                f"Ray assigned GPU {gpu!r} but CUDA_VISIBLE_DEVICES is unset, so its CUDA index is "
                "unknown: set CUDA_VISIBLE_DEVICES on the node or let Ray set it per actor."
            )
        return int(gpu)
    visible = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if gpu not in visible:
        raise ResourcesUnavailableError(
            f"Ray assigned GPU {gpu!r} but this rank's CUDA_VISIBLE_DEVICES is "
            f"{visible_devices!r}: do not override CUDA_VISIBLE_DEVICES in the actors' "
            "environment (Ray sets it per actor)."
        )
    return visible.index(gpu)
