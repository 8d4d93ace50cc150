"""Shared-memory collectives for the tensor-parallel ranks of one replica on a CPU node: the
all-gathers of their activations.

Tensor parallelism gathers each block's activations over the ranks four times per forward (the
attention heads and the attention output, the MLP columns and the MLP output:
:mod:`rayeval.actors.parallel.tp_exact`). On CPU ranks gloo carries every one of those over a TCP
socket: measured on the development machine, 2.3-4.3 ms for one decode step's 48 KiB and 0.5 ms or
more for 4 bytes, about what the block's own compute costs (docs/performance-notes.md). The ranks
of a TP replica always share a node, so they can exchange activations through memory instead: each
rank copies its piece into its slot of a file in ``/dev/shm``, publishes a sequence number, waits
for every peer's, and copies the slots out in rank order: the same bytes gloo delivers.

FSDP's all-gathers stay on gloo: through the same slots they took a third of gloo's time per
14 MiB call, but FSDP decoding got no faster (gloo's all-gathers run in the background while the
rank computes; FSDP prefetches the next unit) and its peak memory no lower
(docs/performance-notes.md).

Two slots per rank, used alternately: a rank starts call ``n + 1`` only once every peer has
published call ``n``, which each does only after it finished reading call ``n - 1`` from the
other slot. A tensor larger than a slot goes through in slot-sized pieces. A peer that does not
arrive within the collective timeout, or whose process is gone, is an error, never a hang. Every
rank must make the same calls in the same order, as with any collective of a process group.
x86-64 only: its stores become visible to other cores in program order (the data before the
sequence number); elsewhere the ranks stay on the process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Bytes per slot (two per rank). A decode step's activations (rows x hidden) fit many times
#: over; a prefill's larger tensors go through in pieces of this size.
SLOT_BYTES = 4 << 20
#: Header bytes per rank: sequence number and process id, on a cache line of its own.
_LINE = 64
#: Polls of a peer's sequence number before the waiting rank yields its core, and seconds of
#: yielding before it sleeps between polls (ranks oversubscribing their cores must not starve
#: the peer they wait for).
_SPINS = 200
_YIELD_S = 0.002
_SLEEP_S = 50e-6
#: Seconds between checks that a peer's process still exists while waiting for it.
_LIVENESS_S = 0.5
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: The integer dtype of each element size: numpy copies a tensor's bits through it (numpy has
#: no bfloat16).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def available() -> bool:
    """Whether this rank can use them: x86-64 Linux with a ``/dev/shm`` (the configuration's
    ``parallelism.shm_collectives`` decides whether it may)."""
    return platform.machine() in ("x86_64", "AMD64") and Path("/dev/shm").is_dir()


class ShmCollectives:
    """Sum-all-reduce of floating-point CPU tensors among the ranks of a process group whose
    processes share a node.

    Created collectively: every rank calls :meth:`create` with the same ``name``.

    Args:
        path: The shared file, already sized (see :meth:`create`).
        rank: This rank in the group, 0 .. world-1.
        world: Ranks of the group.
        timeout_s: Longest wait for a peer.
    """

    def __init__(self, path: Path, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        whole = torch.from_file(str(path), shared=True, size=_file_bytes(world), dtype=torch.uint8)
        header_bytes = _LINE * world
        # numpy reads a peer's sequence number in ~0.1 us (a torch index costs microseconds).
        self._header = whole[:header_bytes].numpy().view(np.int64).reshape(world, _LINE // 8)
        # numpy views: a decode step makes hundreds of small gathers, and a numpy copy or view
        # costs well under a microsecond where a torch op costs several.
        self._slots = whole[header_bytes:].numpy().reshape(2, world, SLOT_BYTES)
        self._peer_pids = [0] * world
        self._seq = 0

    @classmethod
    def create(cls, name: str, rank: int, world: int, timeout_s: float) -> ShmCollectives | None:
        """Map a shared file for the ranks of the default process group (collective: every rank
        calls it).

        Returns:
            The collectives, or None on every rank when any rank could not map the file (a
            ``/dev/shm`` too small, as in a container started without ``--shm-size``): the
            ranks then keep to the process group.
        """
        path = Path("/dev/shm") / f"rayeval-{name}"
        made = None
        ok = torch.ones(1, dtype=torch.int64)
        try:
            if rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS
                    # at the first write of a slot.
                    os.posix_fallocate(fd, 0, _file_bytes(world))
                finally:
                    os.close(fd)
        except OSError as exc:
            logger.warning("shared-memory collectives unavailable (%s): using gloo", exc)
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # rank 0 made the file
        if ok.item():
            try:
                made = cls(path, rank, world, timeout_s)
                made._header[rank, 1] = os.getpid()
            except (OSError, RuntimeError) as exc:
                logger.warning("shared-memory collectives unavailable (%s): using gloo", exc)
                ok.zero_()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank mapped it
        if rank == 0:  # the mappings keep the memory; the name is no longer needed
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not ok.item():
            return None
        assert made is not None
        made._peer_pids = [int(pid) for pid in made._header[:, 1]]
        return made

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` (the same shape and dtype on each) concatenated along the
        last dimension in rank order; None (nothing done) for a tensor this does not handle (not
        a floating-point CPU tensor, or one whose last dimension alone overflows a slot).

        A tensor larger than a slot goes through in pieces of whole rows."""
        if tensor.dtype not in _DTYPES or tensor.device.type != "cpu" or tensor.dim() == 0:
            return None
        width = tensor.shape[-1]
        rows_per_piece = SLOT_BYTES // max(1, width * tensor.element_size())
        if rows_per_piece == 0:
            return None
        mine = tensor.contiguous().view(_BITS[tensor.element_size()]).numpy().reshape(-1, width)
        out = np.empty((mine.shape[0], self.world * width), dtype=mine.dtype)
        for start in range(0, max(1, mine.shape[0]), rows_per_piece):
            self._gather_rows(mine[start : start + rows_per_piece], out[start:], width)
        gathered = torch.from_numpy(out).view(tensor.dtype)
        return gathered.view(*tensor.shape[:-1], self.world * width)

    def _gather_rows(self, rows: np.ndarray, out: np.ndarray, width: int) -> None:
        """Publish ``rows`` (at most a slot) in this rank's slot, wait for every peer's, and
        copy the ranks' rows side by side into ``out``'s first rows."""
        self._seq += 1
        seq = self._seq
        slots = self._slots[seq % 2]
        count = rows.size
        slots[self.rank].view(rows.dtype)[:count] = rows.reshape(-1)
        self._header[self.rank, 0] = seq
        self._wait(seq)
        n = rows.shape[0]
        for peer in range(self.world):
            piece = slots[peer].view(rows.dtype)[:count].reshape(n, width)
            out[:n, peer * width : (peer + 1) * width] = piece

    def _wait(self, seq: int) -> None:
        header = self._header
        for peer in range(self.world):
            spins, started, checked = 0, 0.0, 0.0
            while header[peer, 0] < seq:
                spins += 1
                if spins < _SPINS:
                    continue
                if spins == _SPINS:
                    started = checked = time.monotonic()
                now = time.monotonic()
                if now - started < _YIELD_S:
                    os.sched_yield()
                    continue
                time.sleep(_SLEEP_S)
                if now - checked >= _LIVENESS_S:
                    checked = now
                    self._check_peer(peer, seq, now - started)

    def _check_peer(self, peer: int, seq: int, waited_s: float) -> None:
        pid = self._peer_pids[peer]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise RuntimeError(
                f"shared-memory collective: rank {peer} of {self.world} (pid {pid}) exited "
                f"during call {seq}; see that rank's log for why"
            ) from None
        except PermissionError:  # exists, owned by another user
            pass
        if waited_s > self.timeout_s:
            raise RuntimeError(
                f"shared-memory collective: rank {peer} of {self.world} did not arrive within "
                f"{self.timeout_s:g}s (call {seq}); it is stuck, or only slow: then raise "
                "--collective_timeout"
            )


def _file_bytes(world: int) -> int:
    return _LINE * world + 2 * world * SLOT_BYTES
