"""Filling a rank's parameters from a training checkpoint, each rank reading only what it holds.

A rank's parameters are whole tensors (a replica of one rank), FSDP2's dim-0 shards, or tensor
parallelism's DTensor slices; a vocabulary chunk (:mod:`rayeval.actors.parallel.vocab_chunks`) is
rows of a larger checkpoint tensor. :func:`slots` describes each parameter this rank holds as a
:class:`Slot`: the names a checkpoint may give it, the checkpoint tensor's whole shape, and where
the rank's local tensor lies inside it. A :class:`WeightSource` then fills every slot with
exactly that region (:func:`fill`): a DCP directory (:mod:`rayeval.actors.weights.dcp`, which
reshards whatever number of ranks saved it) or safetensors / ``.bin`` files
(:mod:`rayeval.actors.weights.hf_files`). No rank ever holds more than its slots plus one
saved chunk.

The same slots serve the first load (into a model materialised empty) and a swap between the
checkpoints of a sweep (into the loaded model, in place). :func:`problems`
checks names and shapes against a model; the driver runs it on its weightless copy of the model
before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from rayeval.actors.errors import CheckpointError, ModelLoadError
from rayeval.actors.parallel.vocab_chunks import ChunkedEmbedding, ChunkedHead
from rayeval.actors.weights.checkpoint_dirs import CheckpointFormat, checkpoint_or_error
from rayeval.actors.weights.dcp import Region, open_dcp
from rayeval.actors.weights.hf_files import CannotStream, Checkpoint, find_checkpoint_in, match_key


@dataclass(frozen=True)
class Slot:
    """One parameter as this rank holds it.

    Args:
        name: The parameter's first name in the model.
        aliases: Every name a checkpoint may store it under (a tied weight has two; a
            vocabulary chunk has its whole matrix's).
        local: The tensor this rank holds (written in place).
        offsets: Where ``local`` starts inside the checkpoint tensor, per dimension.
        shape: The checkpoint tensor's whole shape.
    """

    name: str
    aliases: tuple[str, ...]
    local: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class WeightSource(Protocol):
    """Saved tensors by name, any region of which can be read."""

    #: Where the tensors are (for messages).
    where: str

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every saved tensor's whole shape, by name."""
        ...

    def read(self, regions: Sequence[Region]) -> None:
        """Copy each region of the saved tensors into its destination."""
        ...


class DcpSource:
    """The tensors of a ``torch.distributed.checkpoint`` directory."""

    def __init__(self, path: Path) -> None:
        self._checkpoint = open_dcp(path)
        self.where = str(self._checkpoint.path)

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {name: tuple(size) for name, size in self._checkpoint.tensors.items()}

    def read(self, regions: Sequence[Region]) -> None:
        self._checkpoint.read(regions)


class FileSource:
    """The tensors of safetensors or ``.bin`` files (one, or several through an index)."""

    def __init__(self, checkpoint: Checkpoint, where: Path) -> None:
        self._checkpoint = checkpoint
        self.where = str(where)

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        with self._checkpoint.reader() as reader:
            return {name: reader.shape(name) for name in self._checkpoint.files}

    def read(self, regions: Sequence[Region]) -> None:
        with self._checkpoint.reader() as reader:
            for region in regions:
                region.dest.copy_(reader.region(region.key, region.offsets, region.dest.shape))


def open_source(path: str | Path) -> WeightSource:
    """The weights of the complete checkpoint at ``path`` (DCP or HF files).

    Raises:
        CheckpointError: nothing usable there, or its save is incomplete (naming which).
        ModelLoadError: its metadata or files cannot be read.
    """
    found = checkpoint_or_error(path)
    if found.format is CheckpointFormat.DCP:
        return DcpSource(found.weights)
    if found.format is CheckpointFormat.ADAPTER:
        raise CheckpointError(
            f"checkpoint {path} is a PEFT adapter, not the model's weights: pass it as peft= "
            "(a sweep over adapter checkpoints applies each to pretrained's weights itself)"
        )
    try:
        checkpoint = find_checkpoint_in(found.weights)
    except CannotStream as exc:
        raise CheckpointError(
            f"checkpoint {path}: {exc}; re-save it as safetensors to read it slice by slice"
        ) from None
    assert checkpoint is not None  # inspect_dir found weight files there
    return FileSource(checkpoint, found.weights)


def slots(model: nn.Module) -> list[Slot]:
    """Every distinct parameter of ``model`` as this rank holds it (see :class:`Slot`).

    Raises:
        ModelLoadError: a parameter is laid out in a way no region describes (a strided shard).
    """
    chunks = _vocabulary_chunks(model)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params.setdefault(id(param), param)
    found = []
    for key, aliases in names.items():
        param = params[key]
        local, offsets = _local_part(param, aliases[0])
        shape = tuple(param.shape)
        if key in chunks:
            origins, start, shape = chunks[key]
            aliases = origins
            offsets = (offsets[0] + start, *offsets[1:])
        found.append(Slot(aliases[0], tuple(aliases), local, offsets, shape))
    return found


def _vocabulary_chunks(model: nn.Module) -> dict[int, tuple[list[str], int, tuple[int, ...]]]:
    """Per vocabulary-chunk parameter (by id): its whole matrix's names, first row and shape."""
    chunks: dict[int, tuple[list[str], int, tuple[int, ...]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ChunkedEmbedding):
            shape = (module.num_embeddings, module.embedding_dim)
        elif isinstance(module, ChunkedHead):
            shape = (module.out_features, module.in_features)
        else:
            continue
        origin = f"{module_name}.weight" if module_name else "weight"
        for part in module.parts:
            entry = chunks.setdefault(id(part.weight), ([], part.start, shape))  # type: ignore[arg-type]
            entry[0].append(origin)
    return chunks


def _local_part(param: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds of ``param`` and its offsets inside the whole parameter."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.dim()
    if any(type(p) not in (Shard, Replicate) for p in param.placements):
        raise ModelLoadError(
            f"{name} is laid out as {param.placements}, which cannot be read region by region: "
            "use --shard_strategy fsdp for this checkpoint"
        )
    (chunk,) = param.__create_chunk_list__()  # DCP's own description of the local shard
    local = param.to_local()
    if tuple(chunk.sizes) != tuple(local.shape):
        raise ModelLoadError(f"{name}: local shard {tuple(local.shape)} is not {chunk.sizes}")
    return local, tuple(chunk.offsets)


def problems(
    wanted: Sequence[Slot], shapes: Mapping[str, tuple[int, ...]], prefix: str
) -> tuple[dict[str, str], list[str]]:
    """Each slot's checkpoint name, and what stops the checkpoint from filling them.

    Args:
        wanted: The model's slots.
        shapes: The checkpoint's tensors and shapes.
        prefix: The model's ``base_model_prefix`` (a checkpoint may store names without it).

    Returns:
        Slot name -> checkpoint name for the slots found, and one message per problem (a
        missing tensor, a shape that differs), in the model's parameter order.
    """
    keys: dict[str, str] = {}
    found: list[str] = []
    for slot in wanted:
        key = match_key(slot.aliases, shapes, prefix)
        if key is None:
            found.append(f"no tensor for parameter {slot.aliases[0]}")
        elif tuple(shapes[key]) != slot.shape:
            found.append(
                f"tensor {key} has shape {tuple(shapes[key])}, the model's config gives "
                f"{slot.shape}"
            )
        else:
            keys[slot.name] = key
    return keys, found


def refusal(where: str, found: Sequence[str], pretrained: str) -> str:
    """The message refusing a checkpoint for ``found`` problems (the first one named)."""
    more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
    return (
        f"checkpoint {where} does not fit the model of pretrained={pretrained}: {found[0]}{more}."
        " Name the config the checkpoint was trained with in pretrained=..., or a checkpoint "
        "of this model"
    )


def fill(model: nn.Module, source: WeightSource, pretrained: str) -> int:
    """Fill every parameter this rank holds from ``source`` (in place, no gradients).

    Returns:
        Bytes written into the rank's parameters.

    Raises:
        ModelLoadError: a tensor is missing or has another shape, or cannot be read.
    """
    wanted = slots(model)
    keys, found = problems(wanted, source.shapes(), getattr(model, "base_model_prefix", ""))
    if found:
        raise ModelLoadError(refusal(source.where, found, pretrained))
    with torch.no_grad():
        source.read([Region(keys[s.name], s.local, s.offsets) for s in wanted])
    return sum(s.local.numel() * s.local.element_size() for s in wanted)
