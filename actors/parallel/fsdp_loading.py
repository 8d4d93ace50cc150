"""Loading a model on an FSDP2 rank: the model whole (G = 1), or only this rank's shards.

Sharded loading never materialises the whole model on a rank. The model is built on the meta
device, cut into FSDP units (:func:`rayeval.actors.parallel.fsdp_units.shard_model`), and each rank
then reads only its own dim-0 slice of every tensor from the checkpoint
(:mod:`rayeval.actors.weights.hf_files`). Peak host memory per rank is therefore about model/G plus
one unit. Only checkpoints whose tensor names do not match the model, or legacy (pre-zip) ``.bin``
files that cannot be memory-mapped, fall back to a full load followed by sharding, one rank of
the replica at a time (a node holds one whole copy at once, not G), with a warning. The whole
model of G = 1 is read straight onto the rank's device, as lm-eval's hf backend reads it. A
training checkpoint named by ``checkpoint=`` (a DCP directory, or HF files) is read the same
way, region by region (:mod:`rayeval.actors.weights.sources`), into the model of ``pretrained``'s
config, at any G. A LoRA adapter (``peft=``) or delta weights (``delta=``) then go onto the loaded
model, whole or sharded (:mod:`rayeval.actors.weights.adapters`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from functools import partial

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ModelLoadError
from rayeval.actors.parallel.fsdp_units import shard_model
from rayeval.actors.weights.adapters import add_delta, apply_adapter
from rayeval.actors.weights.hf_files import (
    CannotStream,
    find_checkpoint,
    load_config,
    load_generation_config,
    load_plain,
    resolve_dtype,
)
from rayeval.actors.weights.sources import fill, open_source
from rayeval.actors.weights.vocabulary import resize_whole

logger = logging.getLogger(__name__)


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
    config = load_config(spec)
    dtype = resolve_dtype(spec.dtype, config)
    if spec.checkpoint is not None:
        model = _load_checkpoint(spec, config, dtype, mesh, device)
    elif mesh is None:
        model = load_plain(spec, dtype, device)
        if spec.vocab_size is not None:
            resize_whole(model, spec.vocab_size)
    else:
        model = _load_sharded(spec, config, dtype, mesh, device)
    model.eval()
    if spec.delta is not None:  # each rank adds the regions it holds
        add_delta(model, spec.delta, spec.pretrained)
    if spec.peft is not None:  # unmerged, onto the whole or sharded base
        apply_adapter(model, spec.peft, spec.revision)
    return model


# -------------------------------------------------------------------------- sharded loading
def _load_sharded(
    spec: ModelSpec,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    device: torch.device,
) -> nn.Module:
    model = _meta_model(spec, config, dtype)
    try:
        checkpoint = find_checkpoint(spec)
    except CannotStream as exc:
        return _full_load_then_shard(spec, model, dtype, mesh, device, str(exc))
    if checkpoint is None:
        why = "no safetensors or .bin checkpoint file found"
        return _full_load_then_shard(spec, model, dtype, mesh, device, why)
    keys = {name: checkpoint.key_for(aliases, model) for name, aliases in _aliases(model).items()}
    missing = sorted(name for name, key in keys.items() if key is None)
    if missing:
        why = (
            f"checkpoint tensor names do not match {len(missing)} model parameters "
            f"(e.g. {missing[0]})"
        )
        return _full_load_then_shard(spec, model, dtype, mesh, device, why)
    skip = {key for name in _from_adapter(spec, model) if (key := keys.get(name)) is not None}
    offsets = _shard_empty(model, keys, mesh, device)
    try:
        with checkpoint.reader() as reader, torch.no_grad():
            _read_local_shards(model, keys, reader.rows, mesh, offsets, skip)
    except CannotStream as exc:
        return _full_load_then_shard(
            spec, _meta_model(spec, config, dtype), dtype, mesh, device, str(exc)
        )
    load_generation_config(model, spec)  # built from config.json: from_pretrained's file too
    return model


def _shard_empty(
    model: nn.Module, keys: dict[str, str | None], mesh: DeviceMesh, device: torch.device
) -> dict[str, int]:
    """:func:`_materialise` the meta ``model`` sharded over ``mesh``; a vocabulary chunk's key
    is its whole tensor's. Returns the first source row of each parameter that is a row chunk
    of a source tensor."""
    first_names = {id(param): name for name, param in model.named_parameters()}
    offsets: dict[str, int] = {}
    for name, (origin, start) in _materialise(model, mesh, device).items():
        keys[name] = keys[first_names[id(origin)]]
        offsets[name] = start
    return offsets


def _materialise(
    model: nn.Module, mesh: DeviceMesh | None, device: torch.device
) -> dict[str, tuple[nn.Parameter, int]]:
    """Shard the meta ``model`` over ``mesh`` (None: keep it whole) and give this rank's
    parameters (empty) and the buffers a place on ``device``. Returns
    :func:`~rayeval.actors.parallel.fsdp_units.shard_model`'s vocabulary-chunk origins."""
    # Parameters on meta, buffers real: non-persistent buffers (rotary inv_freq) are computed in
    # __init__ and are not in the checkpoint, so they must survive to_empty().
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    origins = shard_model(model, mesh) if mesh is not None else {}
    model.to_empty(device=device)
    if mesh is None:
        model.tie_weights()  # type: ignore[operator]  # to_empty untied a tied weight
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    return origins


def _load_checkpoint(
    spec: ModelSpec,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> nn.Module:
    """The model of ``spec.pretrained``'s config with the weights of ``spec.checkpoint`` (a DCP
    directory or HF files), whole or sharded: each rank reads only the regions it holds."""
    assert spec.checkpoint is not None
    source = open_source(spec.checkpoint)
    model = _meta_model(spec, config, dtype)
    _materialise(model, mesh, device)
    fill(model, source, spec.pretrained)
    load_generation_config(model, spec)
    model.eval()
    return model


def _full_load_then_shard(
    spec: ModelSpec,
    model: nn.Module,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    device: torch.device,
    why: str,
) -> nn.Module:
    """Shard the meta ``model``, then fill each rank's shards from the whole model as
    ``from_pretrained`` loads it, one rank after another: each frees the whole model before
    the next loads it, so that a node holds one whole copy at a time, not G."""
    keys: dict[str, str | None] = {name: name for name in _aliases(model)}
    skip = {name for name in _from_adapter(spec, model) if name in keys}
    offsets = _shard_empty(model, keys, mesh, device)
    rank, size = mesh.get_local_rank(), mesh.size()
    for turn in range(size):
        if turn == rank:
            started = time.monotonic()
            state = load_plain(spec, dtype).state_dict()
            with torch.no_grad():
                _read_local_shards(model, keys, partial(_rows, state), mesh, offsets, skip)
            del state
            logger.warning(
                "%s for %s: rank %d of %d loaded the whole model in %.2f s to take its shard "
                "(one rank at a time: each holds the whole model while it loads). Save the "
                "checkpoint as safetensors to load only each rank's shard.",
                why,
                spec.pretrained,
                rank,
                size,
                time.monotonic() - started,
            )
        torch.distributed.barrier(group=mesh.get_group())
    load_generation_config(model, spec)
    return model


def _rows(
    state: dict[str, torch.Tensor], key: str, start: int | None = None, stop: int | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` of ``state[key]`` (all of it when both are None)."""
    return state[key] if start is None else state[key][start:stop]


def _meta_model(
    spec: ModelSpec, config: transformers.PretrainedConfig, dtype: torch.dtype
) -> nn.Module:
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
    # init_empty_weights re-creates every registered parameter on meta, which unties a tied head
    # from the embeddings (lm_head.weight is no longer wte.weight): tie them again.
    model.tie_weights()
    _compute_buffers_as_loaded(model)
    if spec.vocab_size is not None:  # resized as lm-eval resizes it, on meta (nothing to copy)
        resize_whole(model, spec.vocab_size)
    return model


def _compute_buffers_as_loaded(model: nn.Module) -> None:
    """Give the non-persistent buffers the values ``from_pretrained`` gives them.

    ``from_config`` computes them in ``__init__``, under the default dtype set to the model's;
    ``from_pretrained`` builds them on meta and computes them afterwards with the model's
    ``_init_weights``, under the process's default dtype (float32). The two differ where a
    buffer's arithmetic follows the default dtype: GPT-J's sinusoidal positions, whose inverse
    frequencies come out in bf16 from ``__init__`` in a bf16 model, moved its log-probs by a bf16
    step at G = 2 (the conformance matrix's gptj 1x2 bf16 cell). Here, as in ``from_pretrained``,
    everything else is marked loaded and only the rest is initialised (on meta parameters the
    initialisers write nothing).
    """
    from transformers import initialization

    computed = {id(buffer) for _, buffer in model.named_non_persistent_buffers()}  # type: ignore[operator]
    for module in model.modules():
        module._is_hf_initialized = False  # type: ignore[assignment]
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in computed:
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    with torch.no_grad(), initialization.guard_torch_init_functions():
        model.initialize_weights()  # type: ignore[operator]


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each distinct parameter's first name, with every name it has (a tied weight has two)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {aliases[0]: aliases for aliases in names.values()}


def _from_adapter(spec: ModelSpec, model: nn.Module) -> list[str]:
    """The names of the meta ``model``'s vocabulary matrices that ``spec.peft``'s adapter saved:
    :func:`~rayeval.actors.weights.adapters.apply_adapter` writes them, so the base's are not
    read (it has fewer rows than a vocabulary grown for added tokens)."""
    if spec.peft is None:
        return []
    from rayeval.actors.weights.adapters import adapter_shapes
    from rayeval.actors.weights.vocabulary import saved_matrices

    saved = saved_matrices(model, adapter_shapes(spec.peft))
    return [name for matrix in saved.values() for name in matrix]


def _read_local_shards(
    model: nn.Module,
    keys: dict[str, str | None],
    rows: Callable[..., torch.Tensor],
    mesh: DeviceMesh,
    offsets: dict[str, int],
    skip: Collection[str] = (),
) -> None:
    """Copy each parameter's local rows from its source tensor, ``rows(key, start, stop)``
    (``offsets``: first source row of a parameter that is a row chunk of a source tensor); the
    parameters of the source tensors in ``skip`` are left for another source to fill."""
    rank, world = mesh.get_local_rank(), mesh.size()
    for name, param in model.named_parameters():
        key = keys[name]
        assert key is not None
        if key in skip:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(param, DTensor):
            if tuple(param.placements) != (Shard(0),):
                raise ModelLoadError(f"unexpected FSDP placement {param.placements} for {name}")
            # FSDP2's dim-0 chunks: ceil(rows / world) each, the last ones shorter or empty.
            chunk = math.ceil(param.shape[0] / world) if param.dim() else 0
            start = min(rank * chunk, param.shape[0]) + offsets.get(name, 0)
            value = rows(key, start, start + local.shape[0])
        else:
            value = rows(key)
        if tuple(value.shape) != tuple(local.shape):
            raise ModelLoadError(
                f"checkpoint tensor {key} has shape {tuple(value.shape)} for this rank, the "
                f"model expects {tuple(local.shape)}: the checkpoint does not match its config"
            )
        local.copy_(value)  # converts the dtype too; the slice is the only temporary
        del value
