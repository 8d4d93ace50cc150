"""How the GPU check judges rayeval's answers against lm-eval hf's (DESIGN invariant 1).

:func:`distances` compares two ``simple_evaluate(..., log_samples=True)`` results sample by
sample: the largest |Δ log-probability| of each sample and whether any flag, text or per-sample
metric (``is_greedy``, a generation, ``acc``) differs. Two verdicts are built on it:

- :func:`exact_verdict` (float32: the logic's parity): every log-probability within
  ``agreement.logprob_tolerance`` (1e-4, or two float32 ulps above 1024 in magnitude), nothing
  discrete differs, every aggregate metric equal (continuous ones within the same bound);
- :func:`spread_verdict` (bf16): lm-eval hf's own spread between two batch sizes on the same
  GPU is the yardstick. A sample may be as far from hf (batch size A) as the farthest sample of
  hf A from hf B, plus the float32 bound; a flag, text or choice may differ only where hf A and
  hf B differ on that sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from benchmarks.agreement import LOGPROB_TOL, leaves, logprob_tolerance

#: Metrics that are continuous functions of log-probabilities (held to a bound, not equality).
CONTINUOUS_METRICS = ("perplexity", "bits_per_byte")
EXAMPLES = 5


@dataclass
class SampleDistance:
    """How far one sample of one result is from the same sample of another."""

    max_dlogprob: float = 0.0
    beyond_f32: bool = False  # a log-probability beyond logprob_tolerance
    discrete: list[str] = field(default_factory=list)  # flags, texts, metrics that differ


@dataclass
class Distances:
    """Every sample's distance, and what could not be compared."""

    samples: dict[str, SampleDistance] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    logprobs: int = 0
    logprobs_differing: int = 0

    @property
    def max_dlogprob(self) -> float:
        return max((s.max_dlogprob for s in self.samples.values()), default=0.0)

    def discrete(self) -> dict[str, list[str]]:
        """The samples where a flag, text or per-sample metric differs."""
        return {key: s.discrete for key, s in self.samples.items() if s.discrete}


def distances(reference: dict[str, Any], other: dict[str, Any]) -> Distances:
    """Every logged sample of ``other`` against ``reference``'s (same task, same doc id)."""
    found = Distances()
    theirs, ours = reference.get("samples", {}), other.get("samples", {})
    if set(theirs) != set(ours):
        found.problems.append(f"task sets differ: {sorted(set(theirs) ^ set(ours))}")
    for task in sorted(set(theirs) & set(ours)):
        by_doc = {sample["doc_id"]: sample for sample in ours[task]}
        for sample in theirs[task]:
            key = f"{task}/{sample['doc_id']}"
            mine = by_doc.get(sample["doc_id"])
            if mine is None or mine["arguments"] != sample["arguments"]:
                found.problems.append(f"{key}: {'missing' if mine is None else 'prompts differ'}")
                continue
            found.samples[key] = _sample_distance(found, sample, mine)
    return found


def _sample_distance(found: Distances, sample: dict[str, Any], mine: dict[str, Any]) -> Any:
    distance = SampleDistance()
    for a, b in leaves(sample["resps"], mine["resps"]):
        if isinstance(a, float) and isinstance(b, float):
            found.logprobs += 1
            diff = abs(a - b)
            found.logprobs_differing += diff != 0
            distance.max_dlogprob = max(distance.max_dlogprob, diff)
            distance.beyond_f32 |= diff > logprob_tolerance(a, b)
        elif a != b:
            distance.discrete.append(f"{a!r} vs {b!r}"[:200])
    for metric in sample.get("metrics", []):  # a flipped choice shows here
        continuous = any(name in metric for name in CONTINUOUS_METRICS)
        if not continuous and sample.get(metric) != mine.get(metric):
            distance.discrete.append(f"{metric}: {sample.get(metric)!r} vs {mine.get(metric)!r}")
    return distance


def metric_diffs(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, list[Any]]:
    """Aggregate metrics that differ: equal, or for continuous ones within the float32 bound
    (a perplexity as its logarithm, linear in the summed log-probabilities)."""
    diffs: dict[str, list[Any]] = {}
    for section in ("results", "groups"):
        for name, metrics in reference.get(section, {}).items():
            for key, value in metrics.items():
                if (
                    "_stderr" in key
                    or isinstance(value, bool)
                    or not isinstance(value, int | float)
                ):
                    continue
                mine = other.get(section, {}).get(name, {}).get(key)
                if not isinstance(mine, int | float) or not _metric_close(key, value, mine):
                    diffs[f"{name}/{key}"] = [value, mine]
    return diffs


def _metric_close(key: str, a: float, b: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if not any(name in key for name in CONTINUOUS_METRICS):
        return False
    if "perplexity" in key and a > 0 and b > 0:
        a, b = math.log(a), math.log(b)
    return abs(a - b) <= LOGPROB_TOL + 1e-6 * max(abs(a), abs(b))


def exact_verdict(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """float32: the logic's parity (``passed`` and every figure behind it)."""
    found = distances(reference, other)
    beyond = sorted(key for key, s in found.samples.items() if s.beyond_f32)
    discrete = found.discrete()
    metrics = metric_diffs(reference, other)
    passed = bool(found.samples) and not (beyond or discrete or metrics or found.problems)
    return {
        "passed": passed,
        "bound": f"|dlogprob| <= {LOGPROB_TOL} (or 2 float32 ulps above 1024)",
        "samples": len(found.samples),
        "logprobs": found.logprobs,
        "logprobs_differing": found.logprobs_differing,
        "max_abs_dlogprob": found.max_dlogprob,
        "beyond_bound": beyond[:EXAMPLES],
        "beyond_bound_count": len(beyond),
        "discrete_diffs": dict(list(discrete.items())[:EXAMPLES]),
        "discrete_diff_count": len(discrete),
        "metric_diffs": metrics,
        "problems": found.problems[:EXAMPLES],
    }


def spread_verdict(
    hf_a: dict[str, Any], hf_b: dict[str, Any], other: dict[str, Any]
) -> dict[str, Any]:
    """bf16: ``other`` against hf at batch size A, judged by hf A's own distance from hf B."""
    spread = distances(hf_a, hf_b)
    found = distances(hf_a, other)
    bound = spread.max_dlogprob + LOGPROB_TOL
    beyond = sorted(key for key, s in found.samples.items() if s.max_dlogprob > bound)
    hf_flips = set(spread.discrete())
    flips = found.discrete()
    unexplained = {key: d for key, d in flips.items() if key not in hf_flips}
    problems = spread.problems + found.problems
    passed = bool(found.samples) and not (beyond or unexplained or problems)
    return {
        "passed": passed,
        "bound": "|dlogprob| <= hf's max |dlogprob| between its batch sizes + 1e-4; a flip "
        "only where hf flips between its batch sizes",
        "hf_spread_max_abs_dlogprob": spread.max_dlogprob,
        "hf_spread_flips": len(hf_flips),
        "bound_dlogprob": bound,
        "samples": len(found.samples),
        "logprobs": found.logprobs,
        "logprobs_differing": found.logprobs_differing,
        "max_abs_dlogprob": found.max_dlogprob,
        "beyond_bound": beyond[:EXAMPLES],
        "beyond_bound_count": len(beyond),
        "flips": len(flips),
        "flips_hf_also_makes": len(flips) - len(unexplained),
        "unexplained_flips": dict(list(unexplained.items())[:EXAMPLES]),
        "unexplained_flip_count": len(unexplained),
        "problems": problems[:EXAMPLES],
    }


def spread_figures(hf_a: dict[str, Any], hf_b: dict[str, Any]) -> dict[str, Any]:
    """lm-eval hf's own spread between its two batch sizes (reported on its own line)."""
    spread = distances(hf_a, hf_b)
    return {
        "samples": len(spread.samples),
        "logprobs": spread.logprobs,
        "logprobs_differing": spread.logprobs_differing,
        "max_abs_dlogprob": spread.max_dlogprob,
        "flips": len(spread.discrete()),
        "flip_examples": dict(list(spread.discrete().items())[:EXAMPLES]),
        "problems": spread.problems[:EXAMPLES],
    }
