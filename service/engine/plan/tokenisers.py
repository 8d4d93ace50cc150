"""Tokeniser actors: a request type's parts tokenised across the cluster's free CPUs.

The driver's tokeniser does ~10,000 requests a second on one core; 64 replicas consume tens of
thousands. For a request type of more than one part (:mod:`rayeval.service.engine.parts.pipeline`),
:func:`made_parts` hands each part's tokenising, cut into chunks, to a :class:`TokeniserPool` of
Ray actors (one CPU each, spread over the nodes) holding a pickled copy of the driver's own
encoder (lm-eval's ``HFLM`` over the weightless model: every rule is the same object's), while
the planning thread makes the first part itself and plans the parts whose tokens are back. The
driver keeps what must see the requests in order or in one place: lm-eval's checks, the shared
token ids (:func:`rayeval.service.engine.plan.encoder.shared_ids`), the sampling seeds, a generation
part's plan; a loglikelihood part the actors tokenised is planned on one of them
(:func:`rayeval.service.engine.parts.score.plan_part`, in the :data:`PLAN_GROUP` thread).

Exactness: a chunk's tokens are those the driver would make (the same encoder, pickled), and each
chunk's first request is tokenised on the driver too and compared; a chunk that differs, fails or
times out ends the pool, and the driver tokenises (and plans) the rest itself (with a warning).
The parts, and so the plan, are the same whoever made them.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy

from rayeval.service.engine.parts.pipeline import AHEAD, even_bounds

logger = logging.getLogger(__name__)

#: Tokeniser actors at most when the setting is automatic.
AUTO_MAX = 16
#: Longest wait for one chunk's tokens (an actor's start-up included) before the driver
#: tokenises the rest itself.
CHUNK_TIMEOUT_S = 120.0
#: The actors' concurrency group for planning a part: its own thread, so that a plan does not
#: wait behind the chunks queued for tokenising.
PLAN_GROUP = "plan"


class Tokeniser:
    """A tokeniser actor: the driver's encoder, and the functions it is asked to apply."""

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder

    def ready(self) -> int:
        return os.getpid()

    def run(self, function: Callable[..., Any], args: bytes, *refs: Any) -> Any:
        """``function(encoder, *args, *refs)`` (a module-level function of the encoder;
        ``args`` pickled, ``refs`` arrive as their values)."""
        return function(self._encoder, *pickle.loads(args), *refs)


def pool_size(setting: int | None) -> int:
    """Tokeniser actors for ``setting`` (None: half the CPUs free in the cluster, so that other
    evaluations' ranks still find CPUs, at most :data:`AUTO_MAX`; a number: that many)."""
    if setting is not None:
        return setting
    import ray

    return min(AUTO_MAX, math.floor(ray.available_resources().get("CPU", 0.0) / 2))


class TokeniserPool:
    """Tokeniser actors over a copy of the driver's encoder, for one request type of several
    parts: started at once (they load while the driver makes the first part), closed with
    :meth:`close` or ``with`` (their CPUs are the cluster's again).

    Args:
        encoder: The driver's encoder (pickled to each actor).
        setting: ``tokenizer_workers``: how many actors (:func:`pool_size`; 0: none).
    """

    def __init__(self, encoder: Any, setting: int | None) -> None:
        self.size = size = pool_size(setting)
        #: Requests whose tokens the actors made (and the driver used).
        self.tokenised = 0
        #: Requests whose part an actor planned (and the driver used).
        self.planned = 0
        self._actors: list[Any] = []
        self._turn = 0
        if size <= 0:
            return
        import ray

        from rayeval.actors.layout import DeviceKind
        from rayeval.actors.process import rank_environment

        # One CPU each, no GPU.
        env = rank_environment(DeviceKind.CPU) | {"TOKENIZERS_PARALLELISM": "false"}
        try:
            shared = ray.put(encoder)
        except Exception as exc:  # a tokenizer that does not pickle (custom code)
            logger.warning(
                "the tokenizer cannot be sent to tokeniser actors (%s): the driver tokenises alone",
                exc,
            )
            self.size = 0
            return
        # (Ray's typing lacks the actor option concurrency_groups.)
        groups: dict[str, Any] = {"concurrency_groups": {PLAN_GROUP: 1}}
        remote: Any = ray.remote(**groups)(Tokeniser)
        self._actors = [
            remote.options(
                num_cpus=1,
                max_restarts=0,
                scheduling_strategy="SPREAD",
                runtime_env={"env_vars": env},
            ).remote(shared)
            for _ in range(size)
        ]
        logger.info("%d tokeniser actors started", size)

    @property
    def working(self) -> bool:
        return bool(self._actors)

    def submit(
        self,
        function: Callable[..., Any],
        *args: Any,
        refs: Sequence[Any] = (),
        group: str | None = None,
    ) -> Any:
        """A ref to ``function(encoder, *args, *refs)`` on the next actor in turn: ``args``
        travel pickled by the C pickler (Ray's cloudpickle visits a list of strings in Python),
        ``refs`` (Ray object refs) arrive as their values; ``group``: the actor's concurrency
        group, e.g. :data:`PLAN_GROUP`."""
        actors = self._actors  # close() swaps the list: a call racing it fails, as a lost actor
        if not actors:
            raise RuntimeError("the tokeniser pool is closed: look at pool.working first")
        actor = actors[self._turn % len(actors)]
        self._turn += 1
        method = actor.run.options(concurrency_group=group) if group else actor.run
        return method.remote(function, pickle.dumps(args, protocol=5), *refs)

    def gather(self, refs: list[Any]) -> list[Any] | None:
        """The results of ``refs``, in order; None (the pool closed) if one failed or took
        longer than :data:`CHUNK_TIMEOUT_S`."""
        import ray

        try:
            return [ray.get(ref, timeout=CHUNK_TIMEOUT_S) for ref in refs]
        except ray.exceptions.GetTimeoutError:
            self.fail(
                f"no result within {CHUNK_TIMEOUT_S:.0f} s: if the cluster has fewer free CPUs "
                "than --tokenizer_workers asks for, lower it or leave it unset"
            )
        except Exception as exc:
            if self._actors:  # else the pool was closed under it: nothing to say
                self.fail(f"{type(exc).__name__}: {exc}")
        return None

    def fail(self, why: str) -> None:
        """Close the pool: the driver tokenises, plans and decodes the rest itself."""
        logger.warning(
            "tokeniser actors stopped (%s): the driver tokenises, plans and decodes the rest "
            "itself",
            why,
        )
        self.close()

    def close(self) -> None:
        import ray

        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def __enter__(self) -> TokeniserPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PartTokens:
    """How a request type's parts are tokenised and made (its own module gives one).

    Attributes:
        function: Tokenises requests: ``function(encoder, *args(start, stop))``, on an actor
            or on the driver; a module-level function, so that it pickles by name.
        args: Its arguments for requests ``start:stop``.
        chunks: Cuts requests ``start:stop`` into ``n`` chunks (a cut never splits what one
            call must see together).
        join: The chunks' tokens, in order, as the tokens of their part (their token ids
            made the driver's shared ones), given the chunks' results and their refs.
        first: The first request's tokens, to compare (of the function's result).
        make: Makes the part ``start:stop`` from its tokens (None: it tokenises them itself).
        encoder: The driver's encoder.
        refuse_early: Refuses, before the first part, what planning a later part would refuse
            (given the plan's budget; None: nothing to refuse).
    """

    function: Callable[..., Any]
    args: Callable[[int, int], tuple[Any, ...]]
    chunks: Callable[[int, int, int], Iterable[tuple[int, int]]]
    join: Callable[[list[Any], list[Any]], Any]
    first: Callable[[Any], Any]
    make: Callable[[int, int, Any], Any]
    encoder: Any
    refuse_early: Callable[[Any], None] | None = None


def made_parts(
    bounds: Iterable[tuple[int, int]], tokens: PartTokens, pool: TokeniserPool
) -> Iterator[Any]:
    """Each part of ``bounds``, made, in order: the first on the calling thread while the
    actors start, the next :data:`~rayeval.service.engine.parts.pipeline.AHEAD` + 1 in the actors'
    queues meanwhile; without a working pool, each made by the calling thread."""
    bounds = iter(bounds)
    first = next(bounds, None)
    if first is None:
        return
    waiting: deque[tuple[tuple[int, int], list[tuple[int, Any]]]] = deque()

    def submit() -> None:
        bound = next(bounds, None) if pool.working else None
        if bound is not None:
            chunks = tokens.chunks(*bound, pool.size)
            refs = [
                (start, pool.submit(tokens.function, *tokens.args(start, stop)))
                for start, stop in chunks
            ]
            waiting.append((bound, refs))

    for _ in range(AHEAD + 1):
        submit()
    yield tokens.make(*first, None)
    while waiting:
        (start, stop), refs = waiting.popleft()
        submit()
        made = _gathered(tokens, pool, refs) if pool.working else None
        pool.tokenised += 0 if made is None else stop - start
        yield tokens.make(start, stop, made)
    for bound in bounds:  # no pool, or it stopped: the driver alone
        yield tokens.make(*bound, None)


def _gathered(tokens: PartTokens, pool: TokeniserPool, refs: list[tuple[int, Any]]) -> Any:
    """A part's tokens from its chunks' refs, each chunk's first request checked against the
    driver's own tokenising; None if the pool failed (the part is then tokenised here)."""
    results = pool.gather([ref for _, ref in refs])
    if results is None:
        return None
    for (start, _), result in zip(refs, results, strict=True):
        own = tokens.first(tokens.function(tokens.encoder, *tokens.args(start, start + 1)))
        if tokens.first(result) != own:
            pool.fail(f"request {start} was tokenised differently by an actor")
            return None
    return tokens.join(results, [ref for _, ref in refs])


@dataclass
class Ragged:
    """Sequences of token ids as one flat array and their offsets: what an actor sends back
    (it pickles as two buffers, not as an object per id, so the driver unpickles it in
    microseconds); the driver turns a sequence into its shared ids as it reads it."""

    flat: numpy.ndarray
    offsets: array[int]

    @classmethod
    def of(cls, sequences: Iterable[Sequence[int]]) -> Ragged:
        flat, offsets = array("q"), array("q", [0])
        for sequence in sequences:
            flat.extend(sequence)
            offsets.append(len(flat))
        return cls(numpy.frombuffer(flat, dtype=numpy.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, index: int, shared: Callable[[numpy.ndarray], tuple[int, ...]]) -> Any:
        """Sequence ``index`` (a numpy array) through ``shared`` (the driver's interner;
        :func:`ids` to compare)."""
        return shared(self.flat[self.offsets[index] : self.offsets[index + 1]])

    def all(self, shared: Callable[[numpy.ndarray], tuple[int, ...]]) -> list[Any]:
        """Every sequence, as :meth:`get` makes it (in one read where ``shared`` has ``many``,
        as the driver's interner does: for short sequences, whose own reads would cost more
        than they hold)."""
        many = getattr(shared, "many", None)
        if many is not None:
            return many(self.flat, self.offsets)  # type: ignore[no-any-return]
        return [self.get(i, shared) for i in range(len(self))]

    def int32_arrays(self) -> list[array[int]] | None:
        """Every sequence as an ``array('i')``: one buffer each and no int object per id (what
        a rank is sent: it pickles as its bytes), or None if an id is negative or does not fit
        31 bits (no tokenizer's is)."""
        flat = self.flat
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= 2**31):
            return None
        data = flat.astype(numpy.int32).data.cast("B")
        sequences = []
        for start, stop in pairwise(self.offsets):
            sequence = array("i")
            sequence.frombytes(data[4 * start : 4 * stop])
            sequences.append(sequence)
        return sequences


def ids(tokens: numpy.ndarray) -> tuple[int, ...]:
    """Token ids as a plain tuple (to compare what an actor sent with the driver's own)."""
    return tuple(tokens.tolist())


def chunk_size(start: int, stop: int, n: int) -> int:
    """Requests per chunk to cut ``start:stop`` into ``n`` chunks."""
    return max(1, math.ceil((stop - start) / max(1, n)))


def even_chunks(start: int, stop: int, n: int) -> Iterator[tuple[int, int]]:
    """``start:stop`` in ``n`` runs of (nearly) equal length (as
    :func:`~rayeval.service.engine.parts.pipeline.even_bounds` cuts parts)."""
    size = chunk_size(start, stop, n)
    return ((start + a, start + b) for a, b in even_bounds(stop - start, size, first=size))
