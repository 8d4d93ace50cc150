"""Reading a ``torch.distributed.checkpoint`` (DCP) directory: its tensors by model name, and
any region of them, without a merged copy and without collectives.

:func:`open_dcp` reads the directory's ``.metadata`` (what DCP writes last: without it the save
is incomplete and the directory is refused) and names every saved tensor by the model parameter
it holds. FSDP2's ``get_model_state_dict`` + ``dcp.save`` store Hugging Face names as they are;
accelerate's FSDP ``SHARDED_STATE_DICT`` saves wrap them as ``{"model": state_dict}``, which DCP
flattens to ``model.<name>`` and records in the metadata's ``planner_data`` as the path
``("model", "<name>")``: that path, not a guess on the key, unwraps them. Other top-level entries
(an optimizer's state, a step counter) are ignored.

:meth:`DcpCheckpoint.read` fills destination tensors with regions of saved tensors (offsets and
sizes in the saved tensor's coordinates) through DCP's own reader and a small
:class:`~torch.distributed.checkpoint.planner.LoadPlanner`: DCP works out which saved chunks
overlap each region whatever the number of ranks that saved it, reads each such chunk (one at a
time) and copies its overlap into place. Each rank reads alone (``no_dist``): nothing waits for
the replica's other ranks. Reading ``.metadata`` unpickles it, as DCP itself does: point rayeval
only at checkpoints you trust, as with ``torch.load``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from rayeval.actors.errors import ModelLoadError
from rayeval.actors.weights.checkpoint_dirs import DCP_METADATA, CheckpointFormat, inspect_dir

#: The top-level key accelerate wraps a model's state dict in.
_ACCELERATE_WRAPPER = "model"


@dataclass(frozen=True)
class Region:
    """A part of a saved tensor to read into a destination tensor.

    Args:
        key: The saved tensor's model name (as :attr:`DcpCheckpoint.tensors` names it).
        dest: Where to copy it (its shape is the region's size; its dtype may differ).
        offsets: Where the region starts in the saved tensor, per dimension.
    """

    key: str
    dest: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class DcpCheckpoint:
    """A DCP directory whose ``.metadata`` was read.

    Args:
        path: The directory holding ``.metadata`` and the shard files.
        metadata: DCP's metadata.
        keys: Model name -> DCP key of every saved tensor.
    """

    path: Path
    metadata: Metadata
    keys: dict[str, str] = field(repr=False)

    @property
    def tensors(self) -> dict[str, torch.Size]:
        """Every saved tensor's global shape, by model name."""
        shapes = {}
        for name, key in self.keys.items():
            entry = self.metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)  # keys name tensors only
            shapes[name] = entry.size
        return shapes

    def read(self, regions: Sequence[Region]) -> None:
        """Copy every region from the saved tensors into its destination (on this process only).

        Raises:
            ModelLoadError: a shard file is missing or unreadable.
        """
        planner = _RegionPlanner(self, [r for r in regions if r.dest.numel()])
        if not planner.targets:
            return
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                reader = FileSystemReader(str(self.path))
                dcp_load({}, storage_reader=reader, planner=planner, no_dist=True)
        except (OSError, RuntimeError, ValueError, KeyError, AssertionError) as exc:
            raise ModelLoadError(
                f"cannot read the DCP checkpoint {self.path} ({type(exc).__name__}: {exc}): "
                "check that every shard file is present and readable"
            ) from exc


def open_dcp(path: str | Path) -> DcpCheckpoint:
    """Read a DCP directory's metadata (``path`` itself, or accelerate's folder below it).

    Raises:
        ModelLoadError: no DCP directory there, the save is incomplete (no ``.metadata``), or
            the metadata cannot be read; the message names which.
    """
    found = inspect_dir(path)
    if found is None or found.format is not CheckpointFormat.DCP:
        raise ModelLoadError(
            f"{path} is not a torch.distributed.checkpoint directory (no {DCP_METADATA} file or "
            ".distcp shards, here or in accelerate's pytorch_model_fsdp_0/)"
        )
    if not found.complete:
        raise ModelLoadError(
            f"{found.problem}: wait for the save to finish, or name a complete checkpoint"
        )
    try:
        metadata = FileSystemReader(str(found.weights)).read_metadata()
    except Exception as exc:  # a truncated or foreign pickle raises anything
        raise ModelLoadError(
            f"cannot read {found.weights / DCP_METADATA} ({type(exc).__name__}: {exc}): the "
            "save is damaged or was written by an incompatible torch"
        ) from exc
    return DcpCheckpoint(found.weights, metadata, _model_names(metadata))


def _model_names(metadata: Metadata) -> dict[str, str]:
    """Model name -> DCP key of every saved tensor, unwrapping accelerate's ``{"model": ...}``."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tensors = [
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    ]
    wrapped = bool(tensors) and all(
        len(paths.get(key, ())) == 2 and paths[key][0] == _ACCELERATE_WRAPPER for key in tensors
    )
    if wrapped:
        return {str(paths[key][1]): key for key in tensors}
    return {key: key for key in tensors}


class _RegionPlanner(LoadPlanner):
    """Reads regions of saved tensors into given tensors (no state dict of its own)."""

    def __init__(self, checkpoint: DcpCheckpoint, regions: Sequence[Region]) -> None:
        self._checkpoint = checkpoint
        # DCP key -> destinations; a read item's dest_index.index is the position here.
        self.targets: dict[str, list[Region]] = {}
        for region in regions:
            self.targets.setdefault(checkpoint.keys[region.key], []).append(region)
        self._metadata: Metadata | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self._metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self._metadata is not None
        items: list[ReadItem] = []
        for key, regions in self.targets.items():
            entry = self._metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=r.dest.size())
                for r in regions
            ]
            items += create_read_items_for_chunk_list(key, entry, chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise AssertionError("only tensors are read")  # nothing but tensors is planned

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        region = self.targets[read_item.dest_index.fqn][read_item.dest_index.index or 0]
        tensor = region.dest
        for dim, (offset, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: :meth:`resolve_tensor` handed out a view of the destination."""
