"""Computing one evaluation's requests: the response cache, the plan, the replicas, the figures.

:class:`Executor` takes tokenised requests of one type from :class:`rayeval.service.engine.lm.
RayEvalLM`, answers what the response cache holds, plans the rest into layout-independent
micro-batches (:mod:`rayeval.service.engine.planner`), runs them on the worker group's replicas
(:mod:`rayeval.service.engine.dispatch`), stores each finished micro-batch's answers, checks that
every micro-batch came back exactly once, and keeps the request type's figures
(:mod:`rayeval.service.engine.phases`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rayeval.actors.batches import GenerateMicroBatch, MicroBatch, ScoreMicroBatch
from rayeval.actors.errors import ConfigError, ResultIntegrityError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind, Timeouts
from rayeval.service.config import (
    DEFAULT_CPU_SCORE_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BATCH_TOKENS,
    EngineConfig,
)
from rayeval.service.engine.dispatch import StepDone, run_steps
from rayeval.service.engine.phases import PhaseStats, PhaseTracker, Progress, StartUp
from rayeval.service.engine.planner import (
    GenerateRequest,
    TokenBudget,
    plan_generate,
    plan_score,
)
from rayeval.service.engine.response_cache import ResponseCache, generate_key, score_key

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
    ) -> None:
        self.stats: dict[str, PhaseStats] = {}
        self._score_budget = budget(config, score_on=device)
        self._generate_budget = budget(config)
        self._timeouts = timeouts
        self._cache = cache
        self._share_prefixes = share_prefixes
        self._seed = seed
        self._on_progress = on_progress
        self._created = created
        self._startup_s: float | None = None
        self._rank_memory: dict[str, list[dict[str, float]]] = {}
        self._group: WorkerGroup | None = None
        self._begun = self._reused = False

    def attach(self, group: WorkerGroup | None, reused: bool = False) -> None:
        """Compute on ``group`` (None: closed). ``reused``: kept ranks, already seeded for this
        evaluation, that loaded nothing for it."""
        self._group = group
        self._begun = self._reused = reused

    def score(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        max_length: int,
        phase: str,
        disable_tqdm: bool,
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each (context, continuation) token pair, in order."""
        keys = [score_key(context, continuation, max_length) for context, continuation in pairs]
        cached, todo = self._cached(keys, phase)
        plan = plan_score(
            [pairs[i] for i in todo], max_length, self._score_budget, self._share_prefixes
        )
        located = [
            (keys[i], loc.micro_batch, (loc.row, loc.target))
            for i, loc in zip(todo, plan.locations, strict=True)
        ]
        results = self._run(
            plan.micro_batches,
            phase,
            Counter(loc.micro_batch for loc in plan.locations),
            disable_tqdm,
            on_result=self._cache.storer(located) if self._cache is not None else None,
        )
        answers = dict(cached) | {
            i: results[loc.micro_batch][loc.row][loc.target]
            for i, loc in zip(todo, plan.locations, strict=True)
        }
        return [answers[i] for i in range(len(pairs))]

    def generate(self, requests: Sequence[GenerateRequest], disable_tqdm: bool) -> list[list[int]]:
        """The generated token ids of each request, in order."""
        keys = [generate_key(request.context, request.settings()) for request in requests]
        cached, todo = self._cached(keys, "generate_until")
        plan = plan_generate([requests[i] for i in todo], self._generate_budget)
        located = [
            (keys[i], mb, (position,))
            for i, (mb, position) in zip(todo, plan.locations, strict=True)
        ]
        outputs = self._run(
            plan.micro_batches,
            "generate_until",
            Counter(mb for mb, _ in plan.locations),
            disable_tqdm,
            on_result=self._cache.storer(located) if self._cache is not None else None,
        )
        generated = dict(cached) | {
            i: outputs[mb][position] for i, (mb, position) in zip(todo, plan.locations, strict=True)
        }
        return [list(generated[i]) for i in range(len(requests))]

    def _cached(self, keys: Sequence[Any], phase: str) -> tuple[dict[int, Any], list[int]]:
        """Answers the response cache has (position -> answer), and the positions to compute."""
        cached = self._cache.get_many(keys) if self._cache is not None else {}
        if cached:
            self.stats.setdefault(phase, PhaseStats()).cached += len(cached)
            logger.info(
                "%s: %d of %d requests answered from the cache", phase, len(cached), len(keys)
            )
        return cached, [i for i in range(len(keys)) if i not in cached]

    def _start_up(self) -> StartUp:
        """Wait for the ranks and seed them for this evaluation, once; the start-up figures."""
        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: create a new one to evaluate again")
        load_reports = self._group.wait_ready()
        if not self._begun:  # seeded after loading, as kept replicas are: same samples
            self._group.begin_evaluation(self._seed, timeout_s=self._timeouts.step_s)
            self._begun = True
        if self._startup_s is None:
            self._startup_s = time.monotonic() - self._created
        # Kept replicas loaded nothing for this evaluation.
        load_s = 0.0 if self._reused else max((r["seconds"] for r in load_reports), default=None)
        return StartUp(load_s=load_s, startup_s=self._startup_s)

    def _run(
        self,
        micro_batches: Sequence[MicroBatch],
        phase: str,
        requests_per_micro_batch: Counter[int],
        disable_tqdm: bool,
        on_result: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """Compute the micro-batches of one request type, reporting progress after each step;
        ``on_result(micro_batch, result)`` for each finished micro-batch."""
        start = self._start_up()
        assert self._group is not None
        stats = self.stats.setdefault(phase, PhaseStats())
        stats.micro_batches += len(micro_batches)
        tracker = PhaseTracker(
            phase,
            stats,
            requests_per_micro_batch,
            range(self._group.layout.num_replicas),
            self._rank_memory,
            start,
            self._on_progress,
            disable_tqdm,
        )

        def on_step(step: StepDone) -> None:
            tracker.step(step)
            if on_result is not None:
                for micro_batch, result in zip(step.micro_batches, step.results, strict=True):
                    on_result(micro_batch, result)

        try:
            results = run_steps(self._group, micro_batches, self._timeouts.step_s, on_step)
        finally:
            tracker.close()
        check_exactly_once(micro_batches, results)
        return results


def check_exactly_once(micro_batches: Sequence[MicroBatch], results: Sequence[Any]) -> None:
    """Every micro-batch came back once, with one answer per row (per target for scores)."""
    for index, (batch, result) in enumerate(zip(micro_batches, results, strict=True)):
        if isinstance(batch, ScoreMicroBatch):
            expected = [len(row.targets) for row in batch.rows]
            got = [len(row) for row in result] if result is not None else None
        else:
            assert isinstance(batch, GenerateMicroBatch)
            expected = [1] * len(batch.contexts)
            got = [1] * len(result) if result is not None else None
        if got != expected:
            raise ResultIntegrityError(
                f"micro-batch {index} came back with {got} answers, expected {expected} "
                "(a request id is missing or duplicated: please report this bug)"
            )


def budget(config: EngineConfig, score_on: DeviceKind | None = None) -> TokenBudget:
    """Micro-batch limits: a token budget with ``auto``, lm-eval's rows per batch otherwise.

    ``score_on``: the budget of scoring micro-batches on ranks of that device. CPU ranks score
    with a smaller default token budget than GPUs: a CPU forward over 1-2k tokens runs faster
    per token than one over 4-8k, whose activations outgrow the caches (measured in
    docs/performance.md), and narrower micro-batches pad less. Generation keeps the larger
    budget on every device: each decode step costs a forward of one token per row, and under
    FSDP one all-gather of every weight for the whole micro-batch, so wider is faster.
    """
    if isinstance(config.batch_size, str):  # "auto" or "auto:N" (validated by the config)
        default = DEFAULT_MAX_BATCH_TOKENS
        if score_on is DeviceKind.CPU:
            default = DEFAULT_CPU_SCORE_BATCH_TOKENS
        return TokenBudget(
            max_tokens=config.max_batch_tokens or default,
            max_rows=config.max_batch_size or DEFAULT_MAX_BATCH_ROWS,
        )
    return TokenBudget(max_tokens=config.max_batch_tokens or 2**62, max_rows=config.batch_size)
