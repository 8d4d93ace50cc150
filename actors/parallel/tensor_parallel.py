"""Tensor parallelism: transformers' own TP plan over a replica's ranks (strategy ``tp``).

transformers applies the architecture's ``tp_plan`` (attention heads and MLP columns split over
the ranks, the head's output gathered) on the meta device, then reads every weight of the
checkpoint as this rank's slice of it (``get_slice`` on safetensors): no rank ever holds the
whole model. It runs on the replica's process group, which the rank has already joined (world =
G), over a device mesh it builds on it; on CPU that is gloo. A training checkpoint named by
``checkpoint=`` (DCP or HF files) is read slice by slice into the TP model built from
``pretrained``'s config (:func:`_load_checkpoint`). Delta weights (``delta=``) are then added
to the slices each rank holds, and a LoRA adapter (``peft=``) is applied unmerged with PEFT,
shaped for the split layers (:func:`_apply_adapters`).

The plan is first rewritten so that no sum is split over the ranks
(:mod:`rayeval.actors.parallel.tp_exact`): the layers transformers splits by input features (a
block's output projections) are split by output features, so each dot product is computed whole, as
on one device. The ranks of a replica then compute the same batch: every forward exchanges
activations (all-gathers of the heads, the MLP columns, each block's output and the logits), never
weights. On a CPU node those go through shared memory where the ranks can
(:mod:`rayeval.actors.parallel.shm_collectives`). Imports no torch until a rank loads.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from rayeval.actors.errors import ModelLoadError, field
from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel import tp_exact
from rayeval.actors.parallel.sharding import RankContext
from rayeval.actors.profiles import ModelShape

if TYPE_CHECKING:
    from rayeval.actors.batches import ModelSpec

logger = logging.getLogger(__name__)

#: Set (to anything) to let ``tp`` shard an architecture it was not checked on (the conformance
#: matrix sets it to try every one); read on the driver, where the strategy is settled.
UNCHECKED_ENV = "RAYEVAL_UNCHECKED_TP"


class TensorParallel:
    """The ``tp`` strategy (see the module docstring)."""

    name = ShardStrategy.TP
    same_batch = True
    one_node = True

    def __init__(self) -> None:
        self._gather = tp_exact.Gather()

    def model_obstacles(self, shape: ModelShape, shard_size: int) -> list[str]:
        """No TP plan for the architecture, one that splits sums rayeval cannot keep whole, an
        architecture it was not checked on (:attr:`ModelProfile.tensor_parallel`), or a head
        count (or MLP width) G does not divide."""
        if shape.has_tp_plan is False:
            return [
                f"transformers has no tensor-parallel plan for the {shape.model_type} architecture"
            ]
        _, inexact = tp_exact.exact_plan(shape.tp_plan or {})
        if inexact:
            return [
                f"transformers' tensor-parallel plan for {shape.model_type} adds partial sums "
                f"over the ranks ({', '.join(inexact)}): its results would depend on shard_size"
            ]
        if not shape.profile.tensor_parallel and not os.environ.get(UNCHECKED_ENV):
            return [
                f"tensor parallelism is not checked against lm-eval hf for the {shape.model_type} "
                f"architecture (docs/conformance.md lists those it is; {UNCHECKED_ENV}=1 tries "
                "it anyway: check the answers with `rayeval parity` first)"
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

        from rayeval.actors.weights.hf_files import (
            from_pretrained_kwargs,
            load_config,
            resolve_dtype,
        )

        config = load_config(spec)
        dtype = resolve_dtype(spec.dtype, config)
        if device.type == "cuda":
            # transformers binds the rank to device LOCAL_RANK: this rank's own GPU.
            os.environ["LOCAL_RANK"] = str(device.index or 0)
        tp_exact.register(self._gather)
        try:
            meta_model = _meta_model(spec, config)
            distributed = DistributedConfig(
                tp_size=shard_size, tp_plan=_exact_plan(meta_model, config)
            )
            if spec.checkpoint is not None:
                model = _load_checkpoint(spec, meta_model, config, dtype, distributed)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    spec.pretrained,
                    dtype=dtype,
                    distributed_config=distributed,
                    **from_pretrained_kwargs(spec),
                )
        except OSError as exc:
            raise ModelLoadError(f"cannot load {spec.pretrained!r}: {exc}") from exc
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            raise ModelLoadError(
                f"transformers could not load {spec.pretrained!r} tensor-parallel over "
                f"{shard_size} ranks ({type(exc).__name__}: {exc}): use "
                f"{field('parallelism', 'shard_strategy', value='fsdp')}"
            ) from exc
        model.eval()
        _apply_adapters(model, spec)
        return model

    def collectives(self, rank: RankContext) -> str | None:
        """Shared memory for the activations' all-gathers where every rank of the replica is a
        CPU rank that can use it (the rest stays on the process group), else the process
        group (always on GPUs: NCCL carries them)."""
        import torch.distributed as dist

        from rayeval.actors.parallel import shm_collectives

        # Every rank takes part, so that all decide alike (a rank's environment could differ).
        able: list[Any] = [None] * rank.shard_size
        usable = rank.shared_memory and rank.device_type == "cpu" and shm_collectives.available()
        dist.all_gather_object(able, usable)
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
        self._gather.shm = shm
        return "shared memory"

    def after_forward(self, model: Any) -> None:
        """Nothing to release: every rank keeps its slices."""


def _apply_adapters(model: Any, spec: ModelSpec) -> None:
    """Add ``spec.delta``'s regions this rank holds, or apply ``spec.peft``'s LoRA unmerged
    with PEFT, shaped for this rank's split layers (:func:`tp_exact.split_lora`).

    Raises:
        ModelLoadError: the weights cannot be applied (a resized vocabulary, which the driver
            refuses first under this strategy, or PEFT fails).
    """
    from rayeval.actors.weights.adapters import add_delta, apply_adapter, load_adapter_weights

    if spec.delta is not None:  # each rank adds the regions it holds
        add_delta(model, spec.delta, spec.pretrained)
    if spec.peft is None:
        return
    if spec.vocab_size is not None:
        raise ModelLoadError(
            f"peft={spec.peft}: a vocabulary resized for the tokenizer is not applied under "
            f"tensor parallelism: use {field('parallelism', 'shard_strategy', value='fsdp')}"
        )
    # PEFT builds each LoRA B with this rank's rows of its layer, so it cannot load the saved
    # (whole) B: the matrices are written once the layers are shaped for their split.
    apply_adapter(model, spec.peft, spec.revision, split=True)
    tp_exact.split_lora(model)
    load_adapter_weights(model, spec.peft)


def _meta_model(spec: ModelSpec, config: Any) -> Any:
    """The causal-LM model of ``config``, built on the meta device (no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=spec.trust_remote_code
        )


def _exact_plan(meta_model: Any, config: Any) -> dict[str, str] | None:
    """The overrides that make ``meta_model``'s TP plan split no sum (None: none needed).

    Raises:
        ModelLoadError: the plan splits sums that cannot be rewritten (the driver refuses such
            a model first: :meth:`TensorParallel.model_obstacles`).
    """
    overrides, inexact = tp_exact.exact_plan(meta_model.tp_plan)
    if inexact:
        raise ModelLoadError(
            f"transformers' tensor-parallel plan for {config.model_type} adds partial sums over "
            f"the ranks ({', '.join(inexact)}): use "
            f"{field('parallelism', 'shard_strategy', value='fsdp')}"
        )
    return overrides or None  # an empty plan would turn tensor parallelism off


def _load_checkpoint(
    spec: ModelSpec, meta_model: Any, config: Any, dtype: Any, distributed: Any
) -> Any:
    """The TP model of ``spec.pretrained``'s config, its slices read from ``spec.checkpoint``.

    transformers builds the model and its TP plan with no weights to load (an empty state dict:
    each rank initialises only its own slices, which are then overwritten); every rank then reads
    exactly its DTensor slices of each tensor from the checkpoint
    (:mod:`rayeval.actors.weights.sources`).
    """
    import transformers

    from rayeval.actors.weights.hf_files import load_generation_config
    from rayeval.actors.weights.sources import fill, open_source

    assert spec.checkpoint is not None
    source = open_source(spec.checkpoint)
    model_class = type(meta_model)
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
