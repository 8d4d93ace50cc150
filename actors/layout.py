"""The parallel layout: R data-parallel replicas x G shard ranks, the resources and the waits.

This is the rank layer's vocabulary that the configuration (``rayeval.service.vocabulary.config``)
and the API need too, so it stays here, beside the ranks it describes, and imports neither torch nor
Ray. :class:`ParallelLayout` is the only place that does rank arithmetic. It validates itself on
construction and checks whether a cluster can ever hold it, failing fast with every number in the
message. No torch here: the driver and the API use it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from rayeval.actors.errors import LayoutError, field


class DeviceKind(StrEnum):
    """What one rank holds: a GPU (NCCL, bf16 typical) or a CPU slot (gloo, fp32)."""

    CPU = "cpu"
    CUDA = "cuda"

    @property
    def backend(self) -> str:
        """The torch.distributed backend for process groups of this kind of rank."""
        return "nccl" if self is DeviceKind.CUDA else "gloo"


class ShardStrategy(StrEnum):
    """The strategies a configuration may name: ``auto`` or a registered one
    (:mod:`rayeval.actors.parallel.strategies`)."""

    AUTO = "auto"
    FSDP = "fsdp"
    TP = "tp"


class PlacementPolicy(StrEnum):
    """How the ranks of a layout are placed on the cluster's nodes.

    ``AUTO`` spreads unsharded replicas over nodes and keeps each sharded replica on one node when
    a node can hold it (``rayeval.actors.placement`` explains why). ``PACK`` fills as few nodes as
    possible, whatever G. ``SPREAD`` puts the ranks on as many nodes as possible (best effort, as
    Ray's ``SPREAD``): with G > 1 and a free node per rank, a replica's ranks sit on different
    nodes and its all-gathers cross the network (a node that gets G ranks still holds a whole
    replica). That is slower, and it is what to ask for to rehearse, or to test, a replica that
    spans nodes.
    """

    AUTO = "auto"
    PACK = "pack"
    SPREAD = "spread"


@dataclass(frozen=True)
class Timeouts:
    """Every wait of an evaluation on its ranks, in seconds (the configuration's
    ``TimeoutSettings`` takes its defaults from here).

    Args:
        placement_s: For the placement group to be scheduled.
        load_s: For every rank to join its process group and load the model.
        step_s: For one batch on one replica (a stuck replica becomes an error after this).
        collective_s: For one collective inside a replica's process group.
    """

    placement_s: float = 120.0
    load_s: float = 1800.0
    step_s: float = 900.0
    collective_s: float = 600.0


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits: its replica, its rank inside that replica's group, and globally."""

    replica: int
    shard_rank: int
    global_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """``num_replicas`` (R) replicas, each one torch process group of ``shard_size`` (G) ranks.

    Args:
        num_replicas: Data-parallel copies of the model; they never talk to each other.
        shard_size: Ranks per replica; the model is sharded over them with FSDP2 (G=1: plain).
        device: What each rank holds.
        cpus_per_rank: CPU slots reserved per rank (the only resource of a CPU rank).
        placement: How the ranks are placed on nodes.

    Raises:
        LayoutError: if any number is out of range (all problems are reported at once).
    """

    num_replicas: int = 1
    shard_size: int = 1
    device: DeviceKind = DeviceKind.CPU
    cpus_per_rank: int = 1
    placement: PlacementPolicy = PlacementPolicy.AUTO

    def __post_init__(self) -> None:
        problems = [
            f"{field('parallelism', name)} must be an integer >= 1, got {value!r}"
            for name, value in (
                ("num_replicas", self.num_replicas),
                ("shard_size", self.shard_size),
                ("cpus_per_rank", self.cpus_per_rank),
            )
            if not isinstance(value, int) or isinstance(value, bool) or value < 1
        ]
        if self.placement not in {policy.value for policy in PlacementPolicy}:
            problems.append(
                f"{field('parallelism', 'placement')} must be one of "
                f"{', '.join(p.value for p in PlacementPolicy)}, "
                f"got {self.placement!r}"
            )
        if problems:
            raise LayoutError("invalid layout: " + "; ".join(problems))
        object.__setattr__(self, "device", DeviceKind(self.device))
        object.__setattr__(self, "placement", PlacementPolicy(self.placement))

    @property
    def world(self) -> int:
        """Total ranks (actors): R x G."""
        return self.num_replicas * self.shard_size

    @property
    def sharded(self) -> bool:
        """True when replicas span several ranks and the model is wrapped in FSDP2."""
        return self.shard_size > 1

    def describe(self) -> str:
        """A short human form, e.g. ``2x2 (4 cpu ranks)``, or ``1x2 (2 cpu ranks, spread)``."""
        placed = "" if self.placement is PlacementPolicy.AUTO else f", {self.placement}"
        return f"{self.num_replicas}x{self.shard_size} ({self.world} {self.device} ranks{placed})"

    def coords(self) -> list[RankCoord]:
        """Every rank in global order: replica-major, then shard rank."""
        return [
            RankCoord(replica=r, shard_rank=s, global_rank=r * self.shard_size + s)
            for r in range(self.num_replicas)
            for s in range(self.shard_size)
        ]

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one rank."""
        if self.device is DeviceKind.CUDA:
            return {"GPU": 1.0, "CPU": float(self.cpus_per_rank)}
        return {"CPU": float(self.cpus_per_rank)}

    def total_resources(self) -> dict[str, float]:
        """What the whole layout reserves on the cluster."""
        return {key: value * self.world for key, value in self.bundle().items()}

    def check_fits(
        self,
        cluster_total: Mapping[str, float],
        where: str = "the cluster",
        more: str = "add nodes to the Ray cluster",
    ) -> None:
        """Refuse a layout that the cluster can never hold, whatever else is running.

        The one rule of every door: the service applies it to its cluster when it accepts an
        evaluation, ``rayeval run`` to this machine before it starts an embedded Ray (and to an
        existing cluster once connected), the ranks' group again before placing.

        Args:
            cluster_total: The cluster's total resources (``ray.cluster_resources()``), or what
                a Ray embedded here would have.
            where: What ``cluster_total`` describes, as the message names it.
            more: The other way to make room, after lowering the layout.

        Raises:
            LayoutError: naming requested and available amounts and how to fix it.
        """
        short = {
            key: (need, float(cluster_total.get(key, 0.0)))
            for key, need in self.total_resources().items()
            if float(cluster_total.get(key, 0.0)) < need
        }
        if not short:
            return
        detail = ", ".join(
            f"{need:g} {key} requested, {have:g} in {where}" for key, (need, have) in short.items()
        )
        if "GPU" in short and short["GPU"][1] == 0:
            fix = (
                f"{where[0].upper()}{where[1:]} has no GPU: run on the CPU with "
                f"{field('device', value='cpu')} (or {field('device', value='auto')}, which takes "
                f"GPUs only where {where} has some)."
            )
        else:
            fix = (
                f"Lower {field('parallelism', 'num_replicas')} / "
                f"{field('parallelism', 'shard_size')}, or {more}."
            )
        whole = "the whole cluster" if where == "the cluster" else where
        raise LayoutError(f"layout {self.describe()} needs more than {whole} has: {detail}. {fix}")
