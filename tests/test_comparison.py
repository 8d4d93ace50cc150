"""Paired comparison statistics (service/comparison.py) against a direct computation."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import pytest
import scipy.stats

from rayeval.service.comparison import (
    EvaluationSamples,
    IncomparableError,
    compare,
)

pytestmark = pytest.mark.unit

DOCS = 300


def _evaluation(label: str, acc: list[float], loglik: list[float], **overrides: Any) -> Any:
    """A hand-made evaluation: a 0/1 task and a perplexity task over the same documents."""
    n_shot = overrides.pop("n_shot", 0)
    samples = {
        "t_acc": [
            {"doc_id": i, "filter": "none", "doc_hash": f"d{i}", "metrics": ["acc"], "acc": v}
            for i, v in enumerate(acc)
        ],
        "t_ppl": [
            {
                "doc_id": i,
                "filter": "none",
                "doc_hash": f"p{i}",
                "metrics": ["perplexity"],
                "perplexity": v,
            }
            for i, v in enumerate(loglik)
        ],
    }
    results = {
        "results": {
            "t_acc": {
                "acc,none": float(np.mean(acc)),
                "acc_stderr,none": float(np.std(acc, ddof=1) / math.sqrt(len(acc))),
            },
            "t_ppl": {
                "perplexity,none": math.exp(-np.mean(loglik)),
                "perplexity_stderr,none": 0.05,
            },
        },
        "configs": {
            "t_acc": {"metric_list": [{"metric": "acc", "aggregation": "mean"}]},
            "t_ppl": {"metric_list": [{"metric": "perplexity", "aggregation": "perplexity"}]},
        },
        "n-shot": {"t_acc": n_shot, "t_ppl": n_shot},
        "higher_is_better": {"t_acc": {"acc": True}, "t_ppl": {"perplexity": False}},
        "config": {"fewshot_seed": 1234},
    }
    for key, value in overrides.items():
        results[key] = value
    return EvaluationSamples(label, results, samples)


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    acc_a = (rng.random(DOCS) < 0.6).astype(float)
    acc_b = acc_a.copy()
    acc_b[rng.choice(np.flatnonzero(acc_a == 0), 30, replace=False)] = 1.0  # B fixes 30...
    acc_b[rng.choice(np.flatnonzero(acc_a == 1), 5, replace=False)] = 0.0  # ...and breaks 5
    ll_a = -rng.gamma(2.0, 1.0, DOCS)
    ll_b = ll_a + rng.normal(0.05, 0.1, DOCS)  # correlated with A: the same documents
    a = _evaluation("A", list(acc_a), list(ll_a))
    b = _evaluation("B", list(acc_b), list(ll_b))
    return a, b, acc_a, acc_b, ll_a, ll_b


def test_accuracy_difference_interval_and_mcnemar(pair: Any) -> None:
    a, b, acc_a, acc_b, _, _ = pair
    result = compare(a, b, iterations=4000, seed=7)
    (acc,) = [m for m in result.metrics if m.metric == "acc"]
    assert acc.a == pytest.approx(acc_a.mean()) and acc.b == pytest.approx(acc_b.mean())
    assert acc.difference == pytest.approx(acc_b.mean() - acc_a.mean())
    better = [i for i in range(DOCS) if acc_b[i] > acc_a[i]]
    worse = [i for i in range(DOCS) if acc_b[i] < acc_a[i]]
    assert acc.better == better and acc.worse == worse
    # McNemar's exact test is a binomial test of the flips.
    direct = scipy.stats.binomtest(min(len(better), len(worse)), len(better) + len(worse), 0.5)
    assert acc.test == "mcnemar" and acc.p_value == pytest.approx(direct.pvalue)
    assert acc.significant
    # The paired percentile interval: the same resamples computed directly...
    rng = np.random.default_rng([7, zlib.crc32(b"t_acc/acc/none")])
    picks = rng.integers(0, DOCS, size=(4000, DOCS))
    diffs = acc_b[picks].mean(axis=1) - acc_a[picks].mean(axis=1)
    assert acc.paired_interval == (np.percentile(diffs, 2.5), np.percentile(diffs, 97.5))
    # ...and close to scipy's own paired bootstrap.
    scipy_ci = scipy.stats.bootstrap(
        (acc_a, acc_b),
        lambda x, y: np.mean(y) - np.mean(x),
        paired=True,
        vectorized=False,
        n_resamples=4000,
        method="percentile",
        random_state=1,
    ).confidence_interval
    assert acc.paired_interval[0] == pytest.approx(scipy_ci.low, abs=0.01)
    assert acc.paired_interval[1] == pytest.approx(scipy_ci.high, abs=0.01)
    # Unpaired, from each file's stderr: wider, since it ignores that the documents are shared.
    assert acc.unpaired_interval is not None
    unpaired_width = acc.unpaired_interval[1] - acc.unpaired_interval[0]
    assert unpaired_width > 2 * (acc.paired_interval[1] - acc.paired_interval[0])


def test_perplexity_uses_lm_eval_aggregation_and_a_permutation_p_value(pair: Any) -> None:
    a, b, _, _, ll_a, ll_b = pair
    result = compare(a, b, iterations=2000, seed=7)
    (ppl,) = [m for m in result.metrics if m.metric == "perplexity"]
    assert ppl.a == pytest.approx(math.exp(-ll_a.mean()))
    assert ppl.b == pytest.approx(math.exp(-ll_b.mean()))
    rng = np.random.default_rng([7, zlib.crc32(b"t_ppl/perplexity/none")])
    picks = rng.integers(0, DOCS, size=(2000, DOCS))
    diffs = np.exp(-ll_b[picks].mean(axis=1)) - np.exp(-ll_a[picks].mean(axis=1))
    # B's documents are consistently likelier: no swap of A and B within documents comes near.
    assert ppl.test == "sign-flip permutation" and ppl.p_value < 0.001
    assert ppl.paired_interval[0] == pytest.approx(np.percentile(diffs, 2.5))
    assert ppl.higher_is_better is False
    assert ppl.unpaired_interval == pytest.approx(
        (ppl.difference - 1.959963984540054 * 0.05 * math.sqrt(2),
         ppl.difference + 1.959963984540054 * 0.05 * math.sqrt(2))
    )  # fmt: skip


def test_the_same_seed_gives_the_same_answer_and_identical_runs_no_difference(pair: Any) -> None:
    a, b, *_ = pair
    assert (
        compare(a, b, iterations=500, seed=3).to_json()
        == compare(a, b, iterations=500, seed=3).to_json()
    )
    same = compare(a, a, iterations=500)
    for metric in same.metrics:
        assert metric.difference == 0 and metric.p_value == 1.0 and not metric.significant
        assert metric.paired_interval == (0.0, 0.0) and not metric.better and not metric.worse


def test_refuses_to_pair_other_documents_or_few_shot_settings(pair: Any) -> None:
    a, _, acc_a, acc_b, ll_a, ll_b = pair
    with pytest.raises(IncomparableError, match="A ran 0-shot, B 5-shot"):
        compare(a, _evaluation("B", list(acc_b), list(ll_b), n_shot=5))
    fewer = _evaluation("B", list(acc_b[:-1]), list(ll_b))
    with pytest.raises(IncomparableError, match=r"task t_acc: the evaluations scored other doc"):
        compare(a, fewer)
    changed = _evaluation("B", list(acc_b), list(ll_b))
    changed.samples["t_acc"][3]["doc_hash"] = "another document"
    with pytest.raises(IncomparableError, match="document 3 is not the same document"):
        compare(a, changed)
    other_seed = _evaluation("B", list(acc_b), list(ll_b), n_shot=0)
    a_shots = _evaluation("A", list(acc_a), list(ll_a), n_shot=2)
    b_shots = _evaluation("B", list(acc_b), list(ll_b), n_shot=2, config={"fewshot_seed": 9})
    with pytest.raises(IncomparableError, match="seed 1234 in A and 9 in B"):
        compare(a_shots, b_shots)
    del other_seed.samples["t_acc"], other_seed.samples["t_ppl"]
    with pytest.raises(IncomparableError, match="no common task"):
        compare(a, other_seed)


def test_corpus_metrics_say_which_documents_moved_by_their_log_likelihood() -> None:
    """Perplexities keep a (log-likelihood, words) pair per document: the documents moved by
    that log-likelihood, not "+0/-0"; a metric with no number per document says n/a."""
    from rayeval.api.cli.compare import render

    loglik_a = [-10.0, -20.0, -30.0, -40.0]
    loglik_b = [-9.0, -21.0, -30.0, -35.0]

    def evaluation(label: str, loglik: list[float]) -> EvaluationSamples:
        samples = [
            {
                "doc_id": i,
                "filter": "none",
                "doc_hash": f"w{i}",
                "metrics": ["word_perplexity", "bleu"],
                "word_perplexity": [value, 5],
                "bleu": [f"reference {i}", f"prediction {label} {i}"],
            }
            for i, value in enumerate(loglik)
        ]
        aggregations = {"word_perplexity": "weighted_perplexity", "bleu": "bleu"}
        metric_list = [{"metric": m, "aggregation": agg} for m, agg in aggregations.items()]
        results = {
            "results": {"t_wiki": {"word_perplexity,none": 1.0, "bleu,none": 1.0}},
            "configs": {"t_wiki": {"metric_list": metric_list}},
            "n-shot": {"t_wiki": 0},
            "higher_is_better": {"t_wiki": {"word_perplexity": False, "bleu": True}},
            "config": {},
        }
        return EvaluationSamples(label, results, {"t_wiki": samples})

    result = compare(evaluation("A", loglik_a), evaluation("B", loglik_b), iterations=200)
    by_metric = {m.metric: m for m in result.metrics}
    perplexity = by_metric["word_perplexity"]
    assert perplexity.moved == "loglikelihood"
    assert perplexity.better == [0, 3] and perplexity.worse == [1]
    assert by_metric["bleu"].moved == "" and not by_metric["bleu"].better
    table = render(result.to_json())
    row = next(line for line in table.splitlines() if "word_perplexity" in line)
    assert row.rstrip(" |").endswith("+2/-1"), row
    assert (
        next(line for line in table.splitlines() if "| bleu" in line).rstrip(" |").endswith("n/a")
    )
    assert "documents whose log-likelihood rose (+) or fell (-)" in table


def test_the_permutation_p_value_is_exact_over_few_documents() -> None:
    # Six documents: every one of the 2**6 ways to swap A and B within documents is counted,
    # and the p-value is the share at least as far from zero as what was observed, two-sided.
    import itertools

    ll_a = np.array([-2.0, -1.5, -3.0, -2.5, -1.0, -2.2])
    ll_b = ll_a + np.array([0.4, 0.1, 0.3, -0.2, 0.5, 0.2])
    acc = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    result = compare(
        _evaluation("A", acc, list(ll_a)), _evaluation("B", acc, list(ll_b)), iterations=1000
    )
    (ppl,) = [m for m in result.metrics if m.metric == "perplexity"]

    def difference(a: np.ndarray, b: np.ndarray) -> float:
        return math.exp(-b.mean()) - math.exp(-a.mean())

    observed = difference(ll_a, ll_b)
    null = []
    for swaps in itertools.product((False, True), repeat=len(ll_a)):
        mask = np.array(swaps)
        null.append(difference(np.where(mask, ll_b, ll_a), np.where(mask, ll_a, ll_b)))
    at_most = np.mean(np.array(null) <= observed + 1e-12)
    at_least = np.mean(np.array(null) >= observed - 1e-12)
    assert ppl.p_value == pytest.approx(min(1.0, 2 * min(at_most, at_least)))
    assert 0.05 < ppl.p_value < 1.0


def test_two_runs_of_one_model_say_what_tells_them_apart(pair: Any) -> None:
    """float32 against bf16 (and another layout) of one model: the labels say which is which."""
    from rayeval.api.cli.compare import render

    a, b = pair[:2]

    def ran(dtype: str, replicas: int) -> dict[str, Any]:
        layout = {"num_replicas": replicas, "shard_size": 1, "device": "cpu"}
        config = {
            "model_args": f"pretrained=/m/tiny,dtype={dtype}",
            "model_dtype": f"torch.{dtype}",
        }
        return {**a.results, "config": {**config, "rayeval_layout": layout, "batch_size": "4"}}

    first = EvaluationSamples("A", ran("float32", 1), a.samples)
    second = EvaluationSamples("B", ran("bfloat16", 2), b.samples)
    answer = compare(first, second, iterations=100).to_json()
    assert answer["differs"] == {"dtype": ["float32", "bfloat16"], "layout": ["1x1 cpu", "2x1 cpu"]}
    lines = render(answer).splitlines()
    assert "  A: A (dtype float32, layout 1x1 cpu)" in lines
    assert "  B: B (dtype bfloat16, layout 2x1 cpu)" in lines
    assert compare(first, first, iterations=100).to_json()["differs"] == {}
