"""Work planning: tokenised requests in, layout-independent micro-batches out.

Requests are sorted by length (longest first, as lm-eval does) and cut into micro-batches by a
token budget, so padding stays small and memory use is bounded. The cut depends only on the
requests and the budget — never on R or G — which is what makes results independent of the
layout: the same micro-batch is computed the same way whichever rank gets it.

Score requests whose model inputs are token-identical (the one-token answers of a multiple-choice
question share ``context + continuation[:-1]``) become one row with several targets, so that
context is computed once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.batches import GenerateMicroBatch, ScoreMicroBatch, ScoreRow
from actors.errors import ConfigError


@dataclass(frozen=True)
class TokenBudget:
    """How big one micro-batch may be.

    Args:
        max_tokens: Upper bound on padded tokens (rows x padded width, generation room included).
        max_rows: Upper bound on rows (lm-eval's integer ``batch_size``); None for no bound.
    """

    max_tokens: int = 8192
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or (self.max_rows is not None and self.max_rows < 1):
            raise ConfigError(
                f"batch limits must be >= 1 (max_tokens={self.max_tokens}, "
                f"max_rows={self.max_rows}): pass a positive --batch_size / --max_batch_tokens"
            )

    def fits(self, rows: int, width: int) -> bool:
        """Whether ``rows`` rows padded to ``width`` tokens stay within the budget."""
        if self.max_rows is not None and rows > self.max_rows:
            return False
        return rows == 1 or rows * width <= self.max_tokens


@dataclass(frozen=True)
class ScoreLocation:
    """Where one request's answer is: micro-batch, row within it, target within the row."""

    micro_batch: int
    row: int
    target: int


@dataclass(frozen=True)
class ScorePlan:
    """Micro-batches to compute and, per request (in input order), where its answer lands."""

    micro_batches: list[ScoreMicroBatch]
    locations: list[ScoreLocation]


@dataclass(frozen=True)
class GenerateRequest:
    """One generate_until request, already tokenised and truncated by the driver."""

    context: tuple[int, ...]
    max_gen_toks: int
    until: tuple[str, ...]
    max_length: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def config_key(self) -> str:
        """Requests with equal keys may share a ``generate`` call (lm-eval groups by gen_kwargs)."""
        return json.dumps(
            [self.max_gen_toks, self.until, self.max_length, self.kwargs],
            sort_keys=True,
            default=str,
        )


@dataclass(frozen=True)
class GeneratePlan:
    """Micro-batches to generate and, per request, (micro-batch, position in it)."""

    micro_batches: list[GenerateMicroBatch]
    locations: list[tuple[int, int]]


def model_input(
    context: Sequence[int], continuation: Sequence[int], max_length: int
) -> tuple[int, ...]:
    """The exact tokens lm-eval's HF backend feeds the model for one loglikelihood request.

    Raises:
        ConfigError: if the request cannot be scored (empty parts, continuation too long).
    """
    if not context or not continuation:
        raise ConfigError("a loglikelihood request needs a non-empty context and continuation")
    if len(continuation) > max_length:
        raise ConfigError(
            f"a continuation of {len(continuation)} tokens exceeds the model's max_length "
            f"{max_length}: raise max_length in model_args or shorten the task's targets"
        )
    return tuple((list(context) + list(continuation))[-(max_length + 1) :][:-1])


def plan_score(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int, budget: TokenBudget
) -> ScorePlan:
    """Group, sort and cut (context, continuation) token pairs into score micro-batches.

    Args:
        requests: Token pairs in request order.
        max_length: The model's context window (lm-eval's ``max_length``).
        budget: Micro-batch size limits.

    Returns:
        The plan; ``locations[i]`` tells where request ``i``'s (logprob, is_greedy) will be.
    """
    rows: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    request_keys = []
    for context, continuation in requests:
        tokens = model_input(context, continuation, max_length)
        targets = rows.setdefault(tokens, {})
        target = targets.setdefault(tuple(continuation), len(targets))
        request_keys.append((tokens, target))

    ordered = sorted(rows, key=lambda tokens: (-len(tokens), tokens))
    micro_batches: list[ScoreMicroBatch] = []
    row_at: dict[tuple[int, ...], tuple[int, int]] = {}
    for chunk in _cut(ordered, budget, width=len):
        for position, tokens in enumerate(chunk):
            row_at[tokens] = (len(micro_batches), position)
        micro_batches.append(
            ScoreMicroBatch(rows=tuple(ScoreRow(tokens, tuple(rows[tokens])) for tokens in chunk))
        )
    locations = [ScoreLocation(*row_at[tokens], target) for tokens, target in request_keys]
    return ScorePlan(micro_batches, locations)


def plan_generate(requests: Sequence[GenerateRequest], budget: TokenBudget) -> GeneratePlan:
    """Group generate requests by their generation settings, sort by length, cut by budget."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.config_key(), []).append(index)

    micro_batches: list[GenerateMicroBatch] = []
    locations: list[tuple[int, int]] = [(-1, -1)] * len(requests)
    for indices in groups.values():
        indices.sort(key=lambda i: (-len(requests[i].context), requests[i].context))
        first = requests[indices[0]]
        for chunk in _cut(
            indices,
            budget,
            width=lambda i, room=first.max_gen_toks: len(requests[i].context) + room,
        ):
            for position, index in enumerate(chunk):
                locations[index] = (len(micro_batches), position)
            micro_batches.append(
                GenerateMicroBatch(
                    contexts=tuple(requests[i].context for i in chunk),
                    max_gen_toks=first.max_gen_toks,
                    until=first.until,
                    max_length=first.max_length,
                    kwargs=dict(first.kwargs),
                )
            )
    return GeneratePlan(micro_batches, locations)


def _cut(items: Sequence[Any], budget: TokenBudget, width: Any) -> list[list[Any]]:
    """Cut length-sorted items (longest first) into chunks whose padded size fits the budget."""
    chunks: list[list[Any]] = []
    for item in items:
        # The first item of a chunk is its longest, so it sets the padded width.
        if chunks and budget.fits(len(chunks[-1]) + 1, width(chunks[-1][0])):
            chunks[-1].append(item)
        else:
            chunks.append([item])
    return chunks
