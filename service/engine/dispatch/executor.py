"""Computing one evaluation's requests: the response cache, the plan, the replicas, the figures.

:class:`Executor` takes tokenised requests of one type from :class:`rayeval.service.engine.lm.
RayEvalLM`, answers what the response cache holds, plans the rest into layout-independent
micro-batches (:mod:`rayeval.service.engine.plan.planner`), runs them on the worker group's replicas
(:mod:`rayeval.service.engine.dispatch.dispatcher`), stores each finished micro-batch's answers,
checks that every micro-batch came back exactly once, and keeps the request type's figures
(:mod:`rayeval.service.engine.dispatch.phases`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

from rayeval.actors.batches import GenerateGroup, GenerateMicroBatch, MicroBatch, ScoreMicroBatch
from rayeval.actors.errors import ConfigError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind, Timeouts
from rayeval.service.engine.dispatch.dispatcher import (
    Dispatcher,
    PieceDone,
    StepDone,
    check_exactly_once,
)
from rayeval.service.engine.dispatch.phases import PhaseStats, PhaseTracker, StartUp
from rayeval.service.engine.parts.generate import PartDecoding, plan_generate_part
from rayeval.service.engine.parts.pipeline import PlannedPart, Planner, run_parts
from rayeval.service.engine.parts.score import plan_part
from rayeval.service.engine.plan.budgets import budget, slot_budget
from rayeval.service.engine.plan.generation_planner import (
    GenerateRequest,
    Seeder,
    SlotBudget,
    plan_generate,
    plan_generate_groups,
)
from rayeval.service.engine.plan.planner import plan_score
from rayeval.service.engine.plan.tokenisers import PartTokens, TokeniserPool, made_parts
from rayeval.service.engine.response_cache import ResponseCache, generate_key, score_key
from rayeval.service.vocabulary.config import EngineConfig
from rayeval.service.vocabulary.events import Progress, RankMemory, RequestType

logger = logging.getLogger(__name__)


class Executor:
    """Plans, caches and runs the requests of one evaluation on its worker group.

    Args:
        config: The evaluation's engine configuration (batching limits).
        device: What the ranks hold (CPU ranks score with a smaller token budget).
        timeouts: Every wait on the ranks.
        cache: The response cache, or None.
        share_prefixes: Pack score inputs that share a prefix into token-tree rows.
        seed: The ranks' torch seed for this evaluation.
        on_progress: Called with a request type's progress after every finished step.
        created: When the engine started (``time.monotonic()``), for its start-up figure.
        shell: The model on the meta device (its generation config decides what continuous
            batching can reproduce).
        static_only: Why generation cannot use continuous batching at all (None: it may).
    """

    def __init__(
        self,
        config: EngineConfig,
        device: DeviceKind,
        timeouts: Timeouts,
        cache: ResponseCache | None,
        share_prefixes: bool,
        seed: int,
        on_progress: Callable[[Progress], None] | None,
        created: float,
        shell: Any = None,
        static_only: str | None = "no model shell given",
    ) -> None:
        self.stats: dict[RequestType, PhaseStats] = {}
        self._config = config
        self._device = device
        self._shell = shell
        self._static_only = static_only
        self._score_budget = budget(config, score_on=device)
        self._generate_budget = budget(config)
        self._timeouts = timeouts
        self._cache = cache
        self._share_prefixes = share_prefixes
        self._seed = seed
        self._on_progress = on_progress
        self._created = created
        self._startup_s: float | None = None
        self._rank_memory: dict[str, list[RankMemory]] = {}
        self._group: WorkerGroup | None = None
        self._begun = self._reused = False
        self._swap_load_s: float | None = None
        #: Starts the ranks when the first answer must be computed (None: started, or closed).
        self._on_demand: Callable[[], None] | None = None

    def attach(self, group: WorkerGroup | None, reused: bool = False) -> None:
        """Compute on ``group`` (None: closed). ``reused``: kept ranks, already seeded for this
        evaluation, that loaded nothing for it."""
        self._group = group
        self._begun = self._reused = reused
        if group is None:
            self._on_demand = None

    def start_on_demand(self, start: Callable[[], None] | None) -> None:
        """No ranks yet: ``start()`` (which attaches them) runs when an answer must first be
        computed (:meth:`start_now`), and never if the response cache answers everything."""
        self._on_demand = start

    def start_now(self) -> None:
        """Start the ranks that start on demand, if they have not started."""
        if self._group is None and self._on_demand is not None:
            start, self._on_demand = self._on_demand, None
            start()  # attaches the group

    def begin_checkpoint(self, started: float, load_s: float) -> None:
        """The ranks swapped in another checkpoint (at ``started``, reading for ``load_s``): the
        figures start afresh and report that swap as the start-up."""
        self.stats = {}
        self._created = started
        self._startup_s = None
        self._swap_load_s = load_s

    def score(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        max_length: int,
        phase: RequestType,
        disable_tqdm: bool,
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each (context, continuation) token pair, in order."""
        cache = self._cache
        keys: list[Any] = []
        todo: Sequence[int] = range(len(pairs))
        cached: dict[int, Any] = {}
        if cache is not None:  # hashed at once: a million token-list keys would not fit
            keys = [cache.digest(score_key(c, k, max_length)) for c, k in pairs]
            cached, todo = self._cached(keys, phase)
        plan = plan_score(
            [pairs[i] for i in todo] if cached else pairs,
            max_length,
            self._score_budget,
            self._share_prefixes,
        )
        where = plan.where
        store = None
        if cache is not None:
            store = cache.storer(
                [
                    (keys[i], micro_batch, (row, target))
                    for i, (micro_batch, row, target) in zip(todo, where, strict=True)
                ]
            )
        results = self._run(
            plan.micro_batches,
            phase,
            Counter(micro_batch for micro_batch, _, _ in where),
            disable_tqdm,
            on_result=store,
            cached=len(cached),
        )
        scored = (results[micro_batch][row][target] for micro_batch, row, target in where)
        if not cached:
            return list(scored)
        answers = dict(cached)
        answers.update(zip(todo, scored, strict=True))
        return [answers[i] for i in range(len(pairs))]

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        disable_tqdm: bool,
        names: Sequence[str] | None = None,
    ) -> list[list[int]]:
        """The generated token ids of each request, in order (``names``: per request, how an
        error names it)."""
        keys: list[Any] = [None] * len(requests)
        if self._cache is not None:  # hashed at once, as scores' keys
            keys = [self._cache.digest(generate_key(r.context, r.settings())) for r in requests]
        cached, todo = self._cached(keys, RequestType.GENERATE_UNTIL)
        pending = [requests[i] for i in todo]
        pending_keys = [keys[i] for i in todo]
        reason = self._batching([(r.max_length, r.kwargs) for r in pending])
        if reason is None:
            pending_names = [names[i] for i in todo] if names else None
            outputs = self._generate_continuous(
                pending, pending_keys, pending_names, disable_tqdm, len(cached)
            )
        else:
            outputs = self._generate_static(pending, pending_keys, disable_tqdm, len(cached))
        generated = dict(cached) | dict(zip(todo, outputs, strict=True))
        return [list(generated[i]) for i in range(len(requests))]

    def _batching(self, settings: Sequence[tuple[int | None, dict[str, Any]]]) -> str | None:
        """Why requests with these (max_length, kwargs) take static batches (None: continuous
        batching), recorded in the phase's figures and logged."""
        reason = self._static_reason(settings)
        phase = self.stats.setdefault(RequestType.GENERATE_UNTIL, PhaseStats())
        phase.batching = "continuous" if reason is None else "static"
        if reason is not None and settings:
            logger.info("generate_until runs in static batches: %s", reason)
        return reason

    def _static_reason(self, settings: Sequence[tuple[int | None, dict[str, Any]]]) -> str | None:
        """Why requests with these (max_length, kwargs) cannot use continuous batching (None:
        they can)."""
        if self._static_only is not None or not settings:
            return self._static_only
        if any(max_length is not None for max_length, _ in settings):
            return "a request sets max_length (lm-eval counts it from a batch's padded width)"
        from rayeval.actors.compute.continuous import unsupported

        for kwargs in {json.dumps(kwargs, sort_keys=True, default=str) for _, kwargs in settings}:
            reason = unsupported(self._shell, json.loads(kwargs))
            if reason is not None:
                return reason
        return None

    def _generate_static(
        self,
        requests: Sequence[GenerateRequest],
        keys: Sequence[Any],
        disable_tqdm: bool,
        cached: int = 0,
    ) -> list[list[int]]:
        """lm-eval's static batches: a micro-batch decodes until its longest row is done."""
        plan = plan_generate(requests, self._generate_budget)
        located = [(keys[i], mb, (position,)) for i, (mb, position) in enumerate(plan.locations)]
        outputs = self._run(
            plan.micro_batches,
            RequestType.GENERATE_UNTIL,
            Counter(mb for mb, _ in plan.locations),
            disable_tqdm,
            on_result=self._cache.storer(located) if self._cache is not None else None,
            cached=cached,
        )
        return [list(outputs[mb][position]) for mb, position in plan.locations]

    def _generate_continuous(
        self,
        requests: Sequence[GenerateRequest],
        keys: Sequence[Any],
        names: Sequence[str] | None,
        disable_tqdm: bool,
        cached: int = 0,
    ) -> list[list[int]]:
        """Continuous batching: groups streamed back request by request."""
        if not requests:  # the response cache answered them all: no rank starts
            return self._run([], RequestType.GENERATE_UNTIL, Counter(), disable_tqdm, cached=cached)
        start = self._start_up()
        seeds = Seeder(self._seed).seeds(requests)
        plan = plan_generate_groups(requests, self._slot_budget(), seeds, names)
        store_piece = None
        if self._cache is not None:
            located = zip(keys, plan.locations, strict=True)
            store_piece = self._cache.piece_storer([(k, g, p) for k, (g, p) in located])

        def store(piece: PieceDone) -> None:
            if store_piece is not None and piece.micro_batch is not None:
                store_piece(piece.micro_batch, piece.finished)

        outputs = self._run(
            plan.groups,
            RequestType.GENERATE_UNTIL,
            Counter(group for group, _ in plan.locations),
            disable_tqdm,
            on_piece=store,
            start=start,
            cached=cached,
        )
        return [list(outputs[group][position]) for group, position in plan.locations]

    def _slot_budget(self) -> SlotBudget:
        return slot_budget(self._config, self._group)

    def _cached(self, keys: Sequence[Any], phase: RequestType) -> tuple[dict[int, Any], list[int]]:
        """Answers the response cache has (position -> answer), and the positions to compute."""
        cached = self._cache.get_many(keys) if self._cache is not None else {}
        if cached:
            self.stats.setdefault(phase, PhaseStats()).cached += len(cached)
            logger.info(
                "%s: %d of %d requests answered from the cache", phase, len(cached), len(keys)
            )
        return cached, [i for i in range(len(keys)) if i not in cached]

    def _start_up(self) -> StartUp:
        """Wait for the ranks (started now if they start on demand) and seed them for this
        evaluation, once; the start-up figures."""
        self.start_now()
        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: create a new one to evaluate again")
        load_reports = self._group.wait_ready()
        if not self._begun:  # seeded after loading, as kept replicas are: same samples
            self._group.begin_evaluation(self._seed, timeout_s=self._timeouts.step_s)
            self._begun = True
        if self._startup_s is None:
            self._startup_s = time.monotonic() - self._created
        # Kept replicas loaded nothing for this evaluation.
        load_s = 0.0 if self._reused else max((r.seconds for r in load_reports), default=None)
        if self._swap_load_s is not None:
            load_s = self._swap_load_s
        return StartUp(load_s=load_s, startup_s=self._startup_s)

    def _run(
        self,
        micro_batches: Sequence[MicroBatch],
        phase: RequestType,
        requests_per_micro_batch: Counter[int],
        disable_tqdm: bool,
        on_result: Callable[[int, Any], None] | None = None,
        on_piece: Callable[[PieceDone], None] | None = None,
        start: StartUp | None = None,
        cached: int = 0,
    ) -> list[Any]:
        """Compute the micro-batches of one request type, reporting progress after each step
        (for streamed groups: as each request finishes); ``on_result(micro_batch, result)`` for
        each finished micro-batch, ``on_piece`` for each streamed piece. ``cached``: requests of
        the type the response cache answered (done from the start); when it answered them all,
        no rank is waited for, or started if they start on demand."""
        if not micro_batches:
            self._answered_whole(phase, cached, disable_tqdm)
            return []
        tracker = self._tracker(phase, requests_per_micro_batch, disable_tqdm, start, None, cached)
        self.stats[phase].micro_batches += len(micro_batches)
        assert self._group is not None

        def on_step(step: StepDone) -> None:
            if on_piece is None:  # streamed groups reported their pieces already
                tracker.step(step)
            if on_result is not None:
                for micro_batch, result in zip(step.micro_batches, step.results, strict=True):
                    on_result(micro_batch, result)

        def on_streamed(piece: PieceDone) -> None:
            tracker.piece(piece)
            if on_piece is not None:
                on_piece(piece)

        dispatcher = Dispatcher(self._group, micro_batches, self._timeouts.step_s)
        try:
            with self._computed_again(self.stats[phase], dispatcher):
                results = dispatcher.run(on_step, on_streamed if on_piece is not None else None)
        finally:
            tracker.close()
        check_exactly_once(micro_batches, results)
        return results

    @contextlib.contextmanager
    def _computed_again(self, stats: PhaseStats, dispatcher: Dispatcher) -> Iterator[None]:
        """Add to ``stats`` what ``dispatcher``'s run computed again, when it ends or fails:
        answers the response cache held already when they were stored (``recomputed``), and
        micro-batches of a lost replica computed on another (``requeued``)."""
        rewritten = self._cache.rewritten if self._cache is not None else 0
        try:
            yield
        finally:
            if self._cache is not None:
                stats.recomputed += self._cache.rewritten - rewritten
            stats.requeued += dispatcher.requeued

    def _tracker(
        self,
        phase: RequestType,
        requests_per_micro_batch: Counter[int],
        disable_tqdm: bool,
        start: StartUp | None = None,
        expected: int | None = None,
        answered: int = 0,
    ) -> PhaseTracker:
        """The progress of one run of ``phase`` (the ranks ready and seeded first)."""
        start = start or self._start_up()
        assert self._group is not None
        return PhaseTracker(
            phase,
            self.stats.setdefault(phase, PhaseStats()),
            requests_per_micro_batch,
            range(self._group.layout.num_replicas),
            self._rank_memory,
            start,
            self._on_progress,
            disable_tqdm,
            expected=expected,
            answered=answered,
        )

    def _answered_whole(self, phase: RequestType, cached: int, disable_tqdm: bool) -> None:
        """Report a run of ``phase`` that the response cache answered whole (``cached``
        requests): done, with no rank started or waited for."""
        stats = self.stats.setdefault(phase, PhaseStats())
        if not cached:
            return
        tracker = PhaseTracker(
            phase,
            stats,
            Counter(),
            range(0),
            self._rank_memory,
            StartUp(load_s=None, startup_s=None),
            self._on_progress,
            disable_tqdm,
            answered=cached,
        )
        tracker.report()
        tracker.close()

    def score_parts(
        self,
        total: int,
        bounds: Iterable[tuple[int, int]],
        tokens: PartTokens,
        max_length: int,
        disable_tqdm: bool,
    ) -> list[tuple[float, bool]]:
        """:meth:`score` for ``total`` loglikelihood requests in parts of ``bounds``, which
        ``tokens`` makes (on tokeniser actors where it can): planned on a background thread
        while the replicas compute the parts before
        (:mod:`rayeval.service.engine.parts.pipeline`)."""
        with self._tokenisers(tokens) as pool:
            plan = partial(
                plan_part,
                cache=self._cache,
                budget=self._score_budget,
                share_prefixes=self._share_prefixes,
                max_length=max_length,
                pool=pool,
            )
            parts = made_parts(bounds, tokens, pool)
            return self._run_parts(
                RequestType.LOGLIKELIHOOD, total, parts, plan, ScoreMicroBatch, pool, disable_tqdm
            )

    def generate_parts(
        self,
        total: int,
        bounds: Iterable[tuple[int, int]],
        tokens: PartTokens,
        settings: Sequence[tuple[int | None, dict[str, Any]]],
        disable_tqdm: bool,
        decoding: Callable[[TokeniserPool], PartDecoding],
    ) -> list[str]:
        """lm-eval's answer texts of ``total`` requests generated in parts of ``bounds``, which
        ``tokens`` makes (on tokeniser actors where it can; ``settings``: every distinct
        (max_length, kwargs) among them, which decide the batching): planned on a background
        thread while the replicas compute the parts before, each finished part's answers decoded
        by ``decoding`` (on the actors) while they compute the parts after
        (:mod:`rayeval.service.engine.parts.generate`)."""
        with self._tokenisers(tokens) as pool:  # they start while the ranks do
            reason = self._batching(settings)
            start = self._start_up()
            slots = self._slot_budget() if reason is None else None
            if slots is not None and tokens.refuse_early is not None:
                tokens.refuse_early(slots)  # not once a later part is planned
            plan = partial(
                plan_generate_part,
                cache=self._cache,
                budget=self._generate_budget,
                slots=slots,
                seeder=Seeder(self._seed),
            )
            kind = GenerateGroup if reason is None else GenerateMicroBatch
            parts = made_parts(bounds, tokens, pool)
            decoder = decoding(pool)
            answers = self._run_parts(
                RequestType.GENERATE_UNTIL,
                total,
                parts,
                plan,
                kind,
                pool,
                disable_tqdm,
                start,
                decoder.finished,
            )
            texts = decoder.texts(answers)
            self.stats[RequestType.GENERATE_UNTIL].decoded_by_actors += decoder.decoded
            return texts

    def _tokenisers(self, tokens: PartTokens) -> TokeniserPool:
        return TokeniserPool(tokens.encoder, self._config.tokenizer_workers)

    def _run_parts(
        self,
        phase: RequestType,
        total: int,
        parts: Iterable[Any],
        plan: Callable[[Any], PlannedPart | Callable[[], PlannedPart]],
        kind: type[MicroBatch],
        pool: TokeniserPool,
        disable_tqdm: bool,
        start: StartUp | None = None,
        on_part: Callable[[list[int], list[Any]], None] | None = None,
    ) -> list[Any]:
        """Compute ``total`` requests of ``phase`` in ``parts``, planned by ``plan`` into
        ``kind``, and record how many ``pool`` tokenised (``on_part``: given each finished
        part's answers, :func:`~rayeval.service.engine.parts.pipeline.run_parts`)."""
        tracker = self._tracker(phase, Counter(), disable_tqdm, start, expected=total)
        assert self._group is not None
        dispatcher = Dispatcher(self._group, [], self._timeouts.step_s, kind=kind)
        stats, streamed = self.stats[phase], kind is GenerateGroup
        with self._computed_again(stats, dispatcher):
            answers = run_parts(
                dispatcher, Planner(parts, plan), tracker, stats, total, streamed, on_part
            )
        stats.tokenised_by_actors += pool.tokenised
        stats.planned_by_actors += pool.planned
        return answers
