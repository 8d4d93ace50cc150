"""Loading a Hugging Face causal LM on one rank: plain (G=1) or sharded with FSDP2 (G>1).

Sharded loading never materialises the whole model on a rank: the model is built on the meta
device, ``fully_shard`` is applied to every decoder block and then the root, and each rank reads
only its own dim-0 slice of every tensor from the safetensors checkpoint (memory-mapped). Peak host
memory per rank is therefore about model/G. Checkpoints whose tensor names do not match the model
(``.bin`` files, renamed keys) fall back to a full load followed by sharding, with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from actors.batches import ModelSpec
from actors.errors import ModelLoadError

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"


def load_model(spec: ModelSpec, device: torch.device, mesh: DeviceMesh | None) -> nn.Module:
    """Load the model for one rank, in eval mode, on ``device``.

    Args:
        spec: What to load.
        device: This rank's device.
        mesh: The replica's 1-D device mesh for FSDP2, or None for a plain (unsharded) replica.

    Returns:
        The model (an ``FSDPModule`` when ``mesh`` is given).

    Raises:
        ModelLoadError: if the checkpoint cannot be found or read.
    """
    try:
        config = transformers.AutoConfig.from_pretrained(
            spec.pretrained,
            revision=spec.revision,
            subfolder=spec.subfolder,
            trust_remote_code=spec.trust_remote_code,
        )
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load the model config of {spec.pretrained!r}: {exc}. Pass an existing local "
            "path or a Hugging Face hub id in model_args pretrained=..."
        ) from exc
    dtype = resolve_dtype(spec.dtype, config)
    model = (
        _load_plain(spec, dtype)
        if mesh is None
        else _load_sharded(spec, config, dtype, mesh, device)
    )
    if mesh is None:
        model.to(device)
    model.eval()
    return model


def resolve_dtype(name: str | None, config: transformers.PretrainedConfig) -> torch.dtype:
    """lm-eval's ``dtype`` model arg as a torch dtype (``auto``: the checkpoint's, else fp32)."""
    if name in (None, "auto"):
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, torch.dtype):
            return configured
        return getattr(torch, configured) if isinstance(configured, str) else torch.float32
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ModelLoadError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return value


def _from_pretrained_kwargs(spec: ModelSpec) -> dict[str, Any]:
    return {
        "revision": spec.revision,
        "subfolder": spec.subfolder,
        "trust_remote_code": spec.trust_remote_code,
        **spec.extra_kwargs,
    }


def _load_plain(spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec.pretrained, dtype=dtype, **_from_pretrained_kwargs(spec)
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load {spec.pretrained!r}: {exc}") from exc


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of any HF causal LM, innermost first.

    Uses the model's own ``_no_split_modules`` (Llama, GPT-2, GPT-NeoX, Qwen2, Mistral all declare
    their decoder layer there); falls back to the children of the longest ``nn.ModuleList``.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) > len(blocks):
                blocks = list(module)
    # modules() is pre-order; FSDP2 wants nested modules sharded before their parents.
    return blocks[::-1]


def _load_sharded(
    spec: ModelSpec,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    device: torch.device,
) -> nn.Module:
    index = _safetensors_index(spec)
    if index is None:
        logger.warning(
            "no safetensors checkpoint for %s: every rank loads the whole model before sharding",
            spec.pretrained,
        )
        return _shard(_load_plain(spec, dtype), mesh, device)

    # Parameters on meta, buffers real: non-persistent buffers (rotary inv_freq) are computed in
    # __init__ and are not in the checkpoint, so they must survive to_empty().
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    keys = {name: _checkpoint_key(name, index, model) for name, _ in model.named_parameters()}
    missing = sorted(name for name, key in keys.items() if key is None)
    if missing:
        logger.warning(
            "checkpoint tensor names do not match %d model parameters (e.g. %s): every rank loads "
            "the whole model before sharding",
            len(missing),
            missing[0],
        )
        return _shard(_load_plain(spec, dtype), mesh, device)

    _shard(model, mesh, device)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        _read_local_shards(model, keys, index, mesh)
    return model


def _shard(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    return model


def _read_local_shards(
    model: nn.Module, keys: dict[str, str | None], index: dict[str, Path], mesh: DeviceMesh
) -> None:
    rank, world = mesh.get_local_rank(), mesh.size()
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, param in model.named_parameters():
            key = keys[name]
            assert key is not None
            path = index[key]
            if path not in handles:
                handles[path] = stack.enter_context(
                    safe_open(str(path), framework="pt", device="cpu")
                )
            tensor_slice = handles[path].get_slice(key)
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(param, DTensor):
                if tuple(param.placements) != (Shard(0),):
                    raise ModelLoadError(f"unexpected FSDP placement {param.placements} for {name}")
                chunk = math.ceil(param.shape[0] / world) if param.dim() else 0
                start = min(rank * chunk, param.shape[0])
                value = tensor_slice[start : start + local.shape[0]]
            else:
                value = tensor_slice[:]
            if tuple(value.shape) != tuple(local.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {key} has shape {tuple(value.shape)} for this rank, the "
                    f"model expects {tuple(local.shape)}: the checkpoint does not match its config"
                )
            local.copy_(value.to(local.dtype))


def _checkpoint_key(name: str, index: dict[str, Path], model: nn.Module) -> str | None:
    if name in index:
        return name
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in index:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}" in index:
        return f"{prefix}.{name}"
    return None


def _safetensors_index(spec: ModelSpec) -> dict[str, Path] | None:
    """Map every tensor name to its safetensors file, or None if there is no safetensors file."""
    root = _checkpoint_dir(spec)
    if (root / _SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((root / _SAFETENSORS_INDEX).read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    if (root / _SAFETENSORS_SINGLE).is_file():
        with safe_open(str(root / _SAFETENSORS_SINGLE), framework="pt", device="cpu") as handle:
            return dict.fromkeys(handle.keys(), root / _SAFETENSORS_SINGLE)
    return None


def _checkpoint_dir(spec: ModelSpec) -> Path:
    local = Path(spec.pretrained) / spec.subfolder
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    folder = f"{spec.subfolder.rstrip('/')}/" if spec.subfolder else ""
    try:
        snapshot = snapshot_download(
            spec.pretrained,
            revision=spec.revision,
            allow_patterns=[f"{folder}*.safetensors", f"{folder}*.json"],
        )
    except Exception as exc:
        raise ModelLoadError(
            f"cannot find {spec.pretrained!r} locally or on the Hugging Face hub ({exc}). "
            "Pass an existing local path, or a hub id reachable from every node."
        ) from exc
    return Path(snapshot) / spec.subfolder
