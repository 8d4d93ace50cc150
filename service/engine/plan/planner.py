"""Work planning: tokenised requests in, layout-independent micro-batches out.

Requests are sorted by length (longest first, as lm-eval does) and cut into micro-batches by a
token budget, so padding stays small and memory use is bounded. The cut depends only on the
requests and the budget — never on R or G — which is what makes results independent of the
layout: the same micro-batch is computed the same way whichever rank gets it.

Score requests whose model inputs are token-identical (the one-token answers of a multiple-choice
question share ``context + continuation[:-1]``) become one row with several targets, so that
context is computed once. With ``share_prefixes``, inputs that share a prefix (the multi-token
choices of one question, questions behind the same few-shot examples) are packed into one token
tree per row, the shared tokens fed to the model once (:func:`pack_prefixes`). Each request's
input is still exactly lm-eval's (left truncation included), so where truncation cuts into a
shared context the inputs simply stop sharing and go their own way.

Generation requests are planned by the same rules in
:mod:`rayeval.service.engine.plan.generation_planner`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rayeval.actors.batches import ScoreMicroBatch, ScoreRow
from rayeval.actors.errors import ConfigError, field


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
                f"max_rows={self.max_rows}): pass a positive {field('batch_size')} / "
                f"{field('max_batch_tokens')}"
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


class Where:
    """Per request, (micro-batch, row, target) of its answer, in three int arrays."""

    def __init__(self) -> None:
        self._columns = (array("q"), array("q"), array("q"))

    def append(self, micro_batch: int, row: int, target: int) -> None:
        for column, value in zip(self._columns, (micro_batch, row, target), strict=True):
            column.append(value)

    def __len__(self) -> int:
        return len(self._columns[0])

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(*self._columns, strict=True)


@dataclass(frozen=True)
class ScorePlan:
    """Micro-batches to compute and, per request (in input order), where its answer lands."""

    micro_batches: list[ScoreMicroBatch]
    where: Where

    @property
    def locations(self) -> list[ScoreLocation]:
        """Per request, where its answer lands, as objects (:attr:`where` holds them)."""
        return [ScoreLocation(*place) for place in self.where]


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
    if isinstance(context, tuple) and len(context) + len(continuation) <= max_length + 1:
        # Nothing to cut: the context tuple itself when the continuation is one token.
        return context + tuple(continuation[:-1])
    return tuple((list(context) + list(continuation))[-(max_length + 1) :][:-1])


#: A sequence joins the packed row of the sequences before it (in sorted order) only when at least
#: this share of its tokens is already there. Packing unrelated sequences saves no model work and
#: widens the row, and attention over a row grows with the square of its width.
MIN_SHARED_FRACTION = 0.25
#: With shared prefixes, a row narrower than this share of its micro-batch's widest row starts a
#: new micro-batch (real tokens stay at least this share of what the model is fed).
PACKED_MIN_FILL = 0.75


def plan_score(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_length: int,
    budget: TokenBudget,
    share_prefixes: bool = False,
) -> ScorePlan:
    """Group, sort and cut (context, continuation) token pairs into score micro-batches.

    Args:
        requests: Token pairs in request order.
        max_length: The model's context window (lm-eval's ``max_length``).
        budget: Micro-batch size limits.
        share_prefixes: Pack inputs that share a prefix into token-tree rows (the ranks'
            model must take custom attention masks:
            :func:`rayeval.actors.compute.packing.packing_unsupported`).

    Returns:
        The plan; ``where[i]`` tells where request ``i``'s (logprob, is_greedy) will be.
    """
    inputs: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    request_inputs: list[tuple[int, ...]] = []
    request_targets = array("q")
    for context, continuation in requests:
        tokens = model_input(context, continuation, max_length)
        targets = inputs.setdefault(tokens, {})
        target = targets.setdefault(tuple(continuation), len(targets))
        request_inputs.append(tokens)
        request_targets.append(target)

    if share_prefixes:
        # The row's width bounds its attention like one of lm-eval's rows (and the budget's).
        packed = pack_prefixes(inputs, max_width=min(max_length, budget.max_tokens))
    else:
        packed = [
            _Packed(ScoreRow(tokens, tuple(targets)), {tokens: 0})
            for tokens, targets in inputs.items()
        ]
    ordered = sorted(packed, key=lambda p: (-len(p.row.tokens), p.row.tokens))
    micro_batches: list[ScoreMicroBatch] = []
    row_at: dict[tuple[int, ...], tuple[int, int, int]] = {}
    # Packed rows differ in width far more than single inputs (one holds a question and its
    # choices, another the questions behind shared few-shot examples): cut before padding
    # would fill more than a quarter of a micro-batch.
    fill = PACKED_MIN_FILL if share_prefixes else 0.0
    for chunk in cut_by_budget(ordered, budget, width=lambda p: len(p.row.tokens), min_fill=fill):
        for position, item in enumerate(chunk):
            for tokens, offset in item.offsets.items():
                row_at[tokens] = (len(micro_batches), position, offset)
        micro_batches.append(ScoreMicroBatch(rows=tuple(item.row for item in chunk)))
    where = Where()
    for tokens, target in zip(request_inputs, request_targets, strict=True):
        micro_batch, row, offset = row_at[tokens]
        where.append(micro_batch, row, offset + target)
    return ScorePlan(micro_batches, where)


@dataclass(frozen=True)
class _Packed:
    """One row, and where each input's targets start among the row's targets."""

    row: ScoreRow
    offsets: dict[tuple[int, ...], int]


def pack_prefixes(
    inputs: dict[tuple[int, ...], dict[tuple[int, ...], int]], max_width: int
) -> list[_Packed]:
    """Pack model inputs that share prefixes into token-tree rows of at most ``max_width`` tokens.

    Inputs are sorted, so each one shares its longest prefix with the one before it; it joins that
    one's row when the row stays within ``max_width`` and at least ``MIN_SHARED_FRACTION`` of it
    is shared, adding only its tokens past the shared prefix. A row holding one input is a plain
    row, exactly as without sharing.

    Args:
        inputs: Per distinct model input, its targets (continuation -> index).
        max_width: Most tokens in one packed row (an input longer than that gets a row alone).

    Returns:
        The rows, each with the offset of every input's first target among the row's targets.
    """
    groups: list[list[tuple[int, ...]]] = []
    width = 0
    previous: tuple[int, ...] = ()
    for tokens in sorted(inputs):
        shared = _common_prefix(previous, tokens) if groups else 0
        added = len(tokens) - shared
        if groups and shared >= MIN_SHARED_FRACTION * len(tokens) and width + added <= max_width:
            groups[-1].append(tokens)
            width += added
        else:
            groups.append([tokens])
            width = len(tokens)
        previous = tokens
    return [_pack(group, inputs) for group in groups]


def _pack(
    group: list[tuple[int, ...]], inputs: dict[tuple[int, ...], dict[tuple[int, ...], int]]
) -> _Packed:
    """One row from sorted inputs: a plain row for one input, else their token tree."""
    if len(group) == 1:
        (tokens,) = group
        return _Packed(ScoreRow(tokens, tuple(inputs[tokens])), {tokens: 0})
    row_tokens: list[int] = []
    parents: list[int] = []
    targets: list[tuple[int, ...]] = []
    positions: list[tuple[int, ...]] = []
    offsets: dict[tuple[int, ...], int] = {}
    path: list[int] = []  # row index of each token of the previous input
    previous: tuple[int, ...] = ()
    for tokens in group:
        path = path[: _common_prefix(previous, tokens)]
        added = tokens[len(path) :]
        if added:  # each added token's parent is the token before it on the input's path
            first = len(row_tokens)
            parents.append(path[-1] if path else -1)
            parents.extend(range(first, first + len(added) - 1))
            path.extend(range(first, first + len(added)))
            row_tokens.extend(added)
        offsets[tokens] = len(targets)
        for target in inputs[tokens]:
            targets.append(target)
            positions.append(tuple(path[len(tokens) - len(target) :]))
        previous = tokens
    return _Packed(
        ScoreRow(tuple(row_tokens), tuple(targets), tuple(parents), tuple(positions)), offsets
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (halving the span where they
    first differ: slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same]; a[:differs] != b[:differs]
    while differs - same > 1:
        middle = (same + differs) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            differs = middle
    return same


def cut_by_budget(
    items: Sequence[Any], budget: TokenBudget, width: Any, min_fill: float = 0.0
) -> list[list[Any]]:
    """Cut length-sorted items (longest first) into chunks whose padded size fits the budget.

    ``min_fill``: an item narrower than that share of its chunk's width starts a new chunk.
    """
    chunks: list[list[Any]] = []
    for item in items:
        # The first item of a chunk is its longest, so it sets the padded width.
        widest = width(chunks[-1][0]) if chunks else 0
        if chunks and budget.fits(len(chunks[-1]) + 1, widest) and width(item) >= min_fill * widest:
            chunks[-1].append(item)
        else:
            chunks.append([item])
    return chunks
