"""How a replica shards its model over its G ranks: FSDP2 or tensor parallelism, and which one.

Two strategies load, shard and run a model on a replica's process group:

* **FSDP** (``fsdp``): every rank holds a dim-0 slice of every weight and all-gathers each layer
  before computing it. Any architecture, replicas that span nodes, bit-identical results whatever
  G. Each rank computes its own micro-batch (data parallel inside the replica), so a decode step
  all-gathers every layer's weights for a few tokens: slow to generate with.
* **Tensor parallelism** (``tp``): transformers' own ``tp_plan`` splits the attention heads and the
  MLP columns; the ranks compute the *same* batch together and exchange only activations (an
  all-reduce after each attention and MLP block). Needs an architecture with a TP plan, heads
  that G divides, and the replica's ranks on one node. Partial sums are reduced, so results may
  differ from one G to another in the last bits (still within the fidelity invariant).

``auto`` picks TP wherever it can work and FSDP otherwise. This module decides; it imports no
torch (the driver and the API use it). Loading lives in :mod:`rayeval.actors.model_loading` (FSDP)
and :mod:`rayeval.actors.tensor_parallel` (TP).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from rayeval.actors.errors import ConfigError, LayoutError


class ShardStrategy(StrEnum):
    """How a replica of G > 1 ranks shards its model (a replica of one rank holds it whole)."""

    AUTO = "auto"
    FSDP = "fsdp"
    TP = "tp"

    @property
    def same_batch_on_every_rank(self) -> bool:
        """True when a replica's ranks compute one batch together (TP), False when each rank
        computes its own micro-batch (FSDP)."""
        return self is ShardStrategy.TP


def tp_obstacles(model_config: Any, shard_size: int) -> list[str]:
    """Why tensor parallelism over ``shard_size`` ranks cannot run this model (empty: it can).

    Args:
        model_config: The model's transformers config (``AutoConfig.from_pretrained``).
        shard_size: G, the ranks of one replica.

    Returns:
        One sentence per obstacle: no TP plan for the architecture, or a head count (or MLP
        width) that G does not divide.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else None
    config = text if text is not None else model_config
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if not getattr(config, "base_model_tp_plan", None):
        return [f"transformers has no tensor-parallel plan for the {model_type} architecture"]
    return _divisibility_problems(_sharded_dimensions(config), shard_size)


def tp_obstacles_from_json(config_json: Mapping[str, Any], shard_size: int) -> list[str]:
    """The head and width checks of :func:`tp_obstacles` from a ``config.json`` alone (no TP-plan
    check: that needs transformers' config class)."""
    text = config_json.get("text_config")
    config = text if isinstance(text, Mapping) else config_json
    return _divisibility_problems(_sharded_dimensions(_Attrs(config)), shard_size)


def settle(
    requested: ShardStrategy | str,
    shard_size: int,
    obstacles: list[str],
    split_replicas: list[int],
) -> ShardStrategy:
    """The strategy an evaluation runs with, once its ranks are placed.

    Args:
        requested: The configured strategy (``auto``, ``fsdp`` or ``tp``).
        shard_size: G.
        obstacles: :func:`tp_obstacles` of the model at this G.
        split_replicas: Replicas whose ranks landed on more than one node.

    Returns:
        ``FSDP`` or ``TP`` (``FSDP`` for G = 1, where nothing is sharded).

    Raises:
        ConfigError: ``tp`` was asked for a model it cannot shard.
        LayoutError: ``tp`` was asked and a replica spans nodes.
    """
    requested = ShardStrategy(requested)
    if shard_size == 1 or requested is ShardStrategy.FSDP:
        return ShardStrategy.FSDP
    if requested is ShardStrategy.AUTO:
        return ShardStrategy.FSDP if obstacles or split_replicas else ShardStrategy.TP
    if obstacles:
        raise ConfigError(refusal(obstacles))
    if split_replicas:
        raise LayoutError(
            f"shard_strategy tp needs every replica's {shard_size} ranks on one node, but "
            f"replica(s) {split_replicas} were placed across nodes (other work held parts of "
            "them): retry when the cluster is quieter, or use --shard_strategy auto or fsdp."
        )
    return ShardStrategy.TP


def refusal(obstacles: list[str]) -> str:
    """The message refusing ``shard_strategy tp`` for the given obstacles."""
    return (
        "shard_strategy tp cannot shard this model: "
        + "; ".join(obstacles)
        + ". Use --shard_strategy auto (falls back to FSDP) or fsdp, or a --shard_size that "
        "divides the head counts."
    )


def _sharded_dimensions(config: Any) -> dict[str, int]:
    """The dimensions a TP plan splits over the ranks, as the config names them."""
    heads = getattr(config, "num_attention_heads", None)
    dims = {"num_attention_heads": heads}
    kv_heads = getattr(config, "num_key_value_heads", None)
    dims["num_key_value_heads"] = kv_heads if kv_heads is not None else heads
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate is not None:
        dims["intermediate_size"] = intermediate
    return {name: value for name, value in dims.items() if isinstance(value, int)}


def _divisibility_problems(dims: dict[str, int], shard_size: int) -> list[str]:
    if "num_attention_heads" not in dims:
        return ["the model config names no num_attention_heads to split"]
    return [
        f"{name}={value} is not divisible by shard_size {shard_size}"
        for name, value in dims.items()
        if value % shard_size
    ]


class _Attrs:
    """Attribute access to a config.json mapping."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Any:
        return self._values.get(name)
