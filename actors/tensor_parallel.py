"""Tensor parallelism: transformers' own TP plan over a replica's ranks (strategy ``tp``).

transformers applies the architecture's ``tp_plan`` (attention heads and MLP columns split over
the ranks, the head's output gathered) on the meta device, then reads every weight of the
checkpoint as this rank's slice of it (``get_slice`` on safetensors): no rank ever holds the
whole model. It runs on the replica's process group, which the rank has already joined (world =
G), over a device mesh it builds on it; on CPU that is gloo. A training checkpoint named by
``checkpoint=`` (DCP or HF files) is read slice by slice into the TP model built from
``pretrained``'s config (:func:`_load_checkpoint`).

The ranks of a replica then compute the same batch: every forward exchanges activations (an
all-reduce after each attention and MLP block, an all-gather of the logits), never weights. On a
CPU node those all-reduces go through shared memory where the ranks can
(:mod:`rayeval.actors.shm_collectives`). Imports no torch until a rank loads.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from rayeval.actors.errors import ModelLoadError
from rayeval.actors.profiles import ModelShape
from rayeval.actors.sharding import RankContext, ShardStrategy

if TYPE_CHECKING:
    from rayeval.actors.batches import ModelSpec

logger = logging.getLogger(__name__)


class TensorParallel:
    """The ``tp`` strategy (see the module docstring)."""

    name = ShardStrategy.TP
    same_batch = True
    one_node = True

    def model_obstacles(self, shape: ModelShape, shard_size: int) -> list[str]:
        """No TP plan for the architecture, or a head count (or MLP width) G does not divide."""
        if shape.has_tp_plan is False:
            return [
                f"transformers has no tensor-parallel plan for the {shape.model_type} architecture"
            ]
        dims = shape.tp_dimensions()
        if "num_attention_heads" not in dims:
            return ["the model config names no num_attention_heads to split"]
        return [
            f"{name}={value} is not divisible by shard_size {shard_size}"
            for name, value in dims.items()
            if value % shard_size
        ]

    def prepare_process(self, shard_size: int) -> None:
        """Nothing to tune: TP ranks allocate activations, never all-gathered weights."""

    def load(self, spec: ModelSpec, device: Any, shard_size: int) -> Any:
        """This rank's tensor-parallel part of the model, its weights ``DTensor`` parameters.

        Raises:
            ModelLoadError: the checkpoint cannot be read, or transformers cannot shard it.
        """
        import transformers
        from transformers.distributed import DistributedConfig

        from rayeval.actors.checkpoints import from_pretrained_kwargs, load_config, resolve_dtype

        config = load_config(spec)
        dtype = resolve_dtype(spec.dtype, config)
        if device.type == "cuda":
            # transformers binds the rank to device LOCAL_RANK: this rank's own GPU.
            os.environ["LOCAL_RANK"] = str(device.index or 0)
        try:
            if spec.checkpoint is not None:
                return _load_checkpoint(spec, config, dtype, DistributedConfig(tp_size=shard_size))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                spec.pretrained,
                dtype=dtype,
                distributed_config=DistributedConfig(tp_size=shard_size),
                **from_pretrained_kwargs(spec),
            )
        except OSError as exc:
            raise ModelLoadError(f"cannot load {spec.pretrained!r}: {exc}") from exc
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            raise ModelLoadError(
                f"transformers could not load {spec.pretrained!r} tensor-parallel over "
                f"{shard_size} ranks ({type(exc).__name__}: {exc}): use --shard_strategy fsdp"
            ) from exc
        model.eval()
        return model

    def collectives(self, rank: RankContext) -> str | None:
        """Shared memory for the activations' all-reduces where every rank of the replica can
        use it (the rest stays on the process group), else the process group."""
        import torch.distributed as dist

        from rayeval.actors import shm_collectives

        # Every rank takes part, so that all decide alike (a rank's environment could differ).
        able: list[Any] = [None] * rank.shard_size
        dist.all_gather_object(able, rank.shared_memory and shm_collectives.available())
        if not all(able):
            return "process group"
        shm = shm_collectives.ShmCollectives.create(
            f"{rank.rendezvous[0]}-{rank.rendezvous[1]}-r{rank.replica}",
            rank.shard_rank,
            rank.shard_size,
            rank.collective_timeout_s,
        )
        if shm is None:
            return "process group"
        if not shm_collectives.route_tensor_parallel_all_reduces(shm):
            logger.warning("this transformers reduces TP activations otherwise: staying on gloo")
            return "process group"
        return "shared memory"

    def after_forward(self, model: Any) -> None:
        """Nothing to release: every rank keeps its slices."""


def _load_checkpoint(spec: ModelSpec, config: Any, dtype: Any, distributed: Any) -> Any:
    """The TP model of ``spec.pretrained``'s config, its slices read from ``spec.checkpoint``.

    transformers builds the model and its TP plan with no weights to load (an empty state dict:
    each rank initialises only its own slices, which are then overwritten); every rank then reads
    exactly its DTensor slices of each tensor from the checkpoint (:mod:`rayeval.actors.weights`).
    """
    import torch
    import transformers

    from rayeval.actors.checkpoints import load_generation_config
    from rayeval.actors.weights import fill, open_source

    assert spec.checkpoint is not None
    source = open_source(spec.checkpoint)
    with torch.device("meta"):
        model_class = type(
            transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=spec.trust_remote_code
            )
        )
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # every weight "MISSING": it is read next
    try:
        model = model_class.from_pretrained(
            None, config=config, state_dict={}, dtype=dtype, distributed_config=distributed
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    fill(model, source, spec.pretrained)
    load_generation_config(model, spec)
    model.eval()
    return model
