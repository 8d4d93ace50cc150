"""Loglikelihood in parts (:mod:`rayeval.service.engine.parts.pipeline`): what a part is and how it
is planned.

A part is :data:`~rayeval.service.engine.parts.pipeline.SCORE_PART` requests in lm-eval's order, cut
only where the context string changes (a question's choices stay together, as lm-eval's checks
and shared-prefix packing need), tokenised as lm-eval does (by tokeniser actors where the cluster
has free CPUs, :mod:`rayeval.service.engine.plan.tokenisers`), checked, and planned exactly as
:func:`rayeval.service.engine.plan.planner.plan_score` plans any request set.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from rayeval.actors.batches import PickledScoreBatch
from rayeval.service.engine.parts.pipeline import PlannedPart, part_bounds
from rayeval.service.engine.plan.checks import Inspection
from rayeval.service.engine.plan.encoder import EncodedPairs, encode_pairs, shared_ids
from rayeval.service.engine.plan.planner import TokenBudget, Where, plan_score
from rayeval.service.engine.plan.tokenisers import (
    PLAN_GROUP,
    PartTokens,
    Ragged,
    TokeniserPool,
    chunk_size,
    ids,
)
from rayeval.service.engine.response_cache import ResponseCache, score_key


@dataclass
class ScorePart:
    """One part's requests, tokenised and checked (made by the LM, planned here).

    Attributes:
        start: Index of its first request in the whole request type.
        pairs: The (context, continuation) tokens of the requests to compute.
        todo: Their indices in the whole request type.
        fixed: Answers given without a model call, by index in the whole request type.
        sources: Refs to the tokeniser actors' packed pairs of the whole part, in order (empty:
            tokenised on the driver): an actor plans the part from them.
    """

    start: int
    pairs: list[tuple[Sequence[int], Sequence[int]]]
    todo: list[int]
    fixed: dict[int, tuple[float, bool]]
    sources: tuple[Any, ...] = ()


def make_part(
    encoder: Any,
    pairs: Sequence[tuple[str, str]],
    origins: Sequence[tuple[str, Any]],
    inspect: Callable[[list[Any], Sequence[tuple[str, Any]], list[bool]], Inspection],
    start: int,
    stop: int,
    encoded: EncodedPairs | None = None,
) -> ScorePart:
    """Requests ``start:stop`` of lm-eval's loglikelihood ``pairs``, tokenised as lm-eval does
    (:func:`rayeval.service.engine.plan.encoder.encode_pairs`; ``encoded``: already, by tokeniser
    actors) and checked by ``inspect``."""
    strings = pairs[start:stop]
    if encoded is None:
        encoded = encode_pairs(encoder, strings)
    inspection = inspect(encoded.requests(strings), origins[start:stop], encoded.merged)
    todo = [i for i in range(len(strings)) if i not in inspection.answers]
    return ScorePart(
        start=start,
        pairs=[encoded.pairs[i] for i in todo],
        todo=[start + i for i in todo],
        fixed={start + i: answer for i, answer in inspection.answers.items()},
        sources=encoded.sources,
    )


def score_tokens(
    encoder: Any,
    pairs: Sequence[tuple[str, str]],
    origins: Sequence[tuple[str, Any]],
    inspect: Callable[[list[Any], Sequence[tuple[str, Any]], list[bool]], Inspection],
) -> PartTokens:
    """How loglikelihood parts are tokenised on tokeniser actors and made
    (:func:`rayeval.service.engine.plan.tokenisers.made_parts`): a part is cut into chunks where the
    context string changes, as parts are, so one context is encoded once and shared."""
    shared = shared_ids(encoder)

    def chunks(start: int, stop: int, n: int) -> Iterator[tuple[int, int]]:
        contexts = [context for context, _ in pairs[start:stop]]
        size = chunk_size(start, stop, n)
        return ((start + a, start + b) for a, b in part_bounds(contexts, size, first=size))

    def join(results: list[PackedPairs], refs: list[Any]) -> EncodedPairs:
        pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        merged: list[bool] = []
        for packed in results:
            encoded = packed.unpack(shared)
            pairs += encoded.pairs
            merged += encoded.merged
        return EncodedPairs(pairs, merged, tuple(refs))

    return PartTokens(
        function=packed_pairs,
        args=lambda start, stop: (pairs[start:stop],),
        chunks=chunks,
        join=join,
        first=lambda packed: packed.unpack(ids, 1),
        make=partial(make_part, encoder, pairs, origins, inspect),
        encoder=encoder,
    )


@dataclass
class PackedPairs:
    """Tokenised pairs as a tokeniser actor sends them: each distinct context's ids once.

    Attributes:
        contexts: The distinct contexts, in first use.
        context_of: Per pair, its context's index.
        continuations: Per pair, its continuation.
        merged: Per pair, :class:`~rayeval.service.engine.plan.encoder.EncodedPairs`' ``merged``.
    """

    contexts: Ragged
    context_of: array[int]
    continuations: Ragged
    merged: bytes

    def unpack(self, shared: Callable[[Any], Any], count: int | None = None) -> Any:
        """The first ``count`` pairs (all: None) as :class:`EncodedPairs`, their ids through
        ``shared`` (a context shared by its pairs)."""
        count = len(self.context_of) if count is None else count
        used = max(self.context_of[:count], default=-1) + 1
        contexts = [self.contexts.get(i, shared) for i in range(used)]
        if count == len(self.context_of):  # every pair: the (short) continuations in one read
            continuations = self.continuations.all(shared)
        else:
            continuations = [self.continuations.get(i, shared) for i in range(count)]
        pairs = [(contexts[self.context_of[i]], continuations[i]) for i in range(count)]
        return EncodedPairs(pairs, [bool(m) for m in self.merged[:count]])


def packed_pairs(encoder: Any, strings: Sequence[tuple[str, str]]) -> PackedPairs:
    """:func:`rayeval.service.engine.plan.encoder.encode_pairs`, packed (what a tokeniser actor
    runs)."""
    encoded = encode_pairs(encoder, strings)
    index: dict[int, int] = {}
    contexts: list[tuple[int, ...]] = []
    context_of = array("i")
    for context, _ in encoded.pairs:
        at = index.get(id(context))
        if at is None:
            at = index[id(context)] = len(contexts)
            contexts.append(context)
        context_of.append(at)
    continuations = Ragged.of(continuation for _, continuation in encoded.pairs)
    return PackedPairs(Ragged.of(contexts), context_of, continuations, bytes(encoded.merged))


def plan_part(
    part: ScorePart,
    cache: ResponseCache | None,
    budget: TokenBudget,
    share_prefixes: bool,
    max_length: int,
    pool: TokeniserPool | None = None,
) -> PlannedPart | Callable[[], PlannedPart]:
    """Look a part's requests up in the response cache and plan the rest (as
    :meth:`rayeval.service.engine.dispatch.executor.Executor.score` does for a whole request type).

    A part whose tokens came from ``pool``'s actors is planned on one of them
    (:func:`planned_pairs`: the same function on the same tokens, so the same plan), while the
    driver makes the next part: then what is returned is a call that waits for that plan (or,
    if the actor fails, plans here)."""
    todo: Sequence[int] = range(len(part.pairs))
    keys: list[Any] = []
    found: dict[int, Any] = {}
    if cache is not None:
        keys = [cache.digest(score_key(c, k, max_length)) for c, k in part.pairs]
        found = cache.get_many(keys)
        todo = [i for i in range(len(keys)) if i not in found]

    def planned(micro_batches: Sequence[Any], where: Where) -> PlannedPart:
        store = None
        if cache is not None:
            placed = zip(todo, where, strict=True)
            store = cache.storer([(keys[i], mb, (row, target)) for i, (mb, row, target) in placed])
        return PlannedPart(
            micro_batches=micro_batches,
            computed=[part.todo[i] for i in todo],
            places=where,
            given=part.fixed | {part.todo[i]: answer for i, answer in found.items()},
            cached=len(found),
            store=store,
        )

    def here() -> PlannedPart:
        plan = plan_score([part.pairs[i] for i in todo], max_length, budget, share_prefixes)
        return planned(plan.micro_batches, plan.where)

    if pool is None or not pool.working or not part.sources:
        return here()
    chosen = array("q", (part.todo[i] - part.start for i in todo))
    args = (chosen, max_length, budget, share_prefixes)
    ref = pool.submit(planned_pairs, *args, refs=part.sources, group=PLAN_GROUP)

    def there() -> PlannedPart:
        got = pool.gather([ref])
        if got is not None and len(got[0][1]) == len(chosen):
            batches, where = got[0]
            pool.planned += len(chosen)
            return planned([PickledScoreBatch(*batch) for batch in batches], where)
        if got is not None:
            pool.fail(f"an actor planned {len(got[0][1])} of a part's {len(chosen)} requests")
        return here()

    return there


def planned_pairs(
    encoder: Any,
    chosen: Sequence[int],
    max_length: int,
    budget: TokenBudget,
    share_prefixes: bool,
    *sources: PackedPairs,
) -> tuple[list[tuple[bytes, tuple[int, ...]]], Where]:
    """What a tokeniser actor runs to plan a part: :func:`plan_score` of the ``chosen`` pairs
    (indices in the part) of the part's packed chunks, each micro-batch pickled with its rows'
    target counts (:class:`rayeval.actors.batches.PickledScoreBatch`, made on the driver: one
    made here would arrive unpickled)."""
    pairs = [pair for packed in sources for pair in packed.unpack(ids).pairs]
    plan = plan_score([pairs[i] for i in chosen], max_length, budget, share_prefixes)
    batches = [PickledScoreBatch.of(batch) for batch in plan.micro_batches]
    return [(batch.data, batch.targets) for batch in batches], plan.where
