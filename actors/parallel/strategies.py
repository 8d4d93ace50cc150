"""The registered sharding strategies (:mod:`rayeval.actors.parallel.sharding` is their
interface), in the order ``auto`` prefers them, and how an evaluation settles on one.

Two are registered: tensor parallelism (``tp``, :mod:`rayeval.actors.parallel.tensor_parallel`)
first, then FSDP2 (``fsdp``, :mod:`rayeval.actors.parallel.fsdp`). Their modules import torch,
so they are imported on first use: the driver and the API read this registry without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rayeval.actors.errors import ConfigError, LayoutError, field
from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel.sharding import ShardingStrategy
from rayeval.actors.profiles import ModelShape


def _registry() -> dict[ShardStrategy, ShardingStrategy]:
    from rayeval.actors.parallel.fsdp import FSDP2
    from rayeval.actors.parallel.tensor_parallel import TensorParallel

    return {ShardStrategy.TP: TensorParallel(), ShardStrategy.FSDP: FSDP2()}


#: Every registered strategy by name, in the order ``auto`` prefers them (filled on first use).
STRATEGIES: dict[ShardStrategy, ShardingStrategy] = {}


def strategy(name: ShardStrategy | str) -> ShardingStrategy:
    """The registered strategy called ``name``.

    Raises:
        ConfigError: ``auto`` or an unknown name (``auto`` is settled by :func:`settle`).
    """
    if not STRATEGIES:
        STRATEGIES.update(_registry())
    try:
        return STRATEGIES[ShardStrategy(name)]
    except (KeyError, ValueError):
        known = ", ".join(s.value for s in ShardStrategy)
        raise ConfigError(f"no sharding strategy {name!r}: use one of {known}") from None


def registered() -> list[ShardingStrategy]:
    """Every registered strategy, in the order ``auto`` prefers them."""
    strategy(ShardStrategy.FSDP)  # fills the registry
    return list(STRATEGIES.values())


def model_obstacles(config: Any, shard_size: int) -> dict[ShardStrategy, list[str]]:
    """Per registered strategy, why it cannot shard this model over ``shard_size`` ranks.

    Args:
        config: The model's transformers config, or its ``config.json`` mapping.
        shard_size: G.
    """
    shape = ModelShape(config)
    return {s.name: s.model_obstacles(shape, shard_size) for s in registered()}


def settle(
    requested: ShardStrategy | str,
    shard_size: int,
    obstacles: Mapping[ShardStrategy, Sequence[str]],
    split_replicas: Sequence[int],
) -> ShardStrategy:
    """The strategy an evaluation runs with, once its ranks are placed.

    Args:
        requested: The configured strategy (``auto`` or a registered name).
        shard_size: G.
        obstacles: :func:`model_obstacles` of the model at this G.
        split_replicas: Replicas whose ranks landed on more than one node.

    Returns:
        A registered strategy: for ``auto`` the first in preference order that can run; FSDP
        for G = 1, where nothing is sharded.

    Raises:
        ConfigError: the requested strategy cannot shard this model.
        LayoutError: the requested strategy needs a replica on one node and one spans nodes.
    """
    requested = ShardStrategy(requested)
    if shard_size == 1:
        return ShardStrategy.FSDP
    if requested is ShardStrategy.AUTO:
        for candidate in registered():
            if not obstacles.get(candidate.name) and not (candidate.one_node and split_replicas):
                return candidate.name
        return ShardStrategy.FSDP
    chosen = strategy(requested)
    if obstacles.get(requested):
        raise ConfigError(refusal(requested, obstacles[requested]))
    if chosen.one_node and split_replicas:
        raise LayoutError(
            f"shard_strategy {requested} needs every replica's {shard_size} ranks on one node, "
            f"but replica(s) {list(split_replicas)} were placed across nodes (other work held "
            "parts of them): retry when the cluster is quieter, or use "
            f"{field('parallelism', 'shard_strategy', value='auto')} or fsdp."
        )
    return requested


def refusal(name: ShardStrategy | str, obstacles: Sequence[str]) -> str:
    """The message refusing ``shard_strategy name`` for the given obstacles."""
    return (
        f"shard_strategy {ShardStrategy(name)} cannot shard this model: "
        + "; ".join(obstacles)
        + f". Use {field('parallelism', 'shard_strategy', value='auto')} (falls back to FSDP) "
        f"or fsdp, or a {field('parallelism', 'shard_size')} that divides the head counts."
    )
