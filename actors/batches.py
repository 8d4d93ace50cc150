"""What travels between the driver and a rank: micro-batches in, per-row results out.

These are plain frozen dataclasses of token ids (no torch), built by the driver's planner and
consumed by :class:`rayeval.actors.worker.ShardWorker`. An empty micro-batch is a *dummy*: the rank
still runs one forward (or one ``generate``) so that every rank of a shard group issues the same
collectives.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from rayeval.actors.layout import DeviceKind, ShardStrategy

#: Most MiB of logits and log-probabilities a scoring micro-batch holds at once: a micro-batch's
#: scored positions run through the output head in chunks of as many (``--logits_budget_mib``).
#: At a 152k vocabulary, 208 positions: chunks of 208 rows cost what one pass over 2,048 does
#: (the head's weight is read once per chunk; chunks of 48 took 1.47x as long, float32, 1 thread).
DEFAULT_LOGITS_BUDGET_MIB = 256
#: Rows of a generation group when the configuration does not say (the same as the driver's
#: ``DEFAULT_MAX_BATCH_ROWS``).
DEFAULT_GENERATE_ROWS = 64
#: A head chunk's positions are a multiple of this (a micro-batch's last chunk excepted).
HEAD_CHUNK_ALIGN = 16
#: Bytes a scored position's logits and log-probabilities take per vocabulary entry (float32 at
#: most, each).
LOGIT_BYTES = 2 * 4
#: Rows of logits a rank reserves per generating row before sizing its KV cache: the float32
#: logits, the processors' scores and their log-softmax or sampling copy.
GENERATE_LOGIT_COPIES = 3


def head_chunk_rows(vocab: int, budget_bytes: int) -> int:
    """Scored positions per pass of the output head that ``budget_bytes`` of logits and
    log-probabilities hold at a vocabulary of ``vocab``: a multiple of
    :data:`HEAD_CHUNK_ALIGN`, at least one multiple."""
    fits = budget_bytes // max(1, vocab * LOGIT_BYTES)
    return max(HEAD_CHUNK_ALIGN, fits // HEAD_CHUNK_ALIGN * HEAD_CHUNK_ALIGN)


@dataclass(frozen=True)
class ModelSpec:
    """How every rank loads the model and its tokenizer.

    Args:
        pretrained: Hub id or local path of the Hugging Face checkpoint.
        revision: Hub revision (ignored for local paths).
        subfolder: Sub-directory of the checkpoint.
        dtype: ``"auto"`` (the checkpoint's), or a torch dtype name such as ``"bfloat16"``.
        trust_remote_code: Passed to ``from_pretrained``.
        tokenizer: Tokenizer id/path when it differs from ``pretrained``.
        pad_token_id: The pad id the driver's tokenizer uses (after lm-eval's pad-token fix-up).
        softmax_dtype: dtype for the log-softmax, as lm-eval's ``softmax_dtype`` model arg.
        mixed_precision_dtype: autocast dtype, as lm-eval's ``mixed_precision_dtype`` model arg.
        extra_kwargs: Other ``from_pretrained`` keyword arguments (e.g. ``attn_implementation``).
        checkpoint: A training checkpoint to take the weights from (a DCP directory, or
            safetensors / ``.bin`` files); ``pretrained`` then gives the config and tokenizer.
        peft: A LoRA adapter folder applied over the loaded weights, unmerged, as lm-eval's
            ``peft=`` (:mod:`rayeval.actors.weights.adapters`).
        delta: A model folder whose weights are added to the loaded ones, as lm-eval's
            ``delta=``.
        vocab_size: Rows of the embeddings and head when they differ from the config's: the
            tokenizer's length, to which lm-eval resizes them for ``peft=``
            (:mod:`rayeval.actors.weights.vocabulary`); None: the config's.
    """

    pretrained: str
    revision: str | None = None
    subfolder: str = ""
    dtype: str = "auto"
    trust_remote_code: bool = False
    tokenizer: str | None = None
    pad_token_id: int = 0
    softmax_dtype: str | None = None
    mixed_precision_dtype: str | None = None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    peft: str | None = None
    delta: str | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class RankOptions:
    """How every rank of an evaluation runs (the same for all of them).

    Args:
        shard_size: Ranks per replica (G).
        device: CPU or CUDA.
        collective_timeout_s: Timeout of every collective in the replica's process group.
        seed: torch seed, for sampled generations (the same on every rank, so that
            tensor-parallel ranks sample the same tokens).
        strategy: How the replica shards the model (FSDP for G = 1: the model whole).
        shm_collectives: Whether ranks of a replica on one node may exchange activations
            through shared memory (tensor parallelism on CPU).
        piece_interval_s: Least seconds between two pieces of a rank's continuous-batching
            stream (:func:`piece_due`): every rank's stream ends at the one driver.
        split_replicas: The replicas whose ranks span nodes (their GPU ranks pin NCCL's
            interface to the one Ray reaches the node by).
        logits_budget_mib: Most MiB of logits and log-probabilities a scoring micro-batch holds
            at once (:class:`rayeval.actors.compute.scoring.Scorer`).
        generate_rows: Most rows a generation group computes at once (its slots): their
            logits are set aside before the KV cache is sized from free memory.
    """

    shard_size: int
    device: DeviceKind = DeviceKind.CPU
    collective_timeout_s: float = 600.0
    seed: int = 1234
    strategy: ShardStrategy = ShardStrategy.FSDP
    shm_collectives: bool = True
    piece_interval_s: float = 0.0
    split_replicas: tuple[int, ...] = ()
    logits_budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB
    generate_rows: int = DEFAULT_GENERATE_ROWS


@dataclass(frozen=True)
class ScoreRow:
    """One model input and the continuations scored against it.

    A *plain* row is one sequence: several requests share it when their inputs are
    token-identical (for example the one-token answers of a multiple-choice question).

    A *packed* row (``parents`` set) is a token tree: the inputs of several requests that share a
    prefix (the choices of one question, or questions behind the same few-shot examples), the
    shared tokens stored once. Token ``i`` sees exactly its ancestors (``parents[i]``,
    ``parents[parents[i]]``, ...) and sits at position id = its depth, so each request's tokens are
    computed as if its input were a row of its own (see :mod:`rayeval.actors.compute.packing`).

    Args:
        tokens: Plain: the model input, already truncated:
            ``(context + continuation)[-(L+1):][:-1]``.
            Packed: the tree's tokens, every parent before its children.
        targets: Each continuation's tokens. Plain: continuation ``c`` is scored at the last
            ``len(c)`` positions of ``tokens``.
        parents: Packed only: per token, the index of its parent token (-1 for a root).
        positions: Packed only: per target, the row positions whose logits predict its tokens.

    A row travels compactly (:meth:`__reduce__`): its token ids and parents as 32-bit integers
    in one buffer each, so a rank receives them as an ``array('i')`` (not a tuple of Python
    ints, which cost a rank more to unpickle than the rest of the micro-batch) and builds its
    input tensor straight from the buffer (:func:`rayeval.actors.compute.packing.padded_ids`).
    """

    tokens: tuple[int, ...] | array[int]
    targets: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...] | array[int] | None = None
    positions: tuple[tuple[int, ...], ...] | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        try:
            tokens = _int32(self.tokens)
            parents = None if self.parents is None else _int32(self.parents)
        except struct.error:  # an id beyond 32 bits (no tokenizer has one): as it is
            return ScoreRow, (self.tokens, self.targets, self.parents, self.positions)
        return _received_row, (tokens, self.targets, parents, self.positions)

    def scored_positions(self) -> tuple[tuple[int, ...], ...]:
        """Per target, the row positions whose logits predict its tokens."""
        if self.positions is not None:
            return self.positions
        width = len(self.tokens)
        return tuple(tuple(range(width - len(t), width)) for t in self.targets)


def _int32(values: tuple[int, ...] | array[int]) -> bytes:
    return _int32_packer(len(values)).pack(*values)


@lru_cache(maxsize=8192)
def _int32_packer(count: int) -> struct.Struct:
    """A compiled format per row length (``struct``'s own cache holds 100, fewer than the
    lengths of one evaluation's rows)."""
    return struct.Struct(f"{count}i")


def _received_row(
    tokens: bytes,
    targets: tuple[tuple[int, ...], ...],
    parents: bytes | None,
    positions: tuple[tuple[int, ...], ...] | None,
) -> ScoreRow:
    """A :class:`ScoreRow` as it arrives: its ids and parents in ``array('i')``s."""
    return ScoreRow(
        array("i", tokens), targets, None if parents is None else array("i", parents), positions
    )


@dataclass(frozen=True)
class ScoreMicroBatch:
    """Rows one rank scores in one forward pass (right-padded, like lm-eval's HF backend)."""

    rows: tuple[ScoreRow, ...] = ()

    @property
    def targets(self) -> tuple[int, ...]:
        """Per row, how many targets it scores (the answers its result holds)."""
        return tuple(len(row.targets) for row in self.rows)


@dataclass(frozen=True)
class Pickled:
    """An object pickled by the C pickler: pickling this again yields the object itself, so Ray
    (whose cloudpickle visits every field of a dataclass in Python) sends the bytes as they are
    and the receiver gets the object.

    Args:
        data: The pickled object.
    """

    data: bytes

    @classmethod
    def of(cls, value: Any) -> Pickled:
        return cls(pickle.dumps(value, protocol=5))

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.data,)


@dataclass(frozen=True)
class PickledScoreBatch(Pickled):
    """A :class:`ScoreMicroBatch` pickled where it was planned (a planning actor,
    :mod:`rayeval.service.engine.parts.score`): the driver hands it on without unpickling
    it, and a rank receives the :class:`ScoreMicroBatch`.

    Args:
        data: The pickled micro-batch.
        targets: Per row, how many targets it scores (the answers its result must hold).
    """

    targets: tuple[int, ...] = ()

    @classmethod
    def of(cls, value: Any) -> PickledScoreBatch:
        return cls(pickle.dumps(value, protocol=5), value.targets)


@dataclass(frozen=True)
class GenerateMicroBatch:
    """Contexts one rank continues with one ``generate`` call (left-padded).

    Args:
        contexts: Context token ids, already left-truncated to leave room for generation (a
            tuple, or the ``array('i')`` a tokeniser actor's ids arrive in).
        max_gen_toks: New tokens to generate (lm-eval's ``max_gen_toks``).
        until: Stop strings (EOS included), checked by lm-eval's stopping criteria.
        max_length: An explicit ``max_length`` from the user's gen_kwargs, else None.
        kwargs: The remaining generation kwargs, passed to ``generate`` as lm-eval does.
    """

    contexts: tuple[tuple[int, ...] | array[int], ...] = ()
    max_gen_toks: int = 1
    until: tuple[str, ...] = ()
    max_length: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SlotRequest:
    """One generate_until request for the continuous-batching engine.

    Args:
        context: Context token ids, already left-truncated to leave room for generation (a
            tuple, or the ``array('i')`` a tokeniser actor's ids arrive in).
        max_gen_toks: Most tokens it may generate.
        until: Its stop strings (the EOS token's text included, as lm-eval adds it).
        seed: Seed of its own sampling generator (sampled generations); None when greedy.
    """

    context: tuple[int, ...] | array[int]
    max_gen_toks: int
    until: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def kv_tokens(self) -> int:
        """The most KV-cache positions it can hold: its context and every token it may add."""
        return len(self.context) + self.max_gen_toks


#: How a rank paces a :class:`GenerateGroup` (``actors.continuous``; the benchmarks' simulated
#: rank, which loads no torch, reads them too). Slots are refilled once at least this share of
#: them is free (or every pending request fits): a prefill is a forward of its own, and a wave
#: of them costs about what one does.
ADMIT_FRACTION = 1 / 8
#: A rank streams a piece back once this share of its slots' requests finished since the last
#: one (at least one request) and :attr:`RankOptions.piece_interval_s` passed, or once
#: ``PIECE_WAIT_S`` (or the interval, if longer) passed with an answer waiting.
PIECE_FRACTION = 1 / 4
PIECE_WAIT_S = 1.0
#: Pieces the driver reads a second from all ranks together, at most (the interval is the ranks
#: over this). Each costs it a Ray round trip, ~0.45 ms of CPU on the 2-core machine: with short
#: answers on a fast model the share alone sent hundreds a second per rank.
PIECES_PER_S = 200


def piece_due(finished: int, slots: int, since_s: float, interval_s: float) -> bool:
    """Whether a rank sends a piece now: ``finished`` answers waiting in a group of ``slots``
    slots, ``since_s`` seconds (of the rank's clock) after its last piece, pieces at least
    ``interval_s`` apart."""
    if not finished:
        return False
    enough = finished >= max(1, int(slots * PIECE_FRACTION))
    return since_s >= interval_s and (enough or since_s >= PIECE_WAIT_S)


@dataclass(frozen=True)
class GenerateGroup:
    """Requests one rank generates with the continuous-batching engine: ``slots`` rows decode
    together, a finished row's slot goes to the next request in order, and the rows held at once
    never need more than ``kv_tokens`` cache positions together. An empty group is a dummy: the
    rank steps along with the replica's other ranks until they are done.

    Args:
        requests: In admission order.
        slots: Most rows decoded at once.
        kv_tokens: Most KV-cache positions held at once (sum of the rows' ``kv_tokens``).
        kwargs: Generation settings shared by the requests (lm-eval's gen_kwargs, sampling).
        prefill_tokens: Most positions one prefill wave feeds (rows x the widest context), or
            None for no bound; a request wider than this is prefilled alone.
    """

    requests: tuple[SlotRequest, ...] = ()
    slots: int = 1
    kv_tokens: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)
    prefill_tokens: int | None = None

    def admit(self, live: Sequence[int], pending: Sequence[int]) -> list[int]:
        """The next pending positions, in order, that join the ``live`` ones now: as many as
        fit the free slots, the KV-cache budget and a prefill wave, once enough slots are free
        (:data:`ADMIT_FRACTION`): each prefill is a forward of its own, so slots are refilled in
        waves. The rows' caches are one cache left-padded to the longest row's length, so the
        budget is held to rows x the most any of them needs (not the sum of their needs). A
        later, smaller request never overtakes one that does not fit yet; with no live row, the
        first pending request is admitted whatever it needs."""
        wave = max(1, int(self.slots * ADMIT_FRACTION))
        if live and self.slots - len(live) < min(wave, len(pending)):
            return []
        longest = max((self.requests[p].kv_tokens for p in live), default=0)
        admitted: list[int] = []
        width = 0
        for position in pending:
            rows = len(live) + len(admitted) + 1
            if rows > self.slots:
                break
            request = self.requests[position]
            wider = max(width, len(request.context))
            needs = max(longest, request.kv_tokens)
            if (live or admitted) and rows * needs > self.kv_tokens:
                break
            if admitted and (len(admitted) + 1) * wider > (self.prefill_tokens or 2**62):
                break
            admitted.append(position)
            longest, width = needs, wider
        return admitted


@dataclass(frozen=True)
class GenerationPiece:
    """What a rank streams back while it works through a :class:`GenerateGroup`.

    Args:
        finished: Requests that finished since the last piece: (position in the group, the
            generated token ids, the EOS or stop that ended it included).
        stats: The rank's figures for the work since the last piece.
    """

    finished: tuple[tuple[int, tuple[int, ...]], ...]
    stats: StepStats


MicroBatch = ScoreMicroBatch | GenerateMicroBatch | GenerateGroup

#: Per row, per target: (sum of log-probs, whether every target token was the greedy argmax).
ScoreResult = list[list[tuple[float, bool]]]
#: Per context: the generated token ids after the (padded) context.
GenerateResult = list[list[int]]
#: Per request of a :class:`GenerateGroup`: its generated token ids.
GroupResult = list[tuple[int, ...]]


@dataclass(frozen=True)
class StepStats:
    """What one rank reports about one micro-batch, for throughput and padding figures."""

    real_tokens: int
    padded_tokens: int
    seconds: float
    #: The rank's resident memory right after the micro-batch (MiB; 0.0 where unknown).
    rss_mib: float = 0.0
    #: Device memory held by tensors on a CUDA rank (MiB; 0.0 on CPU ranks).
    device_mib: float = 0.0
