"""Paired comparison of two evaluations on the same documents: is a difference real?

lm-eval reports each metric with a standard error computed as if the two runs were independent.
Two models evaluated on the same documents are paired: each document's result under A and under B
are two measurements of one item, and the spread of the per-document *differences* is usually
far smaller than that of either run. :func:`compare` pairs the logged samples of two evaluations
by task, filter and document and reports, per task and metric:

- the difference ``b - a`` of lm-eval's aggregate (recomputed from the samples with lm-eval's own
  aggregation function, so it equals the results files' values);
- a paired 95% interval (percentile bootstrap over documents, seeded) and a p-value: McNemar's
  exact test for 0/1 metrics (accuracy, exact match), a paired permutation test otherwise (A's
  and B's values swapped within documents at random, seeded; exact for few documents), both
  ``scipy.stats``'s;
- the unpaired 95% interval beside it (``difference ± 1.96 * sqrt(se_a^2 + se_b^2)`` from each
  results file's own stderr), to show what pairing buys;
- how many documents moved each way, and which: for 0/1 metrics the documents that flipped; for
  other per-document values those whose value rose or fell; for corpus metrics (perplexities,
  bits per byte: lm-eval keeps a (log-likelihood, length) pair per document) those whose
  log-likelihood rose or fell.

It refuses, naming why (:class:`IncomparableError`), to pair evaluations whose documents or
few-shot settings differ. Two evaluations of one model differ in something else (the dtype, the
layout): :func:`distinctions` names it, so that the columns do not read alike. Torch-free: the
API process and ``rayeval compare`` both use it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from rayeval.actors.errors import ConfigError
from rayeval.actors.errors import field as config_field

#: Bootstrap resamples and seed, unless the caller says otherwise.
DEFAULT_ITERATIONS = 10_000
DEFAULT_SEED = 1234
#: Two-sided 95%: the normal quantile of the unpaired interval, and the significance level.
Z_95 = 1.959963984540054
ALPHA = 0.05


class IncomparableError(ConfigError):
    """The two evaluations cannot be paired (other documents, few-shot settings or tasks)."""


@dataclass(frozen=True)
class EvaluationSamples:
    """What a comparison reads of one evaluation.

    Args:
        label: How to name it (an evaluation id, a results file).
        results: lm-eval's results JSON (``results``, ``configs``, ``n-shot``, ``config``, ...).
        samples: Per task, lm-eval's logged samples (one dict per document and filter).
    """

    label: str
    results: Mapping[str, Any]
    samples: Mapping[str, Sequence[Mapping[str, Any]]]


@dataclass(frozen=True)
class MetricComparison:
    """One metric of one task, compared."""

    task: str
    metric: str
    filter: str
    documents: int
    a: float
    b: float
    difference: float
    paired_interval: tuple[float, float]
    p_value: float
    test: str  # "mcnemar" or "sign-flip permutation"
    unpaired_interval: tuple[float, float] | None
    higher_is_better: bool | None
    #: 0/1 metrics: documents B got right and A wrong ("better"), and the reverse ("worse");
    #: other metrics: documents whose value (``moved``) rose, and fell.
    better: list[Any] = field(default_factory=list)
    worse: list[Any] = field(default_factory=list)
    #: What ``better`` and ``worse`` compare per document: "flips" (0/1 metrics), "value",
    #: "loglikelihood" (corpus metrics' (log-likelihood, length) pairs), or "" (nothing to
    #: compare one document by: only the corpus has a value).
    moved: str = ""

    @property
    def significant(self) -> bool:
        """Whether the paired test rejects "no difference" at the 5% level."""
        return self.p_value < ALPHA


@dataclass(frozen=True)
class Comparison:
    """Two evaluations compared, metric by metric (``b - a``)."""

    a: str
    b: str
    iterations: int
    seed: int
    metrics: list[MetricComparison]
    #: Tasks only one of the two evaluated (not compared).
    unpaired_tasks: dict[str, list[str]]
    #: What tells the two apart beside their labels (:func:`distinctions`): setting -> [a, b].
    differs: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain data: what ``GET /compare`` answers and ``rayeval compare --json`` prints.
        JSON has no NaN or infinity: such a value (a perplexity that overflowed) is null."""
        rows = []
        for metric in self.metrics:
            row = {key: _finite(value) for key, value in asdict(metric).items()}
            row["significant"] = metric.significant
            row["flipped"] = {"better": len(metric.better), "worse": len(metric.worse)}
            rows.append(row)
        return {
            "a": self.a,
            "b": self.b,
            "difference": "b - a",
            "confidence": 0.95,
            "iterations": self.iterations,
            "seed": self.seed,
            "metrics": rows,
            "unpaired_tasks": self.unpaired_tasks,
            "differs": self.differs,
        }


def compare(
    a: EvaluationSamples,
    b: EvaluationSamples,
    iterations: int = DEFAULT_ITERATIONS,
    seed: int = DEFAULT_SEED,
) -> Comparison:
    """Pair two evaluations' samples by task, filter and document, and compare every metric.

    Raises:
        IncomparableError: no task in common, or a task whose documents or few-shot settings
            differ (the message names the task and what differs).
    """
    common = sorted(set(a.samples) & set(b.samples))
    if not common:
        raise IncomparableError(
            f"{a.label} and {b.label} logged samples for no common task ({sorted(a.samples)} vs "
            f"{sorted(b.samples)}): compare evaluations of the same tasks, run with log_samples"
        )
    for task in common:
        _check_fewshot(task, a, b)
    metrics = []
    for task in common:
        pairs = _pair_documents(task, a, b)
        for (metric, filter_), docs in _metric_values(task, a, pairs).items():
            # Each metric its own stream: adding a task changes no other metric's interval.
            stream = zlib.crc32(f"{task}/{metric}/{filter_}".encode())
            rng = np.random.default_rng([seed, stream])
            metrics.append(_compare_metric(task, metric, filter_, docs, a, b, rng, iterations))
    unpaired = {
        a.label: sorted(set(a.samples) - set(b.samples)),
        b.label: sorted(set(b.samples) - set(a.samples)),
    }
    differs = distinctions(a.results, b.results)
    return Comparison(a.label, b.label, iterations, seed, metrics, unpaired, differs)


def settings_of(results: Mapping[str, Any]) -> dict[str, str]:
    """What an evaluation ran with, read from lm-eval's results JSON (its ``config``, where
    rayeval records the dtype and the layout, and ``n-shot``): model, checkpoint, dtype, layout,
    few-shot, limit, batch size."""
    config = results.get("config") or {}
    args = config.get("model_args") or {}
    if isinstance(args, str):  # lm-eval's "key=value,key=value" form
        args = dict(item.split("=", 1) for item in args.split(",") if "=" in item)
    layout = config.get("rayeval_layout") or {}
    shape = ""
    if layout:
        shape = f"{layout.get('num_replicas')}x{layout.get('shard_size')} {layout.get('device')}"
        if layout.get("shard_strategy"):
            shape += f" {layout['shard_strategy']}"
    shots = sorted({str(n) for n in (results.get("n-shot") or {}).values()})
    settings = {
        "model": str(args.get("pretrained", config.get("model", ""))),
        "checkpoint": str(args.get("checkpoint", "")),
        "dtype": str(config.get("model_dtype") or args.get("dtype", "")).removeprefix("torch."),
        "layout": shape,
        "few-shot": "/".join(shots),
        "limit": str(config.get("limit") if config.get("limit") is not None else ""),
        "batch size": str(config.get("batch_size", "")),
    }
    return {key: value for key, value in settings.items() if value}


def distinctions(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, list[str]]:
    """The settings (:func:`settings_of`) in which two results files differ: name -> [a, b]
    (a setting one of them lacks reads ``?``)."""
    first, second = settings_of(a), settings_of(b)
    return {
        key: [first.get(key, "?"), second.get(key, "?")]
        for key in dict.fromkeys([*first, *second])
        if first.get(key) != second.get(key)
    }


# --------------------------------------------------------------------------------- pairing
def _check_fewshot(task: str, a: EvaluationSamples, b: EvaluationSamples) -> None:
    """The few-shot settings of ``task`` must be the same in both evaluations."""
    shots = (a.results.get("n-shot", {}).get(task), b.results.get("n-shot", {}).get(task))
    if shots[0] != shots[1]:
        raise IncomparableError(
            f"task {task}: {a.label} ran {shots[0]}-shot, {b.label} {shots[1]}-shot; few-shot "
            "settings differ, so their documents' prompts do: compare runs with one "
            f"{config_field('num_fewshot')}"
        )
    for what in ("fewshot_config", "fewshot_delimiter", "target_delimiter"):
        values = [e.results.get("configs", {}).get(task, {}).get(what) for e in (a, b)]
        if values[0] != values[1]:
            raise IncomparableError(f"task {task}: {what} differs ({values[0]!r} vs {values[1]!r})")
    seeds = [e.results.get("config", {}).get("fewshot_seed") for e in (a, b)]
    if shots[0] and seeds[0] != seeds[1]:
        raise IncomparableError(
            f"task {task}: few-shot examples drawn with seed {seeds[0]} in {a.label} and "
            f"{seeds[1]} in {b.label}: compare runs with the same {config_field('seed')}"
        )


def _pair_documents(
    task: str, a: EvaluationSamples, b: EvaluationSamples
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """The samples of ``task`` paired by (filter, document); the documents must be the same."""
    by_key = [{(s.get("filter", "none"), s["doc_id"]): s for s in e.samples[task]} for e in (a, b)]
    if by_key[0].keys() != by_key[1].keys():
        only_a = _in_order(by_key[0].keys() - by_key[1].keys())
        only_b = _in_order(by_key[1].keys() - by_key[0].keys())
        raise IncomparableError(
            f"task {task}: the evaluations scored other documents ({len(only_a)} only in "
            f"{a.label}, {len(only_b)} only in {b.label}; e.g. {(only_a or only_b)[0]}): compare "
            "runs with the same limit/samples"
        )
    pairs = []
    for key in _in_order(by_key[0]):
        first, second = by_key[0][key], by_key[1][key]
        if first.get("doc_hash") != second.get("doc_hash"):
            raise IncomparableError(
                f"task {task}: document {key[1]} is not the same document in both evaluations "
                "(its hash differs): the task's data changed between them"
            )
        pairs.append((first, second))
    return pairs


def _in_order(keys: Any) -> list[Any]:
    """(filter, document id) keys in document order (lm-eval's ids are integers)."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=str)


def _metric_values(
    task: str, a: EvaluationSamples, pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]
) -> dict[tuple[str, str], list[tuple[Any, Any, Any]]]:
    """Per (metric, filter): per document, (doc id, value in A, value in B)."""
    values: dict[tuple[str, str], list[tuple[Any, Any, Any]]] = {}
    for first, second in pairs:
        for metric in first.get("metrics") or ():
            if metric in first and metric in second:
                key = (metric, first.get("filter", "none"))
                values.setdefault(key, []).append((first["doc_id"], first[metric], second[metric]))
    return values


# ------------------------------------------------------------------------------- statistics
def _compare_metric(
    task: str,
    metric: str,
    filter_: str,
    docs: list[tuple[Any, Any, Any]],
    a: EvaluationSamples,
    b: EvaluationSamples,
    rng: np.random.Generator,
    iterations: int,
) -> MetricComparison:
    aggregate = aggregation(a.results, task, metric)
    values_a = [value for _, value, _ in docs]
    values_b = [value for _, _, value in docs]
    score_a, score_b = float(aggregate(values_a)), float(aggregate(values_b))
    difference = score_b - score_a
    diffs = paired_bootstrap(values_a, values_b, aggregate, rng, iterations)
    interval = (float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))
    binary = _is_binary(values_a) and _is_binary(values_b)
    moved, score = _document_score(values_a + values_b, binary)
    better = [doc for doc, x, y in docs if score(y) > score(x)] if moved else []
    worse = [doc for doc, x, y in docs if score(y) < score(x)] if moved else []
    if binary:
        p_value, test = mcnemar_exact(len(worse), len(better)), "mcnemar"
    else:
        p_value = sign_flip_p_value(values_a, values_b, aggregate, rng, iterations)
        test = "sign-flip permutation"
    return MetricComparison(
        task=task,
        metric=metric,
        filter=filter_,
        documents=len(docs),
        a=score_a,
        b=score_b,
        difference=difference,
        paired_interval=interval,
        p_value=p_value,
        test=test,
        unpaired_interval=_unpaired(difference, task, metric, filter_, a, b, values_a, values_b),
        higher_is_better=a.results.get("higher_is_better", {}).get(task, {}).get(metric),
        better=better,
        worse=worse,
        moved=moved,
    )


def _document_score(values: Sequence[Any], binary: bool) -> tuple[str, Callable[[Any], float]]:
    """What one document's values can be compared by (see ``MetricComparison.moved``), and how
    to read it from a value."""
    if _scalar(values):
        return ("flips" if binary else "value"), _number
    pairs = all(
        isinstance(v, list | tuple) and len(v) == 2 and _scalar(v) for v in values
    )  # lm-eval's weighted_perplexity and bits_per_byte items: (log-likelihood, words or bytes)
    if pairs:
        return "loglikelihood", lambda pair: float(pair[0])
    return "", _number


def aggregation(results: Mapping[str, Any], task: str, metric: str) -> Callable[[list[Any]], float]:
    """lm-eval's aggregation of ``metric`` in ``task``: the one the task config names, else the
    metric's registered default (``perplexity`` -> ``perplexity``, ``acc`` -> ``mean``, ...)."""
    from lm_eval.api import registry

    for entry in results.get("configs", {}).get(task, {}).get("metric_list") or ():
        if entry.get("metric") == metric and isinstance(entry.get("aggregation"), str):
            return registry.get_aggregation(entry["aggregation"])
    found = registry.get_metric_aggregation(metric)
    if found is None:
        raise IncomparableError(f"task {task}: no aggregation known for metric {metric!r}")
    return found


def paired_bootstrap(
    values_a: Sequence[Any],
    values_b: Sequence[Any],
    aggregate: Callable[[list[Any]], float],
    rng: np.random.Generator,
    iterations: int,
) -> np.ndarray:
    """``aggregate(B) - aggregate(A)`` over ``iterations`` resamples of the documents (the same
    documents drawn for A and B: the pairing)."""
    n = len(values_a)
    picks = rng.integers(0, n, size=(iterations, n))
    if _scalar(values_a) and getattr(aggregate, "__name__", "") == "mean":
        array_a = np.asarray(values_a, dtype=float)
        array_b = np.asarray(values_b, dtype=float)
        return array_b[picks].mean(axis=1) - array_a[picks].mean(axis=1)
    return np.array(
        [
            float(aggregate([values_b[i] for i in row]))
            - float(aggregate([values_a[i] for i in row]))
            for row in picks
        ]
    )


def sign_flip_p_value(
    values_a: Sequence[Any],
    values_b: Sequence[Any],
    aggregate: Callable[[list[Any]], float],
    rng: np.random.Generator,
    iterations: int,
) -> float:
    """Two-sided p-value of "A and B are exchangeable within each document": the paired
    permutation test (``scipy.stats.permutation_test``, ``permutation_type="samples"``) of
    ``aggregate(B) - aggregate(A)``, each document's two values swapped at random (every
    assignment once when there are at most ``iterations``)."""
    n = len(values_a)
    if n == 0:
        return 1.0
    statistic: Callable[..., Any]
    if _scalar(values_a) and getattr(aggregate, "__name__", "") == "mean":
        pooled = np.asarray([*map(float, values_a), *map(float, values_b)])

        def statistic(x: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
            return pooled[y].mean(axis=axis) - pooled[x].mean(axis=axis)

        vectorized = True
    else:  # lm-eval's own aggregation of the documents each side got
        items = [*values_a, *values_b]

        def statistic(x: np.ndarray, y: np.ndarray) -> float:
            return float(aggregate([items[i] for i in y])) - float(aggregate([items[i] for i in x]))

        vectorized = False
    result = stats.permutation_test(
        (np.arange(n), np.arange(n, 2 * n)),
        statistic,
        permutation_type="samples",
        vectorized=vectorized,
        n_resamples=iterations,
        alternative="two-sided",
        rng=rng,
    )
    return min(1.0, float(result.pvalue))


def mcnemar_exact(worse: int, better: int) -> float:
    """McNemar's exact two-sided test: of the documents that flipped, are flips one way as
    likely as the other? (``scipy.stats.binomtest`` of ``worse`` of ``worse + better`` at 1/2)"""
    flips = worse + better
    if flips == 0:
        return 1.0
    return float(stats.binomtest(worse, flips, 0.5).pvalue)


def _unpaired(
    difference: float,
    task: str,
    metric: str,
    filter_: str,
    a: EvaluationSamples,
    b: EvaluationSamples,
    values_a: Sequence[Any],
    values_b: Sequence[Any],
) -> tuple[float, float] | None:
    """The interval an unpaired reading gives: each run's own stderr, as if independent."""
    errors = []
    for evaluation, values in ((a, values_a), (b, values_b)):
        reported = (
            evaluation.results.get("results", {}).get(task, {}).get(f"{metric}_stderr,{filter_}")
        )
        if isinstance(reported, int | float):
            errors.append(float(reported))
        elif _scalar(values) and len(values) > 1:
            errors.append(float(np.std(np.asarray(values, float), ddof=1) / math.sqrt(len(values))))
        else:
            return None
    half = Z_95 * math.sqrt(errors[0] ** 2 + errors[1] ** 2)
    return (difference - half, difference + half)


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats (also inside tuples and lists) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, tuple | list):
        return [_finite(item) for item in value]
    return value


def _scalar(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) for v in values)


def _number(value: Any) -> float:
    return float(value)


def _is_binary(values: Sequence[Any]) -> bool:
    return _scalar(values) and all(float(v) in (0.0, 1.0) for v in values)
