"""``/compare``: are two evaluations' differences real? A paired comparison, document by document.

Both evaluations' results and samples are read from the store and handed to
:func:`rayeval.service.comparison.compare`, whose JSON is the answer (``rayeval compare --json``
prints the same object). 404 for an unknown id, 409 for an evaluation that has not succeeded,
422 naming why two evaluations cannot be paired (other documents or few-shot settings, no common
task, or samples not logged).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from rayeval.api.deps import CallerDep, StoreDep, require_token
from rayeval.api.schemas import EVALUATION_ERRORS, ErrorBody
from rayeval.service.comparison import EvaluationSamples, IncomparableError, compare
from rayeval.service.jobs.accounts import Principal, check_access
from rayeval.service.jobs.store import EvaluationStore
from rayeval.service.result_files import parse_samples
from rayeval.service.vocabulary.errors import EvaluationStateError
from rayeval.service.vocabulary.states import EvaluationStatus

router = APIRouter(
    tags=["evaluations"],
    dependencies=[Depends(require_token)],
    responses={**EVALUATION_ERRORS, 409: {"model": ErrorBody}},
)


class Flipped(BaseModel):
    """How many documents moved each way."""

    better: int
    worse: int


class MetricDifference(BaseModel):
    """One metric of one task, compared (``b - a``)."""

    task: str
    metric: str
    filter: str
    documents: int = Field(description="Documents paired.")
    a: float | None
    b: float | None
    difference: float | None = Field(description="b - a of lm-eval's aggregate.")
    paired_interval: tuple[float | None, float | None] = Field(
        description="95% percentile bootstrap interval of the difference, documents resampled "
        "in pairs (seeded)."
    )
    p_value: float | None
    test: str = Field(description='"mcnemar" (0/1 metrics, exact) or "sign-flip permutation".')
    unpaired_interval: tuple[float | None, float | None] | None = Field(
        description="The interval each run's own stderr gives, as if independent (null: no stderr)."
    )
    higher_is_better: bool | None
    better: list[Any] = Field(
        description="Documents (ids) B got right and A wrong; other metrics: whose value (see "
        "moved) rose."
    )
    worse: list[Any] = Field(description="The reverse.")
    moved: str = Field(
        description='What better and worse compare per document: "flips" (0/1 metrics), '
        '"value", "loglikelihood" (perplexities and bits per byte: each document\'s '
        'log-likelihood), or "" (the metric has no value per document).'
    )
    significant: bool = Field(description="p_value < 0.05.")
    flipped: Flipped


class ComparisonPublic(BaseModel):
    """Two evaluations compared metric by metric; null where a value is not finite."""

    a: str
    b: str
    difference: str = Field(description='Always "b - a".')
    confidence: float
    iterations: int = Field(description="Bootstrap resamples.")
    seed: int
    metrics: list[MetricDifference]
    unpaired_tasks: dict[str, list[str]] = Field(
        description="Per evaluation, the tasks with samples only it has (not compared)."
    )
    differs: dict[str, list[str]] = Field(
        default_factory=dict,
        description="What tells the two apart beside their ids: setting (dtype, layout, "
        "few-shot, ...) -> [a's, b's]; empty when they ran alike.",
    )


@router.get("/compare", response_model=ComparisonPublic, summary="Paired comparison of two")
def compare_evaluations(
    store: StoreDep,
    caller: CallerDep,
    a: Annotated[str, Query(max_length=200, description="The first evaluation's id.")],
    b: Annotated[str, Query(max_length=200, description="The second; differences are b - a.")],
) -> dict[str, Any]:
    """Per task and metric: the difference, its paired 95% interval and p-value (McNemar's exact
    test for 0/1 metrics, a paired sign-flip permutation test otherwise), the unpaired interval
    beside it, and the documents that moved each way (their samples:
    ``/evaluations/{id}/samples/{task}?doc_id=``).

    404: an unknown id, or another user's evaluation for a member. 409: an evaluation that has
    not succeeded. 422: the two cannot be paired (the reason is named), or one was run without
    ``log_samples``.
    """
    return compare(
        evaluation_samples(store, a, caller), evaluation_samples(store, b, caller)
    ).to_json()


def evaluation_samples(
    store: EvaluationStore, evaluation_id: str, caller: Principal
) -> EvaluationSamples:
    """A succeeded evaluation's results and samples, as a comparison reads them.

    Raises:
        EvaluationNotFoundError: unknown id, or one ``caller`` may not see.
        EvaluationStateError: the evaluation has not succeeded.
        IncomparableError: it has no samples (submitted without ``log_samples``), or it is a
            checkpoint sweep.
    """
    record = check_access(store.get(evaluation_id), caller)
    if record.config.sweep is not None:
        raise IncomparableError(
            f"evaluation {evaluation_id} is a checkpoint sweep: compare single evaluations; its "
            f"checkpoints' results are at /evaluations/{evaluation_id}/sweep"
        )
    stored = store.results_json(evaluation_id)
    if record.status is not EvaluationStatus.SUCCEEDED or stored is None:
        raise EvaluationStateError(
            f"evaluation {evaluation_id} is {record.status.value}: only evaluations that "
            "succeeded can be compared"
        )
    samples = {}
    for task in store.sample_tasks([evaluation_id])[evaluation_id]:
        jsonl = store.samples_jsonl(evaluation_id, task)
        if jsonl is not None:
            samples[task] = parse_samples(jsonl)
    if not samples:
        raise IncomparableError(
            f"evaluation {evaluation_id} has no samples (it was submitted without log_samples), "
            'and a comparison pairs documents: resubmit it with "log_samples": true'
        )
    return EvaluationSamples(evaluation_id, json.loads(stored[0]), samples)
