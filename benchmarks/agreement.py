"""How one benchmark row's lm-eval results compare with the baseline row's.

:func:`compare` looks at every reported metric (stderr aside) and every logged sample: the
largest metric and log-probability differences, how many log-probabilities are beyond
:func:`logprob_tolerance`, and how many ``is_greedy`` flags or generations differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

LOGPROB_TOL = 1e-4


@dataclass
class Agreement:
    """How one row's results compare with the baseline row's."""

    max_metric_diff: float = 0.0
    max_metric_name: str = ""
    max_logprob_diff: float = 0.0
    #: the (baseline, other) log-probabilities of the largest difference
    max_logprob_pair: tuple[float, float] | None = None
    #: log-probabilities differing by more than ``logprob_tolerance`` allows
    beyond_tolerance: int = 0
    discrete_diffs: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        """No problem, no discrete difference and no log-probability beyond tolerance."""
        return not self.problems and self.discrete_diffs == 0 and self.beyond_tolerance == 0


def logprob_tolerance(a: float, b: float) -> float:
    """|dlogprob| allowed between two log-probabilities: ``LOGPROB_TOL``, or two float32 ulps.

    A log-probability summed over hundreds of tokens (a ``loglikelihood_rolling`` document) is
    larger than 1024 in magnitude, where float32 values are 1.2e-4 apart: the 1e-4 of the
    invariant is then below float32's own resolution, and two exact computations that sum the
    same tokens in another order (another batch shape) differ by one ulp.
    """
    import numpy

    magnitude = numpy.float32(max(abs(a), abs(b)))
    return max(LOGPROB_TOL, 2 * float(numpy.spacing(magnitude)))


def compare(baseline: dict[str, Any], other: dict[str, Any]) -> Agreement:
    """Compare two ``simple_evaluate(..., log_samples=True)`` results.

    Args:
        baseline: The reference row's results.
        other: The results of the row being checked.

    Returns:
        What differs, and by how much.
    """
    agreement = Agreement()
    _compare_metrics(agreement, baseline, other)
    _compare_samples(agreement, baseline.get("samples", {}), other.get("samples", {}))
    return agreement


def _compare_metrics(agreement: Agreement, baseline: dict[str, Any], other: dict[str, Any]) -> None:
    for section in ("results", "groups"):
        for name, metrics in baseline.get(section, {}).items():
            for key, value in metrics.items():
                if (
                    "_stderr" in key
                    or isinstance(value, bool)
                    or not isinstance(value, int | float)
                ):
                    continue
                theirs = other.get(section, {}).get(name, {}).get(key)
                if not isinstance(theirs, int | float):
                    agreement.problems.append(f"{section}/{name}/{key} missing")
                    continue
                if math.isnan(value) and math.isnan(theirs):
                    continue
                diff = abs(float(value) - float(theirs))
                if math.isnan(diff) or diff > agreement.max_metric_diff:
                    agreement.max_metric_diff = diff
                    agreement.max_metric_name = f"{name}/{key}"


def _compare_samples(
    agreement: Agreement, base_samples: dict[str, Any], other_samples: dict[str, Any]
) -> None:
    if set(base_samples) != set(other_samples):
        agreement.problems.append(
            f"task sets differ: {sorted(set(base_samples) ^ set(other_samples))}"
        )
    for task in set(base_samples) & set(other_samples):
        theirs_by_doc = {s["doc_id"]: s for s in other_samples[task]}
        for sample in base_samples[task]:
            theirs = theirs_by_doc.get(sample["doc_id"])
            if theirs is None:
                agreement.problems.append(f"{task}/{sample['doc_id']} missing")
                continue
            agreement.samples += 1
            if sample["arguments"] != theirs["arguments"]:
                agreement.problems.append(f"{task}/{sample['doc_id']}: prompts differ")
            _compare_responses(agreement, sample["resps"], theirs["resps"])


def _compare_responses(agreement: Agreement, ours: Any, theirs: Any) -> None:
    for a, b in leaves(ours, theirs):
        if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
            if abs(a - b) > logprob_tolerance(a, b):
                agreement.beyond_tolerance += 1
            if abs(a - b) >= agreement.max_logprob_diff:
                agreement.max_logprob_diff = abs(a - b)
                agreement.max_logprob_pair = (a, b)
        elif a != b:
            agreement.discrete_diffs += 1


def leaves(a: Any, b: Any) -> Iterator[tuple[Any, Any]]:
    """Pairs of leaves of two nested responses, walked together (a list against a list of
    the same length is walked into; anything else is one pair)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            yield from leaves(x, y)
    else:
        yield a, b
