"""A simulated rank for measuring the driver: the rank actor's interface, a modelled model call.

:class:`SimulatedRank` has the methods :class:`rayeval.actors.worker.ShardWorker` offers the
worker group and the dispatcher (set-up, ``score``, ``generate``, ``generate_stream``, the bulk
``compute_many``, the figures), runs as a real Ray actor in the real placement group, and loads
nothing: it never imports torch, so 64 of them fit on a 2-core machine. Each micro-batch sleeps
for the time a GPU would spend on it (:class:`StepCost`: padded tokens times a per-token cost,
decode steps bounded below by reading the weights once) and returns answers of the right shape
that depend on the request alone (a hash of its tokens), so any layout must give every request
the same answer.

Tests and benchmarks only: the product never imports this module. It is handed to
``RayEvalLM(tunables=Tunables(rank_class=simulated_rank(cost)))``, which passes it to
``WorkerGroup.create``; everything else (placement group, dispatcher, planner, progress, the
response cache) is the product's own code.

The default cost is Llama-3.2-1B (1.24e9 parameters) in bf16 on one H100 SXM: NVIDIA's datasheet
gives 989 TFLOP/s of dense BF16 and 3.35 TB/s of HBM3. A forward costs about 2 FLOPs per parameter
per token; at half the peak (a prefill-heavy forward's usual share) that is 5.0 us per token. A
decode step reads every weight once: 2.5 GB / 3.35 TB/s = 0.74 ms, about 1 ms with the KV cache
and launch overheads.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import zlib
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rayeval.actors.batches import (
    GenerateGroup,
    GenerateMicroBatch,
    GenerationPiece,
    ModelSpec,
    RankOptions,
    ScoreMicroBatch,
    ScoreRow,
    StepStats,
    piece_due,
)
from rayeval.actors.layout import RankCoord
from rayeval.actors.protocol import InputTokens, LoadReport, NodeInfo, compute

#: Generated token ids are drawn from this range (ordinary tokens of any tokenizer).
TOKEN_LOW, TOKEN_SPAN = 100, 500


@dataclass(frozen=True)
class StepCost:
    """What one micro-batch costs a modelled GPU.

    Args:
        token_s: Seconds per padded token of a forward (prefill or scoring).
        decode_step_s: Least seconds of one decode step (reading the weights once).
    """

    token_s: float = 5.0e-6
    decode_step_s: float = 1.0e-3

    def forward_s(self, padded_tokens: int) -> float:
        return padded_tokens * self.token_s

    def decode_s(self, rows: int) -> float:
        return max(self.decode_step_s, rows * self.token_s)


def simulated_rank(cost: StepCost) -> type[SimulatedRank]:
    """A :class:`SimulatedRank` class whose ranks model ``cost``. Ray ships it by value, with this
    module, so rank processes need not find ``benchmarks/`` on their path."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return type("SimulatedRank", (SimulatedRank,), {"COST": cost})


def score_answer(model_input: Sequence[int], target: Sequence[int]) -> tuple[float, bool]:
    """The simulated (log-likelihood, is_greedy) of ``target`` after ``model_input``: a function
    of the request alone (a CRC of its 32-bit ids, and tuples of ints, hash alike in every
    process)."""
    return _answer(_input_hash(model_input), target)


def _input_hash(tokens: Sequence[int]) -> int:
    """A CRC of the ids as a rank receives them."""
    return zlib.crc32(_int32_ids(tokens))


def _int32_ids(tokens: Sequence[int]) -> array[int]:
    """The ids as the 32-bit buffer a rank receives them in (``ScoreRow.__reduce__``); a tuple
    (a row made in this process, or a test's model input) is packed into one."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    return array("i", tokens)


def _answer(input_hash: int, target: Sequence[int]) -> tuple[float, bool]:
    h = hash((input_hash, tuple(target)))
    return -((h % 1_000_003) / 1e5 + 0.01) * len(target), h % 7 == 0


def generated_tokens(context: Sequence[int], max_gen_toks: int) -> tuple[int, ...]:
    """The simulated answer of a generation request: 1 to ``max_gen_toks`` tokens."""
    h = hash(tuple(context)) & 0xFFFFFFFFFFFF
    length = 1 + h % max(1, max_gen_toks)
    return tuple(TOKEN_LOW + (h >> (i % 40)) % TOKEN_SPAN for i in range(length))


class SimulatedRank:
    """One simulated rank (see the module docstring); Ray's actor options are the real rank's.

    Args:
        spec: The model (ignored: nothing is loaded).
        coord: This rank's replica, shard rank and global rank.
        options: How the evaluation's ranks run.
    """

    COST = StepCost()

    def __init__(self, spec: ModelSpec, coord: RankCoord, options: RankOptions) -> None:
        self._coord = coord
        self._piece_interval_s = options.piece_interval_s
        self._fed = {"fed": 0, "real": 0, "calls": 0, "decode_rows": 0}
        self._calls: list[tuple[float, float, float]] = []

    # ----------------------------------------------------------------------------- lifecycle
    def node_info(self) -> NodeInfo:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return NodeInfo(node_id, ray.util.get_node_ip_address(), [], os.getpid(), None, None)

    def begin_evaluation(self, seed: int) -> int:
        return os.getpid()

    def reserve_port(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def setup(self, rendezvous: tuple[str, int]) -> LoadReport:
        return LoadReport(seconds=0.0, local_parameters=0)

    def shutdown(self) -> None:
        """Nothing to release."""

    def input_token_counts(self) -> InputTokens:
        return InputTokens(**self._fed)

    def kv_capacity_tokens(self) -> int | None:
        return None  # no memory is modelled

    # ------------------------------------------------------------------------------- compute
    def compute(self, batch: ScoreMicroBatch | GenerateMicroBatch) -> tuple[Any, StepStats]:
        return compute(self, batch)

    def compute_many(self, batches: bytes) -> bytes:
        """Several pickled micro-batches in one call, in order (the real rank's bulk entry)."""
        started = time.monotonic()
        outputs = [compute(self, batch) for batch in pickle.loads(batches)]
        value = pickle.dumps(outputs, protocol=5)
        self._calls.append((started, time.monotonic(), sum(s.seconds for _, s in outputs)))
        return value

    def call_times(self) -> list[tuple[float, float, float]]:
        """The bulk calls since the last look: (started, ended, modelled seconds), on this
        machine's monotonic clock (``driver_timeline.py`` compares it with the driver's)."""
        calls, self._calls = self._calls, []
        return calls

    def score(self, batch: ScoreMicroBatch) -> tuple[list[list[tuple[float, bool]]], StepStats]:
        started = time.monotonic()
        width = max((len(row.tokens) for row in batch.rows), default=1)
        padded = width * max(1, len(batch.rows))
        real = sum(len(row.tokens) for row in batch.rows)
        result = [_row_answers(row) for row in batch.rows]
        return result, self._finish(started, self.COST.forward_s(padded), real, padded)

    def generate(self, batch: GenerateMicroBatch) -> tuple[list[list[int]], StepStats]:
        started = time.monotonic()
        answers = [list(generated_tokens(c, batch.max_gen_toks)) for c in batch.contexts]
        width = max((len(c) for c in batch.contexts), default=1)
        rows = max(1, len(batch.contexts))
        steps = max((len(a) for a in answers), default=1)
        modelled = self.COST.forward_s(rows * width) + steps * self.COST.decode_s(rows)
        real = sum(len(c) for c in batch.contexts)
        return answers, self._finish(started, modelled, real, rows * (width + steps))

    def generate_stream(self, group: GenerateGroup) -> Iterator[GenerationPiece]:
        """Continuous batching, modelled: slots refilled in waves, one decode step per token,
        a piece whenever a quarter of the slots' requests finished (or a second passed)."""
        yield from _SlotModel(self, group).run()

    def _finish(self, started: float, modelled: float, real: int, padded: int) -> StepStats:
        """Sleep out the modelled time (less what the answers took) and report it."""
        time.sleep(max(0.0, modelled - (time.monotonic() - started)))
        self._fed["fed"] += padded
        self._fed["real"] += real
        self._fed["calls"] += 1
        return StepStats(real_tokens=real, padded_tokens=padded, seconds=modelled)


def _row_answers(row: ScoreRow) -> list[tuple[float, bool]]:
    """Each target's answer from its own model input (a packed row's path to its last token)."""
    if row.parents is None:  # one input, hashed once for all its targets
        input_hash = _input_hash(row.tokens)
        return [_answer(input_hash, target) for target in row.targets]
    path_hash = _PathHashes(row)
    return [
        _answer(path_hash(positions[-1]), target)
        for target, positions in zip(row.targets, row.scored_positions(), strict=True)
    ]


class _PathHashes:
    """A packed row's path hashes: the CRC of the ids from a root down to a token, which is the
    CRC of that request's own input. A CRC goes on from a prefix's value, so a path is hashed a
    *run* at a time (tokens each the child of the one before: a context's unshared tail) in C,
    not walked token by token."""

    def __init__(self, row: ScoreRow) -> None:
        assert row.parents is not None
        self._bytes = memoryview(_int32_ids(row.tokens)).cast("B")
        self._parents = row.parents
        self._run_start = []  # per token, where its run starts
        start = 0
        for j, parent in enumerate(row.parents):
            if parent != j - 1:
                start = j
            self._run_start.append(start)
        self._known = {-1: 0}

    def __call__(self, position: int) -> int:
        known = self._known.get(position)
        if known is None:
            start = self._run_start[position]
            before = self(self._parents[start])
            known = zlib.crc32(self._bytes[4 * start : 4 * (position + 1)], before)
            self._known[position] = known
        return known


class _SlotModel:
    """The continuous-batching engine's timeline for one group, without a model."""

    def __init__(self, rank: SimulatedRank, group: GenerateGroup) -> None:
        self._rank = rank
        self._group = group
        self._cost = rank.COST
        self._answers = [generated_tokens(r.context, r.max_gen_toks) for r in group.requests]
        self._pending = deque(range(len(group.requests)))
        self._live: dict[int, int] = {}  # position -> tokens still to generate

    def run(self) -> Iterator[GenerationPiece]:
        started = time.monotonic()
        clock = sent = 0.0  # modelled seconds since the start, and at the last piece
        finished: list[tuple[int, tuple[int, ...]]] = []
        fed = 0
        while self._pending or self._live:
            admitted = self._admit()
            clock += self._cost.forward_s(
                sum(len(self._group.requests[p].context) for p in admitted)
            )
            fed += sum(len(self._group.requests[p].context) for p in admitted) + len(self._live)
            clock += self._cost.decode_s(len(self._live))
            for position in list(self._live):
                self._live[position] -= 1
                if self._live[position] == 0:
                    del self._live[position]
                    finished.append((position, self._answers[position]))
            since = clock - sent
            if piece_due(len(finished), self._group.slots, since, self._rank._piece_interval_s):
                yield self._piece(finished, fed, clock - sent, started + clock)
                finished, fed, sent = [], 0, clock
        if finished or fed:
            yield self._piece(finished, fed, clock - sent, started + clock)

    def _admit(self) -> list[int]:
        admitted = self._group.admit(list(self._live), list(self._pending))
        for position in admitted:
            self._pending.remove(position)
            self._live[position] = len(self._answers[position])
        return admitted

    def _piece(
        self, finished: list[tuple[int, tuple[int, ...]]], fed: int, seconds: float, due: float
    ) -> GenerationPiece:
        time.sleep(max(0.0, due - time.monotonic()))
        self._rank._fed["fed"] += fed
        self._rank._fed["real"] += fed
        stats = StepStats(real_tokens=fed, padded_tokens=fed, seconds=seconds)
        return GenerationPiece(tuple(finished), stats)
