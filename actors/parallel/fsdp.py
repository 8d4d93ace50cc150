"""FSDP2: every rank holds a dim-0 slice of every weight (strategy ``fsdp``).

Each rank computes its own micro-batch, all-gathering each unit's weights before computing it
and freeing them after (:mod:`rayeval.actors.parallel.fsdp_units`); each rank loads only its slices
(:mod:`rayeval.actors.parallel.fsdp_loading`). Any architecture, replicas that span nodes, results
bit-identical for every G. A decode step all-gathers every layer for a few tokens, so it is slow to
generate with. A replica of one rank runs this strategy too, with the model whole. Imports no
torch until a rank loads.
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING, Any

from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel.sharding import RankContext
from rayeval.actors.profiles import ModelShape

if TYPE_CHECKING:
    from rayeval.actors.batches import ModelSpec

#: Host allocations at least this large are mmapped, so freeing them returns them to the OS.
_MMAP_THRESHOLD_BYTES = 1 << 20


class FSDP2:
    """The ``fsdp`` strategy (see the module docstring)."""

    name = ShardStrategy.FSDP
    same_batch = False
    one_node = False

    def model_obstacles(self, shape: ModelShape, shard_size: int) -> list[str]:
        """None: FSDP shards any model."""
        return []

    def __init__(self) -> None:
        #: glibc, on sharded Linux ranks (prepare_process); None elsewhere.
        self._libc: Any = None

    def prepare_process(self, shard_size: int) -> None:
        """Sharded replicas: glibc serves every allocation of 1 MiB or more with its own
        ``mmap``, so that freed all-gather buffers go back to the OS at once.

        glibc raises its mmap threshold to the size of the largest block freed so far (up to
        32 MiB); from then on FSDP's all-gather buffers and unsharded parameters come from the
        heap, are freed in another order than they were allocated, and the fragments stay
        resident: a CPU rank's memory grew by about half the model across forwards, and its peak
        by a third (docs/performance-notes.md). A fixed threshold turns that adjustment off. Only
        FSDP ranks of a sharded replica need it: elsewhere nothing all-gathers, and every fresh
        mapping costs page faults (a scoring forward on one core ran ~25% slower with it). Not
        glibc (musl, macOS): nothing to do.
        """
        if shard_size == 1 or not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        m_mmap_threshold = -3  # from glibc's malloc.h
        libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD_BYTES)
        self._libc = libc

    def load(self, spec: ModelSpec, device: Any, shard_size: int) -> Any:
        """The model whole (G = 1), or this rank's shards of it over the replica's 1-D mesh.

        Raises:
            ModelLoadError: the checkpoint cannot be found or read.
        """
        from rayeval.actors.parallel.fsdp_loading import load_model

        mesh = None
        if shard_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (shard_size,))
        return load_model(spec, device, mesh)

    def collectives(self, rank: RankContext) -> str | None:
        """The process group carries every all-gather.

        Through shared memory they were a third faster per call but FSDP decoding got no faster
        (gloo's all-gathers overlap the rank's compute) and its peak memory no lower
        (docs/performance-notes.md), so they stay on gloo.
        """
        return "process group" if rank.shard_size > 1 else None

    def after_forward(self, model: Any) -> None:
        """Every FSDP unit back to its shard, per-forward state cleared, and (sharded ranks)
        the heap's free pages given back to the OS."""
        from torch.distributed.fsdp import FSDPModule

        from rayeval.actors.parallel.fsdp_units import release_unsharded

        release_unsharded(model)
        if isinstance(model, FSDPModule) and self._libc is not None:
            self._libc.malloc_trim(0)
