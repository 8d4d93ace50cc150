"""Loglikelihood requests whose tokens make the metric meaningless, found before any batch runs.

lm-eval's HF backend tokenises a (context, continuation) pair by encoding ``context +
continuation`` and cutting it at the length of the context's own encoding. Three shapes come out
of that which lm-eval scores without a word (or crashes on):

- ``empty_continuation``: the continuation encodes to no token (the boundary swallowed it, or it
  was empty). lm-eval answers ``(0.0, True)`` — when its one-forward-per-context grouping
  (``logits_cache``) puts the request beside a request of the same context with a one-token
  continuation; otherwise its hf backend crashes (an assertion, or a shape error).
- ``empty_context``: the context is empty or whitespace only (lm-eval conditions on its prefix
  token, or on nothing at all — then it crashes).
- ``merged_boundary``: the joint encoding does not start with the context's own tokens: the last
  context token merged with the first continuation characters (``model\\n`` + ``yes`` →
  ``mode``, ``l\\n``, ...), so what is scored is not the continuation.

:func:`inspect_requests` reproduces lm-eval's outcome exactly — the numbers stay lm-eval's — and
reports every such request, so that a user learns their metric is built on them. Shapes lm-eval's
hf backend crashes on are refused with a message naming the task, the request and the fix.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, overload

from rayeval.actors.errors import ConfigError
from rayeval.service.vocabulary.events import OnWarning, RequestWarning

logger = logging.getLogger(__name__)


class RequestIssue(StrEnum):
    """Kinds of loglikelihood requests that do not measure what the task means to measure."""

    EMPTY_CONTINUATION = "empty_continuation"
    EMPTY_CONTEXT = "empty_context"
    MERGED_BOUNDARY = "merged_boundary"


#: What lm-eval answers for a continuation of no tokens (a sum over nothing; all of nothing).
EMPTY_ANSWER = (0.0, True)


@dataclass(frozen=True)
class Flagged:
    """One request of a kind in :class:`RequestIssue`, with where it comes from."""

    kind: RequestIssue
    task: str
    doc_id: Any
    context: str
    continuation: str

    def example(self, limit: int = 200) -> dict[str, Any]:
        """The request as a short, JSON-able example (long texts keep their ends)."""
        return {
            "doc_id": self.doc_id,
            "context": _tail(self.context, limit),
            "continuation": self.continuation[:limit],
        }


@dataclass
class RequestReport:
    """Per task and kind: how many requests were flagged, and the first one as an example."""

    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(dict)
    )

    def add(self, flagged: Flagged) -> None:
        self.counts[flagged.task][flagged.kind.value] += 1
        self.examples[flagged.task].setdefault(flagged.kind.value, flagged.example())

    def as_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{task: {kind: {"count": n, "example": {...}}}}`` (empty when nothing was found)."""
        return {
            task: {
                kind: {"count": count, "example": self.examples[task][kind]}
                for kind, count in sorted(kinds.items())
            }
            for task, kinds in sorted(self.counts.items())
        }


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_requests` found: fixed answers and flagged requests."""

    answers: dict[int, tuple[float, bool]]
    flagged: list[Flagged]


class Origins(Sequence[tuple[str, Any]]):
    """Per request, ``(task name, doc id)``, read from lm-eval's Instances when asked (a report
    or an error needs a few; a list of a million tuples would cost the driver memory)."""

    def __init__(self, instances: Sequence[Any]) -> None:
        self._instances = instances

    def __len__(self) -> int:
        return len(self._instances)

    @overload
    def __getitem__(self, index: int) -> tuple[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return Origins(self._instances[index])
        instance = self._instances[index]
        return instance.task_name, instance.doc_id


def inspect_requests(
    requests: Sequence[tuple[tuple[str, str], Sequence[int], Sequence[int]]],
    origins: Sequence[tuple[str, Any]] | None,
    encode: Callable[[str], list[int]],
    logits_cache: bool,
    merged: Sequence[bool] | None = None,
) -> Inspection:
    """Flag degenerate loglikelihood requests and give lm-eval's answers for empty continuations.

    Args:
        requests: lm-eval's tokenised requests: ``((context, continuation), ctx_enc, cont_enc)``.
        origins: Per request, ``(task name, doc id)`` (None: unknown).
        encode: The tokenizer's ``tok_encode`` (lm-eval's, special tokens as lm-eval adds them).
        logits_cache: lm-eval's ``logits_cache`` model arg (one forward per shared context).
        merged: Per request, whether its joint encoding does not start with its context's
            tokens, when the tokeniser already knows (None: ``encode`` finds out).

    Returns:
        ``answers`` (request index -> lm-eval's answer, for requests no model call is needed for)
        and every flagged request.

    Raises:
        ConfigError: a request lm-eval's hf backend crashes on, naming the task, the request and
            the fix.
    """
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    if not all(cont for _, _, cont in requests):  # only empty continuations need the groups
        for index, (_, ctx, cont) in enumerate(requests):
            groups[(*ctx, *cont[:-1])].append(index)
    answers: dict[int, tuple[float, bool]] = {}
    flagged: list[Flagged] = []
    for index, ((context, continuation), ctx, cont) in enumerate(requests):

        def flag(kind: RequestIssue) -> Flagged:
            task, doc_id = origins[index] if origins is not None else ("unknown", None)  # noqa: B023
            return Flagged(kind, task, doc_id, context, continuation)  # noqa: B023

        if not ctx:
            raise _crash(flag(RequestIssue.EMPTY_CONTEXT), "the context encodes to no token")
        if not context.strip():
            flagged.append(flag(RequestIssue.EMPTY_CONTEXT))
        elif (
            merged[index]
            if merged is not None
            else encode(context + continuation)[: len(ctx)] != list(ctx)
        ):
            flagged.append(flag(RequestIssue.MERGED_BOUNDARY))
        if cont:
            continue
        flagged.append(flag(RequestIssue.EMPTY_CONTINUATION))
        # lm-eval computes one request per context group (the longest continuation) and answers
        # the others from its logits; an empty continuation survives that only beside a
        # one-token one (lm-eval's Collator.get_cache), and crashes when computed itself.
        longest = max(len(requests[i][2]) for i in groups[tuple(ctx)])
        if not logits_cache or longest != 1:
            raise _crash(
                flag(RequestIssue.EMPTY_CONTINUATION), "the continuation encodes to no token"
            )
        answers[index] = EMPTY_ANSWER
    return Inspection(answers, flagged)


@dataclass(frozen=True)
class RequestChecks:
    """:func:`inspect_requests` with an LM's settings, reporting what it flags.

    Args:
        encode: The tokenizer's ``tok_encode``.
        logits_cache: lm-eval's ``logits_cache`` model arg.
        report: Where flagged requests are counted.
        on_warning: Called as :func:`report_flagged` says.
    """

    encode: Callable[..., list[int]]
    logits_cache: bool
    report: RequestReport
    on_warning: OnWarning | None

    def __call__(
        self,
        requests: Sequence[tuple[tuple[str, str], Sequence[int], Sequence[int]]],
        origins: Sequence[tuple[str, Any]] | None,
        merged: Sequence[bool] | None,
    ) -> Inspection:
        inspection = inspect_requests(
            requests, origins, self.encode, self.logits_cache, merged=merged
        )
        for flagged in inspection.flagged:
            self.report.add(flagged)
        report_flagged(inspection.flagged, self.on_warning)
        return inspection


def check_empty_context_pairs(
    requests: Sequence[tuple[str, str]],
    origins: Sequence[tuple[str, Any]] | None,
    encode: Callable[..., list[int]],
) -> None:
    """Refuse ``("", continuation)`` pairs whose continuation encodes to nothing: lm-eval's
    tokenisation of an empty context reads the continuation's first token and fails there."""
    for index, (context, continuation) in enumerate(requests):
        if context == "" and not encode(continuation, add_special_tokens=False):
            task, doc_id = origins[index] if origins is not None else ("unknown", None)
            raise _crash(
                Flagged(RequestIssue.EMPTY_CONTINUATION, task, doc_id, context, continuation),
                "both the context and the continuation are empty",
            )


def report_flagged(flagged: Sequence[Flagged], on_warning: OnWarning | None) -> None:
    """Log, and report through ``on_warning`` (a ``RequestWarning``), the degenerate
    requests of one call, per task."""
    by_task: dict[str, list[Flagged]] = defaultdict(list)
    for item in flagged:
        by_task[item.task].append(item)
    for task, items in by_task.items():
        kinds = Counter(item.kind.value for item in items)
        example = items[0]
        logger.warning(
            "task %s: %s loglikelihood requests whose tokens do not measure the task "
            "(%s; e.g. doc %s, continuation %r): scored as lm-eval's hf backend scores them",
            task,
            sum(kinds.values()),
            ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
            example.doc_id,
            example.continuation,
        )
        if on_warning is not None:
            on_warning(RequestWarning(task=task, counts=dict(kinds), example=example.example()))


def _crash(flagged: Flagged, what: str) -> ConfigError:
    return ConfigError(
        f"task {flagged.task!r}, doc {flagged.doc_id!r}: {what} "
        f"(context ...{_tail(flagged.context, 60)!r}, continuation {flagged.continuation[:60]!r}); "
        "lm-eval's hf backend cannot score this request either. Fix the task's doc_to_text / "
        "doc_to_choice / target_delimiter so that every choice is text after the context (or "
        "drop apply_chat_template for this task)"
    )


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]
