"""How a replica shards its model over its G ranks: the strategy interface (the registry of
strategies is :mod:`rayeval.actors.parallel.strategies`).

A sharding strategy loads, shards and runs a model on a replica's process group. Everything the
rest of rayeval needs to know about one is behind :class:`ShardingStrategy`: what it refuses and
why (:meth:`~ShardingStrategy.model_obstacles`, and :attr:`~ShardingStrategy.one_node` for the
placement), whether the ranks of a replica compute one micro-batch together
(:attr:`~ShardingStrategy.same_batch`: the dispatcher sends the same micro-batch to every rank and
takes one answer) or one each, how a rank loads the model, what carries its collectives, and what
a rank does after each forward. The planner, the dispatcher and the service never ask which
strategy runs.

Two are registered (:mod:`rayeval.actors.parallel.strategies`, in the order ``auto`` prefers
them):

* **tensor parallelism** (``tp``, :mod:`rayeval.actors.parallel.tensor_parallel`): transformers' own
  ``tp_plan`` splits the heads and MLP columns; the ranks compute the same batch and exchange
  activations only. Needs a TP plan that splits no sum (rewritten so by
  :mod:`rayeval.actors.parallel.tp_exact`), dimensions G divides, and a replica on one node; results
  are one rank's results (in bf16 up to the matrix library's kernel choice for a slice:
  :mod:`rayeval.actors.parallel.tp_exact`). The fast way to generate.
* **FSDP2** (``fsdp``, :mod:`rayeval.actors.parallel.fsdp`): every rank holds a slice of every
  weight and all-gathers each layer before computing it; each rank computes its own micro-batch. Any
  architecture, replicas across nodes, bit-identical results for every G. Also what a replica of
  one rank (G = 1) runs: the model whole, nothing sharded.

A new strategy is one module implementing :class:`ShardingStrategy` (torch imported inside its
rank-side methods only: the driver and the API read the registry), its name in
:class:`ShardStrategy`, and its class in the registry. This module imports no torch, and no
strategy: they import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rayeval.actors.layout import ShardStrategy
from rayeval.actors.profiles import ModelShape

if TYPE_CHECKING:
    from rayeval.actors.batches import ModelSpec


@dataclass(frozen=True)
class RankContext:
    """What a rank tells its strategy about itself when it sets up its collectives.

    Args:
        replica: The replica's number.
        shard_rank: This rank's place in its replica's process group.
        shard_size: G.
        rendezvous: The replica's rendezvous (address, port): unique per replica and cluster.
        collective_timeout_s: Longest wait of one collective.
        shared_memory: Whether the configuration lets ranks on one node exchange activations
            through shared memory (``parallelism.shm_collectives``).
        device_type: The rank's device type (``cpu`` or ``cuda``): shared memory is for CPU
            ranks only.
    """

    replica: int
    shard_rank: int
    shard_size: int
    rendezvous: tuple[str, int]
    collective_timeout_s: float
    shared_memory: bool = True
    device_type: str = "cpu"


class ShardingStrategy(Protocol):
    """One way to load, shard and run a model on a replica's G ranks."""

    #: The name a configuration uses for it.
    name: ShardStrategy
    #: Whether a replica's ranks compute one micro-batch together (True) or one each (False).
    same_batch: bool
    #: Whether a replica's ranks must share one node.
    one_node: bool

    def model_obstacles(self, shape: ModelShape, shard_size: int) -> list[str]:
        """Why this strategy cannot shard this model over ``shard_size`` ranks (empty: it can)."""
        ...

    def prepare_process(self, shard_size: int) -> None:
        """Tune the rank's process before anything is allocated (rank side; CPU ranks only:
        a GPU rank's tensors live in device memory, not on the host's heap)."""
        ...

    def load(self, spec: ModelSpec, device: Any, shard_size: int) -> Any:
        """Load this rank's part of the model in eval mode on ``device`` (rank side; the
        replica's process group is initialised when ``shard_size`` > 1)."""
        ...

    def collectives(self, rank: RankContext) -> str | None:
        """Set up what carries the replica's collectives and name it (None for G = 1)."""
        ...

    def after_forward(self, model: Any) -> None:
        """Called after every forward or ``generate`` of the rank, even one that raised."""
        ...
