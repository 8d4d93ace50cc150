"""The driver-rank protocol: what a rank reports, and how it computes what it is sent.

The driver's side is :class:`rayeval.actors.group.Replica` (one step to a replica's ranks) and
:class:`rayeval.actors.group.WorkerGroup`; the rank's side is
:class:`rayeval.actors.worker.ShardWorker` (or a benchmark's simulated rank, which loads no model).
A micro-batch says what it is by its type, never by a method named in a string: a rank computes
it with :func:`compute` (:class:`~rayeval.actors.batches.ScoreMicroBatch`: its log-likelihoods;
:class:`~rayeval.actors.batches.GenerateMicroBatch`: ``generate``), several in one call with
:func:`compute_many`; a :class:`~rayeval.actors.batches.GenerateGroup` streams its answers back
(``generate_stream``). Reports are frozen classes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Protocol

from rayeval.actors.batches import GenerateMicroBatch, ScoreMicroBatch, StepStats


@dataclass(frozen=True)
class LoadReport:
    """What a rank reports once it loaded the model.

    Args:
        seconds: How long joining the process group and loading took.
        local_parameters: Parameters this rank holds (its shards).
        kv_capacity_tokens: KV-cache positions its free memory holds after loading (None when
            the model's config does not say how big a position is).
        strategy: How its replica shards the model (None for G = 1).
        collectives: What carries the replica's collectives (None for G = 1).
        peak_rss_mib: The rank's peak resident memory so far.
    """

    seconds: float
    local_parameters: int
    kv_capacity_tokens: int | None = None
    strategy: str | None = None
    collectives: str | None = None
    peak_rss_mib: float = 0.0


@dataclass(frozen=True)
class SwapReport:
    """What a rank reports once it swapped in another checkpoint's weights.

    Args:
        seconds: How long reading the checkpoint took.
        bytes: Bytes written into this rank's parameters.
        peak_rss_mib: The rank's peak resident memory so far.
    """

    seconds: float
    bytes: int
    peak_rss_mib: float


@dataclass(frozen=True)
class NodeInfo:
    """Where a rank runs, as its actor reports it.

    Args:
        node_id: Its Ray node.
        ip: Its Ray node's address.
        gpu_ids: The GPUs Ray assigned it.
        pid: Its process.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` in its process (None: unset).
        cuda_device: The local CUDA index it computes on (None for CPU ranks).
    """

    node_id: str
    ip: str
    gpu_ids: list[str]
    pid: int
    cuda_visible_devices: str | None
    cuda_device: int | None


@dataclass(frozen=True)
class RankSite:
    """Where one rank of a group runs: its replica, its rank in the replica, its node, its
    address and its process."""

    replica: int
    shard_rank: int
    node_id: str
    ip: str
    pid: int


@dataclass(frozen=True)
class InputTokens:
    """Tokens a model was fed, counted at its input embeddings (summed with ``+``).

    Args:
        fed: Every input position of every forward and ``generate`` step, padding and dummy
            micro-batches included.
        real: Those whose id is not the padding id.
        calls: The embedding's calls.
        decode_rows: The rows of the calls fed one position per row (one-token decode steps),
            finished rows included.
    """

    fed: int = 0
    real: int = 0
    calls: int = 0
    decode_rows: int = 0

    def __add__(self, other: InputTokens) -> InputTokens:
        return InputTokens(
            self.fed + other.fed,
            self.real + other.real,
            self.calls + other.calls,
            self.decode_rows + other.decode_rows,
        )

    def __sub__(self, other: InputTokens) -> InputTokens:
        return InputTokens(
            self.fed - other.fed,
            self.real - other.real,
            self.calls - other.calls,
            self.decode_rows - other.decode_rows,
        )


class Computes(Protocol):
    """A rank's computations, one per micro-batch type."""

    def score(self, batch: ScoreMicroBatch) -> tuple[Any, StepStats]: ...

    def generate(self, batch: GenerateMicroBatch) -> tuple[Any, StepStats]: ...


def compute(rank: Computes, batch: ScoreMicroBatch | GenerateMicroBatch) -> tuple[Any, StepStats]:
    """``batch``'s (result, figures), computed as its type says."""
    if isinstance(batch, ScoreMicroBatch):
        return rank.score(batch)
    if isinstance(batch, GenerateMicroBatch):
        return rank.generate(batch)
    raise TypeError(f"a rank computes score or generate micro-batches, not {type(batch).__name__}")


def compute_many(rank: Computes, batches: bytes) -> bytes:
    """Several micro-batches in one call, in order: ``batches`` is their pickled list; returns
    the pickled (result, figures) of each. The dispatcher sends short steps in bulk so that a
    Ray round trip per step does not idle the rank; every rank of a replica gets as many, so
    collectives still line up."""
    return pickle.dumps([compute(rank, batch) for batch in pickle.loads(batches)], protocol=5)
