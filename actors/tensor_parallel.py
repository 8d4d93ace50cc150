"""Loading a Hugging Face causal LM tensor-parallel over a replica's ranks (transformers' TP).

transformers applies the architecture's own ``tp_plan`` (attention heads and MLP columns split
over the ranks, the head's output gathered) on the meta device, then reads every weight of the
checkpoint as this rank's slice of it (``get_slice`` on safetensors): no rank ever holds the
whole model. It runs on the replica's process group, which the rank has already joined (world =
G), over a device mesh it builds on it; on CPU that is gloo.

The ranks of a replica then compute the same batch: every forward exchanges activations
(an all-reduce after each attention and MLP block, an all-gather of the logits), never weights.
"""

from __future__ import annotations

import os

import torch
import transformers
from torch import nn

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ModelLoadError
from rayeval.actors.model_loading import from_pretrained_kwargs, load_config, resolve_dtype


def load_tensor_parallel(spec: ModelSpec, device: torch.device, shard_size: int) -> nn.Module:
    """Load this rank's tensor-parallel part of the model, in eval mode, on ``device``.

    The process group of the replica (``shard_size`` ranks) must be initialised.

    Args:
        spec: What to load.
        device: This rank's device (CUDA: already the current device).
        shard_size: G, the ranks of the replica and the tensor-parallel degree.

    Returns:
        The model, its sharded weights ``DTensor`` parameters.

    Raises:
        ModelLoadError: the checkpoint cannot be read, or transformers cannot shard it.
    """
    from transformers.distributed import DistributedConfig

    config = load_config(spec)
    dtype = resolve_dtype(spec.dtype, config)
    if device.type == "cuda":
        # transformers binds the rank to device LOCAL_RANK: this rank's own GPU.
        os.environ["LOCAL_RANK"] = str(device.index or 0)
    try:
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
            f"transformers could not load {spec.pretrained!r} tensor-parallel over {shard_size} "
            f"ranks ({type(exc).__name__}: {exc}): use --shard_strategy fsdp"
        ) from exc
    model.eval()
    return model
