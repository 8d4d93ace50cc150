"""Generation in parts (:mod:`rayeval.service.engine.parts.pipeline`): what a part is, how it is
planned, and lm-eval's generate_until requests tokenised and decoded around it.

A request type of more than :data:`~rayeval.service.engine.parts.pipeline.GENERATE_PART` requests is
cut into parts of that many, in the order lm-eval hands them to the LM; each part is tokenised
(:func:`rayeval.service.engine.plan.encoder.generate_request`, one prompt at a time as before; by
tokeniser actors where the cluster has free CPUs, :mod:`rayeval.service.engine.plan.tokenisers`, the
first part on the planning thread) and planned by the same rules as a whole request type
(:mod:`rayeval.service.engine.plan.generation_planner`: grouped by settings, sorted longest first,
cut by the budget alone), so a request's group depends only on its part and the budget, never
on R, G or timing. A request type of at most one part is planned whole, as before.

Why this stays exact: a part changes only which requests share a group or micro-batch, as a smaller
budget or fewer slots do, never a request's own tokens, settings or seed. Continuous batching gives
each row lm-eval's answer whichever rows share its steps (rows stop on their own; greedy answers are
held to lm-eval's per sample at any slot count and group make-up, tests/test_continuous.py), so a
part changes no greedy answer. Static micro-batches are lm-eval's own ``generate`` calls over the
rows the budget puts together: a part moves rows between them exactly as a budget does (where
lm-eval's answer itself depends on its batch, an explicit ``max_length`` counted from the padded
width, neither reproduces lm-eval's batches, parts or not). Sampled requests draw from their own
generators, seeded from the evaluation's seed, the request's tokens and settings and how many
identical requests came before it (:class:`~rayeval.service.engine.plan.generation_planner.Seeder`),
never from the part: the planning thread makes the parts one after the other, in lm-eval's order,
with one ``Seeder``, so that count runs across parts and every request gets the seed the whole
request type would give it. Which batching a request type uses is decided once, from every request's
settings, before the first part. A request too large for the KV-cache budget is refused before the
first part too (:meth:`Prompts.refuse_unfit`), as a request type planned whole refuses it.
"""

from __future__ import annotations

import json
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

from lm_eval.models.utils import normalize_gen_kwargs

from rayeval.service.engine.parts.pipeline import PlannedPart
from rayeval.service.engine.plan.encoder import (
    decode_generation,
    generate_requests,
    generation_settings,
    shared_ids,
)
from rayeval.service.engine.plan.generation_planner import (
    GenerateRequest,
    Seeder,
    SlotBudget,
    check_fits,
    plan_generate,
    plan_generate_groups,
)
from rayeval.service.engine.plan.planner import TokenBudget
from rayeval.service.engine.plan.tokenisers import (
    PLAN_GROUP,
    PartTokens,
    Ragged,
    TokeniserPool,
    even_chunks,
    ids,
)
from rayeval.service.engine.response_cache import ResponseCache, generate_key

#: Tokens a tokenizer may add to a context beside one per UTF-8 byte (BOS, a leading space).
ADDED_TOKENS = 8


@dataclass
class GeneratePart:
    """One part's requests, tokenised.

    Attributes:
        start: Index of its first request in the whole request type.
        requests: The tokenised requests, in lm-eval's order.
        names: Per request, how an error names it (task and document).
    """

    start: int
    requests: list[GenerateRequest]
    names: Sequence[str]


class RequestNames(Sequence[str]):
    """How an error names each request (``task T doc D``), made only when one is read: an
    evaluation whose requests all fit reads none (a name each cost the driver ~1 µs a request).

    Args:
        instances: lm-eval's ``Instance``s, in order.
    """

    def __init__(self, instances: Sequence[Any]) -> None:
        self._instances = instances

    def __len__(self) -> int:
        return len(self._instances)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> RequestNames: ...

    def __getitem__(self, index: int | slice) -> str | RequestNames:
        if isinstance(index, slice):
            return RequestNames(self._instances[index])
        instance = self._instances[index]
        return f"task {instance.task_name} doc {instance.doc_id}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


class Prompts:
    """lm-eval's generate_until ``Instance``s: tokenised part by part, and their answers decoded.

    Args:
        encoder: lm-eval's HF backend over the meta model (its tokenizer and rules).
        instances: The request type's requests, in lm-eval's order.
    """

    def __init__(self, encoder: Any, instances: Sequence[Any]) -> None:
        self._encoder = encoder
        self._instances = instances
        self._eos = encoder.tok_decode(encoder.eot_token_id, skip_special_tokens=False)
        #: Per request, its stop strings (one tuple shared by equal ones), once tokenised.
        self._untils: list[tuple[str, ...] | None] = [None] * len(instances)
        self._shared: dict[tuple[str, ...], tuple[str, ...]] = {}

    def make(
        self, start: int, stop: int, requests: list[GenerateRequest] | None = None
    ) -> GeneratePart:
        """Requests ``start:stop``, tokenised as lm-eval's HF ``generate_until`` does
        (``requests``: already, by tokeniser actors)."""
        instances = self._instances[start:stop]
        if requests is None:
            requests = generate_requests(self._encoder, [r.args for r in instances], self._eos)
        for index, request in enumerate(requests, start):
            self._untils[index] = self._shared.setdefault(request.until, request.until)
        return GeneratePart(start=start, requests=requests, names=RequestNames(instances))

    def tokens(self) -> PartTokens:
        """How the parts are tokenised on tokeniser actors and made
        (:func:`rayeval.service.engine.plan.tokenisers.made_parts`)."""
        shared = shared_ids(self._encoder)
        return PartTokens(
            function=packed_prompts,
            args=lambda start, stop: ([r.args for r in self._instances[start:stop]], self._eos),
            chunks=even_chunks,
            join=lambda results, _: [r for packed in results for r in packed.requests(shared)],
            first=lambda packed: packed.request(0, ids),
            make=self.make,
            encoder=self._encoder,
            refuse_early=self.refuse_unfit,
        )

    def refuse_unfit(self, budget: SlotBudget) -> None:
        """Refuse, before any part runs, a request whose context and ``max_gen_toks`` do not fit
        ``budget``'s KV cache (planning its part would, after the parts before it ran). Only
        requests that might not fit are tokenised here: a context has at most one token per
        UTF-8 byte, plus the few a tokenizer adds (:data:`ADDED_TOKENS`), and at most the
        model's max length less ``max_gen_toks`` (lm-eval's truncation). A request of a
        tokenizer that breaks this bound is still refused, when its part is planned.

        Raises:
            ConfigError: as :func:`~rayeval.service.engine.plan.generation_planner.check_fits`.
        """
        max_length = self._encoder.max_length
        if budget.kv_tokens is None or budget.kv_tokens >= max_length:
            return  # lm-eval's truncation keeps every request within max_length
        default, previous, max_gen_toks = self._encoder.max_gen_toks, None, 0
        for instance in self._instances:
            context, gen_kwargs = instance.args
            if gen_kwargs is not previous:
                previous = gen_kwargs
                max_gen_toks = normalize_gen_kwargs(gen_kwargs, default)["max_gen_toks"]
            bound = min(len(context.encode()) + ADDED_TOKENS, max_length - max_gen_toks)
            if bound + max_gen_toks > budget.kv_tokens:
                [request] = generate_requests(self._encoder, [instance.args], self._eos)
                check_fits([request], budget, RequestNames([instance]))

    def settings(self) -> list[tuple[int | None, dict[str, Any]]]:
        """Each distinct (max_length, generation kwargs) of the requests, without tokenising
        (equal gen_kwargs in a row, as one task's are, are read once)."""
        distinct: dict[str, tuple[int | None, dict[str, Any]]] = {}
        previous: Any = None
        for instance in self._instances:
            gen_kwargs = instance.args[1]
            if gen_kwargs is previous or gen_kwargs == previous:
                continue
            previous = gen_kwargs
            max_length, kwargs = generation_settings(self._encoder, gen_kwargs)
            key = json.dumps([max_length, kwargs], sort_keys=True, default=str)
            distinct.setdefault(key, (max_length, kwargs))
        return list(distinct.values())

    def decode(self, generated: list[Any], texts: list[str | None] | None = None) -> list[str]:
        """lm-eval's answer text of each request's generated token ids (all made first), where
        ``texts`` (decoded already, by tokeniser actors) has none; each request's ids are dropped
        from ``generated`` once decoded, so a million answers are not held twice."""
        texts = texts or [None] * len(generated)
        for index, tokens in enumerate(generated):
            if texts[index] is None:
                assert tokens is not None
                texts[index] = self.decode_one(index, tokens)
            generated[index] = None
        return texts  # type: ignore[return-value]

    def decode_one(self, index: int, tokens: Sequence[int]) -> str:
        """Request ``index``'s answer text."""
        return decode_generation(self._encoder, tokens, self.until(index))

    def until(self, index: int) -> tuple[str, ...]:
        """Request ``index``'s stop strings (its part made)."""
        return self._untils[index] or ()

    def __len__(self) -> int:
        return len(self._instances)

    def decoding(self, pool: TokeniserPool) -> PartDecoding:
        """Answers decoded on ``pool``'s actors part by part (:class:`PartDecoding`)."""
        return PartDecoding(self, pool)


@dataclass
class PackedPrompts:
    """Tokenised prompts as a tokeniser actor sends them: the contexts' ids in one
    :class:`~rayeval.service.engine.plan.tokenisers.Ragged`, each distinct setting once."""

    contexts: Ragged
    settings: list[tuple[int, tuple[str, ...], int | None, dict[str, Any]]]
    which: array[int]

    def __len__(self) -> int:
        return len(self.which)

    def request(self, index: int, shared: Callable[[Any], Any]) -> GenerateRequest:
        """Request ``index``, its context through ``shared``; requests of one setting share its
        kwargs (nothing changes a request's; the planner knows them apart by identity)."""
        max_gen_toks, until, max_length, kwargs = self.settings[self.which[index]]
        context = self.contexts.get(index, shared)
        return GenerateRequest(context, max_gen_toks, until, max_length, kwargs)

    def requests(self, shared: Callable[[Any], Any]) -> list[GenerateRequest]:
        """Every request, its context an ``array('i')`` (through ``shared`` where an id is
        outside 0..2**31-1): the driver only measures, sorts, keys and forwards a context, so it
        never makes its ids into int objects, and the context pickles to a rank as its bytes."""
        contexts = self.contexts.int32_arrays()
        if contexts is None:
            return [self.request(i, shared) for i in range(len(self))]
        settings = self.settings
        return [
            GenerateRequest(context, *settings[which])
            for context, which in zip(contexts, self.which, strict=True)
        ]


def packed_prompts(
    encoder: Any, args: Sequence[tuple[str, dict[str, Any]]], eos: str
) -> PackedPrompts:
    """:func:`rayeval.service.engine.plan.encoder.generate_requests`, packed (what a tokeniser actor
    runs)."""
    requests = generate_requests(encoder, args, eos)
    index: dict[str, int] = {}
    settings: list[tuple[int, tuple[str, ...], int | None, dict[str, Any]]] = []
    which = array("i")
    for request in requests:
        key = request.config_key()
        if key not in index:
            index[key] = len(settings)
            r = request
            settings.append((r.max_gen_toks, r.until, r.max_length, r.kwargs))
        which.append(index[key])
    return PackedPrompts(Ragged.of(r.context for r in requests), settings, which)


def decoded_texts(
    encoder: Any, generated: Sequence[Sequence[int]], untils: Sequence[tuple[str, ...]]
) -> list[str]:
    """lm-eval's answer texts of generated token ids (what a tokeniser actor runs)."""
    pairs = zip(generated, untils, strict=True)
    return [decode_generation(encoder, tokens, until) for tokens, until in pairs]


class PartDecoding:
    """Answers decoded on tokeniser actors while the replicas generate the parts after theirs:
    a finished part's answers go to the next actor (in its :data:`PLAN_GROUP` thread, not behind
    the chunks queued for tokenising), and the texts of the parts decoded so far are read each
    time a part finishes, each part's first checked against the driver's own decoding. Whatever
    the pool cannot decode (it failed, disagreed or never started) the driver decodes.

    Args:
        prompts: The requests' :class:`Prompts`.
        pool: The tokeniser actors (their encoder is the driver's).
    """

    def __init__(self, prompts: Prompts, pool: TokeniserPool) -> None:
        self._prompts, self._pool = prompts, pool
        self._refs: deque[tuple[list[int], Any]] = deque()
        self._texts: list[str | None] = [None] * len(prompts)
        #: Requests whose texts came from the actors.
        self.decoded = 0

    def finished(self, indices: list[int], answers: list[Any]) -> None:
        """Requests ``indices`` have all their ``answers`` (every request's so far): decode them
        on an actor, and read the texts decoded by now (their ids in ``answers`` are replaced by
        ``()``, still an answer, so a million answers are not held twice)."""
        if self._pool.working and indices:
            generated = [answers[i] for i in indices]
            untils = [self._prompts.until(i) for i in indices]
            ref = self._pool.submit(decoded_texts, generated, untils, group=PLAN_GROUP)
            self._refs.append((indices, ref))
        self._read(answers, ready_only=True)

    def texts(self, answers: list[Any]) -> list[str]:
        """Every request's text (``answers``: every request's generated ids, dropped here)."""
        self._read(answers, ready_only=False)
        return self._prompts.decode(answers, self._texts)

    def _read(self, answers: list[Any], ready_only: bool) -> None:
        """The decoded parts' texts, in order (``ready_only``: those decoded already)."""
        import ray

        while self._refs and self._pool.working:
            indices, ref = self._refs[0]
            if ready_only and not ray.wait([ref], timeout=0)[0]:
                return
            self._refs.popleft()
            result = self._pool.gather([ref])
            if result is None:
                return
            if result[0][0] != self._prompts.decode_one(indices[0], answers[indices[0]]):
                self._pool.fail(f"request {indices[0]}'s answer was decoded differently")
                return
            for index, text in zip(indices, result[0], strict=True):
                self._texts[index], answers[index] = text, ()
            self.decoded += len(indices)


def plan_generate_part(
    part: GeneratePart,
    cache: ResponseCache | None,
    budget: TokenBudget,
    slots: SlotBudget | None,
    seeder: Seeder,
) -> PlannedPart:
    """Look a part's requests up in the response cache and plan the rest: continuous-batching
    groups with ``slots`` (their sampling seeds from ``seeder``, which has seen every part
    before), static micro-batches without (as
    :meth:`rayeval.service.engine.dispatch.executor.Executor.generate` plans a whole request
    type)."""
    requests = part.requests
    keys: list[Any] = [None] * len(requests)
    found: dict[int, Any] = {}
    if cache is not None:  # sampled requests have no key: never cached
        keys = [cache.digest(generate_key(r.context, r.settings())) for r in requests]
        found = cache.get_many(keys)
    todo = [i for i in range(len(requests)) if i not in found]
    pending = [requests[i] for i in todo]
    given = {part.start + i: answer for i, answer in found.items()}
    computed = [part.start + i for i in todo]
    if slots is None:
        plan = plan_generate(pending, budget)
        store = None
        if cache is not None:
            located = zip(todo, plan.locations, strict=True)
            store = cache.storer([(keys[i], mb, (position,)) for i, (mb, position) in located])
        return PlannedPart(plan.micro_batches, computed, plan.locations, given, len(found), store)
    names = part.names if len(todo) == len(requests) else [part.names[i] for i in todo]
    groups = plan_generate_groups(pending, slots, seeder.seeds(pending), names)
    store_piece = None
    if cache is not None:
        located = zip(todo, groups.locations, strict=True)
        store_piece = cache.piece_storer([(keys[i], g, position) for i, (g, position) in located])
    return PlannedPart(
        groups.groups, computed, groups.locations, given, len(found), store_piece=store_piece
    )
