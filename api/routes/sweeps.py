"""A checkpoint sweep's (or watch's) results: ``/evaluations/{id}/sweep`` and each checkpoint's
lm-eval files under ``/evaluations/{id}/checkpoints/{label}/``.

The summary is the form of ``sweep.json`` that ``rayeval run --checkpoints`` writes
(:class:`rayeval.service.engine.sweep_summary.SweepSummary`), built from the checkpoints stored
so far, so it is there while the sweep runs; each record adds ``links`` to its files. The files are
lm-eval's, verbatim, as ``GET /evaluations/{id}/results`` serves a single evaluation's. Access is
the evaluation's: another user's sweep answers 404 as an unknown id would.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Response

from rayeval.api.deps import CallerDep, StoreDep, require_token
from rayeval.api.schemas import EVALUATION_ERRORS
from rayeval.service.engine.sweep_summary import CheckpointRecord, SweepSummary, table
from rayeval.service.jobs.accounts import check_access
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore
from rayeval.service.jobs.sweep_results import StoredCheckpoint
from rayeval.service.vocabulary.errors import EvaluationNotFoundError

router = APIRouter(
    prefix="/evaluations",
    tags=["sweeps"],
    dependencies=[Depends(require_token)],
    responses=EVALUATION_ERRORS,
)


@router.get(
    "/{evaluation_id}/sweep",
    responses={
        200: {
            "content": {"application/json": {}, "text/plain": {}},
            "description": "The sweep's summary (JSON), or its plain-text table",
        }
    },
    summary="A checkpoint sweep's summary: per checkpoint its step, outcome and metrics",
)
def get_sweep(
    evaluation_id: str,
    store: StoreDep,
    caller: CallerDep,
    format: Annotated[
        Literal["json", "text"], Query(description="json: the summary; text: a table.")
    ] = "json",
) -> Response:
    """The sweep so far: its model and tasks, and per checkpoint that ended (in the order they
    ended) its step, status, lm-eval metrics, timings and links to its results and samples.

    404 for an evaluation that is not a sweep or watch.
    """
    record = _sweep_record(store, evaluation_id, caller)
    stored = store.sweeps.checkpoints(evaluation_id)
    if format == "text":
        return Response(content=table(_summary(record, stored)) + "\n", media_type="text/plain")
    data = _summary(record, []).to_json()  # its kind, model and tasks
    data["checkpoints"] = [_with_links(evaluation_id, checkpoint) for checkpoint in stored]
    return Response(content=_json(data), media_type="application/json")


@router.get(
    "/{evaluation_id}/checkpoints/{label}/results",
    responses={200: {"content": {"application/json": {}}, "description": "lm-eval's results"}},
    summary="One checkpoint's lm-eval results JSON",
)
def get_checkpoint_results(
    evaluation_id: str, label: str, store: StoreDep, caller: CallerDep
) -> Response:
    """The checkpoint's results file exactly as lm-eval writes it.

    404 for a checkpoint the sweep has no results of (not reached yet, refused, failed).
    """
    _sweep_record(store, evaluation_id, caller)
    results_json = store.sweeps.results_json(evaluation_id, label)
    if results_json is None:
        raise EvaluationNotFoundError(_no_checkpoint(evaluation_id, label))
    return Response(content=results_json, media_type="application/json")


@router.get(
    "/{evaluation_id}/checkpoints/{label}/samples/{task}",
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "lm-eval's samples"}},
    summary="One checkpoint's samples of one task, as JSONL",
)
def get_checkpoint_samples(
    evaluation_id: str, label: str, task: str, store: StoreDep, caller: CallerDep
) -> Response:
    """The checkpoint's samples file of ``task`` exactly as lm-eval writes it (with
    ``log_samples``). 404 when there is none."""
    record = _sweep_record(store, evaluation_id, caller)
    jsonl = store.sweeps.samples_jsonl(evaluation_id, label, task)
    if jsonl is None:
        hint = (
            f"tasks with samples are listed in its links at /evaluations/{evaluation_id}/sweep"
            if record.config.log_samples
            else 'it was submitted without log_samples: resubmit with "log_samples": true'
        )
        raise EvaluationNotFoundError(
            f"checkpoint {label!r} of evaluation {evaluation_id} has no samples of {task!r}: {hint}"
        )
    return Response(content=jsonl, media_type="application/x-ndjson")


def _sweep_record(store: EvaluationStore, evaluation_id: str, caller: Any) -> EvaluationRecord:
    record = check_access(store.get(evaluation_id), caller)
    if record.config.sweep is None:
        raise EvaluationNotFoundError(
            f"evaluation {evaluation_id} is not a checkpoint sweep: its results are at "
            f"/evaluations/{evaluation_id}/results"
        )
    return record


def _summary(record: EvaluationRecord, stored: list[StoredCheckpoint]) -> SweepSummary:
    config = record.config
    return SweepSummary(
        model=config.pretrained,
        tasks=list(config.tasks),
        checkpoints=[CheckpointRecord(**checkpoint.record) for checkpoint in stored],
    )


def _with_links(evaluation_id: str, checkpoint: StoredCheckpoint) -> dict[str, Any]:
    data = dict(checkpoint.record)
    if checkpoint.has_results:
        base = f"/evaluations/{evaluation_id}/checkpoints/{quote(str(data['label']), safe='')}"
        samples = {
            task: f"{base}/samples/{quote(task, safe='')}" for task in checkpoint.sample_tasks
        }
        data["links"] = {"results": f"{base}/results", "samples": samples}
    return data


def _no_checkpoint(evaluation_id: str, label: str) -> str:
    return (
        f"evaluation {evaluation_id} has no results of a checkpoint {label!r} (not evaluated yet, "
        f"refused or failed): its checkpoints are listed at /evaluations/{evaluation_id}/sweep"
    )


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, default=str)
