"""How far two evaluations of the same samples are apart, and whether rayeval's answers are as
close to lm-eval hf's as lm-eval hf's are to each other (``rayeval parity``, the conformance
matrix and the tests all judge with this).

The bound (DESIGN invariant 1, as measured): per measure — the largest log-prob difference of a
request, the number of requests whose ``is_greedy`` flag or generation differs, each metric —
rayeval's distance to the nearest of lm-eval hf's runs at several batch sizes is no more than the
largest distance between two of those runs (their *spread*). Where the spread is zero this is bit
for bit. In float32 a log-prob may in addition differ by the fidelity bound
(:func:`logprob_tolerance`: 1e-4, or two float32 ulps past 1024), a metric by 1e-5 relative.

Evaluations are ``lm_eval.simple_evaluate``'s results with ``log_samples``: ``samples`` per task
(log-probs as floats, flags as bools, generations as strings) and ``results``/``groups``.
Imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: lm-eval hf's batch sizes whose answers bound rayeval's: a request alone (MKL and oneDNN take
#: other kernels for 1-3 rows) and two full batches.
SPREAD_BATCH_SIZES = (1, 4, 16)
#: The float32 fidelity bound on a log-prob (below 1024 in magnitude).
LOGPROB_TOL = 1e-4


def logprob_tolerance(value: float) -> float:
    """How far a float32 log-prob may be from lm-eval hf's: 1e-4, or two float32 ulps of the
    value where that is more (past 1024 in magnitude, as whole-document rolling sums are: one
    ulp of 2180 is 2.4e-4)."""
    import numpy as np

    if abs(value) <= 1024:
        return LOGPROB_TOL
    return max(LOGPROB_TOL, 2 * float(np.spacing(np.float32(abs(value)))))


@dataclass(frozen=True)
class Distance:
    """How far two evaluations' per-sample results and metrics are apart, measure by measure:
    the largest log-prob difference of any request, the number of requests whose ``is_greedy``
    or generation differs, each metric's difference; and, for the float32 bound, how many
    log-probs differ by more than :func:`logprob_tolerance` (``past_bound``)."""

    logprob: float = 0.0
    greedy: int = 0
    generations: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    past_bound: int = 0
    #: Where each differing flag or generation is (``task/doc_id[i]``), for reports.
    where: tuple[str, ...] = ()

    def measures(self) -> dict[str, float]:
        """Every measure by name: ``logprob``, ``is_greedy``, ``generations``, ``metric:NAME``."""
        named = {"logprob": self.logprob, "is_greedy": self.greedy, "generations": self.generations}
        return named | {f"metric:{key}": value for key, value in self.metrics.items()}

    @classmethod
    def between(cls, a: dict[str, Any], b: dict[str, Any]) -> Distance:
        """The distance between two evaluations of the same samples (prompts checked equal).

        Raises:
            AssertionError: the two did not evaluate the same tasks, documents and prompts.
        """
        logprob, greedy, generations, past, where = 0.0, 0, 0, 0, []
        for at, x, y in paired_atoms(a, b):
            if isinstance(x, bool):
                greedy += x != y
                where += [at] if x != y else []
            elif isinstance(x, float):
                logprob = max(logprob, abs(x - y))
                past += abs(x - y) > logprob_tolerance(x)
            elif isinstance(x, str):
                generations += x != y
                where += [at] if x != y else []
            else:
                assert x == y, f"{at}: {x!r} != {y!r}"
        metrics = {}
        for key, x, y in paired_metrics(a, b):
            if isinstance(x, float) and isinstance(y, float):
                same = x == y or (math.isnan(x) and math.isnan(y))
                metrics[key] = 0.0 if same else abs(x - y)
            else:
                assert x == y, f"{key}: {x!r} != {y!r}"
        return cls(logprob, greedy, generations, metrics, past, tuple(where))


@dataclass(frozen=True)
class Judgement:
    """rayeval's answers judged against lm-eval hf's spread: per measure, lm-eval hf's own
    spread, the allowance (the spread, widened by the float32 bound), rayeval's distance to the
    nearest of lm-eval hf's runs, and the measures past their allowance."""

    spread: dict[str, float]
    nearest: dict[str, float]
    beyond: dict[str, str]
    where: tuple[str, ...]

    @property
    def holds(self) -> bool:
        return not self.beyond

    def figures(self, which: str) -> str:
        """``spread`` or ``nearest`` as one short line, in parentheses."""
        return f"({figures(self.spread if which == 'spread' else self.nearest)})"


def figures(measures: dict[str, float]) -> str:
    """Measures as one line: the largest log-prob difference, the is_greedy flags and
    generations that differ, the largest metric difference."""
    metrics = [value for name, value in measures.items() if name.startswith("metric:")]
    return (
        f"logprob {measures.get('logprob', 0.0):g}, is_greedy {measures.get('is_greedy', 0):g}, "
        f"generations {measures.get('generations', 0):g}, metrics {max(metrics, default=0.0):g}"
    )


@dataclass(frozen=True)
class Spread:
    """lm-eval hf's answers on one model and samples at several batch sizes (``runs``), in
    ``dtype``."""

    label: str
    dtype: str
    batch_sizes: tuple[int, ...]
    runs: tuple[dict[str, Any], ...]

    def spread(self) -> dict[str, float]:
        """Per measure, the most any two batch sizes' answers differ."""
        spread: dict[str, float] = {}
        for i, a in enumerate(self.runs):
            for b in self.runs[i + 1 :]:
                for name, value in Distance.between(a, b).measures().items():
                    spread[name] = max(spread.get(name, 0.0), value)
        return spread

    def judge(self, ours: dict[str, Any]) -> Judgement:
        """``ours`` against this spread (the module docstring's bound)."""
        spread = self.spread()
        distances = [Distance.between(run, ours) for run in self.runs]
        measures = [d.measures() for d in distances]
        nearest = {name: min(m[name] for m in measures) for name in spread}
        float32 = self.dtype == "float32"
        beyond = {}
        for name, value in nearest.items():
            allowed = spread[name]
            if float32 and name == "logprob":
                if min(d.past_bound for d in distances) == 0:
                    continue  # every log-prob within the fidelity bound of one run
            elif float32 and name.startswith("metric:"):
                allowed = max(allowed, 1e-6, 1e-5 * _metric_scale(self.runs[0], name))
            if value > allowed:
                beyond[name] = f"{value:g} > {allowed:g}"
        closest = min(distances, key=lambda d: len(d.where))
        return Judgement(spread, nearest, beyond, closest.where)


def _metric_scale(run: dict[str, Any], name: str) -> float:
    """The magnitude of metric ``name`` (``metric:section/task/key``) in ``run``."""
    section, task, key = name.removeprefix("metric:").split("/", 2)
    value = run.get(section, {}).get(task, {}).get(key)
    return abs(value) if isinstance(value, float) and math.isfinite(value) else 0.0


def atoms(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """A response's leaves (log-prob, flag, generation), each with where it is."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from atoms(item, f"{where}[{i}]")
    else:
        yield where, value


def paired_atoms(a: dict[str, Any], b: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """Each response's atoms side by side, sample by sample, once the two have the same tasks,
    doc ids, prompts and response shapes (asserted)."""
    assert set(a["samples"]) == set(b["samples"]), "different task sets"
    for task, samples in a["samples"].items():
        others = {s["doc_id"]: s for s in b["samples"][task]}
        assert {s["doc_id"] for s in samples} == others.keys(), f"{task}: different doc ids"
        for sample in samples:
            other = others[sample["doc_id"]]
            where = f"{task}/{sample['doc_id']}"
            assert sample["arguments"] == other["arguments"], f"{where}: prompts differ"
            x, y = list(atoms(sample["resps"], where)), list(atoms(other["resps"], where))
            assert [w for w, _ in x] == [w for w, _ in y], (
                f"{where}: {sample['resps']} vs {other['resps']}"
            )
            for (w, u), (_, v) in zip(x, y, strict=True):
                assert type(u) is type(v), f"{w}: {u!r} vs {v!r}"
                yield w, u, v


def paired_metrics(a: dict[str, Any], b: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """Every metric of ``a``'s results and groups beside ``b``'s, as ``section/name/key``."""
    for section in ("results", "groups"):
        for name, metrics in a.get(section, {}).items():
            for key, value in metrics.items():
                yield f"{section}/{name}/{key}", value, b[section][name][key]


def assert_same_results(
    reference: dict[str, Any], ours: dict[str, Any], exact: bool = False
) -> None:
    """Per-sample responses and every metric agree (``exact``: bit-identical responses)."""
    compared = 0
    for where, ref, other in paired_atoms(reference, ours):
        _assert_same_atom(ref, other, where, exact)
        compared += 1
    assert compared > 0
    for key, value, other in paired_metrics(reference, ours):
        if isinstance(value, float) and not exact:
            assert math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-6), (
                f"{key}: {value} != {other}"
            )
        else:
            assert value == other, f"{key}: {value!r} != {other!r}"


def _assert_same_atom(ref: Any, ours: Any, where: str, exact: bool) -> None:
    """One log-prob, flag or generation of a response, as :func:`assert_same_results` holds it."""
    # lm-eval's samples JSONL stores log-probs as strings: compare them as numbers.
    number = _number(ref) if isinstance(ref, str) and ref != ours and not exact else None
    if number is not None:
        other = _number(ours)
        assert other is not None, f"{where}: {ref!r} != {ours!r}"
        assert abs(number - other) <= logprob_tolerance(number), f"{where}: {ref!r} != {ours!r}"
    elif isinstance(ref, float) and not exact:
        assert abs(ref - ours) <= logprob_tolerance(ref), f"{where}: logprob {ref} vs {ours}"
    else:
        assert ref == ours, f"{where}: {ref!r} != {ours!r}"


def _number(text: str) -> float | None:
    """``text`` as a number (a log-prob in lm-eval's samples JSONL), or None (a generation)."""
    try:
        return float(text)
    except ValueError:
        return None
