"""``/evaluations``: submit, list, inspect, stream, fetch results and samples, cancel.

Handlers are thin: they call the manager or the store and shape the answer. Each acts for the
caller (``CallerDep``): a member lists and reads only their own evaluations, and another user's
answers 404 as an unknown id would; viewers read everything; only admins and owners cancel or
retry. They raise domain
errors (``RayEvalError`` subclasses), which ``rayeval.api.app`` turns into HTTP statuses; only
HTTP-only problems (a malformed Last-Event-ID header) are raised as ``HTTPException`` here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from rayeval.api.deps import (
    CallerDep,
    FeedDep,
    ManagerDep,
    SettingsDep,
    StoreDep,
    ViewsDep,
    require_token,
)
from rayeval.api.schemas import (
    EVALUATION_ERRORS,
    ErrorBody,
    EvaluationCreate,
    EvaluationList,
    EvaluationPublic,
    Links,
    ProgressPublic,
    Throughput,
)
from rayeval.api.views import EventFeed
from rayeval.service.jobs.accounts import check_access
from rayeval.service.jobs.manager import EvaluationManager
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore, EventRecord
from rayeval.service.vocabulary.errors import (
    EvaluationNotFoundError,
    EvaluationStateError,
    unknown_evaluation,
)
from rayeval.service.vocabulary.events import StateEvent
from rayeval.service.vocabulary.states import ACTIVE_STATUSES, EvaluationStatus, EventKind

router = APIRouter(
    prefix="/evaluations",
    tags=["evaluations"],
    dependencies=[Depends(require_token)],
    responses=EVALUATION_ERRORS,
)
_ERRORS: dict[int | str, dict[str, Any]] = {403: {"model": ErrorBody}, 409: {"model": ErrorBody}}
#: Longest an event stream goes without reading the database (writes by another process).
_RECHECK_S = 5.0
#: Largest event number or offset a request may name (SQLite integers stop at 2**63 - 1).
MAX_SEQ = 2**53


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=EvaluationPublic,
    responses={**_ERRORS, 503: {"model": ErrorBody}},
    summary="Submit an evaluation",
)
def create_evaluation(
    body: EvaluationCreate,
    manager: ManagerDep,
    store: StoreDep,
    response: Response,
    caller: CallerDep,
) -> EvaluationPublic:
    """Validate and queue an evaluation as the caller's; it starts when the cluster has room
    (each user's queue served in turn, by priority within it).

    403: the caller is a viewer. 422: unknown tasks, missing model path, bad options, a layout
    larger than the cluster or than the caller's cap. 503: lm-eval's task index is still being
    built (retry shortly).
    """
    record = manager.submit(body, caller)
    response.headers["Location"] = _url(record.id)
    return _public(record, store, manager)


@router.get("", response_model=EvaluationList, summary="List evaluations, newest first")
def list_evaluations(
    store: StoreDep,
    manager: ManagerDep,
    caller: CallerDep,
    status_: Annotated[
        list[EvaluationStatus] | None,
        Query(alias="status", description="Only these states (repeat for several)."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
) -> EvaluationList:
    """A page of evaluations the caller sees (a member: their own), newest first, optionally
    only those in the given states."""
    owner = None if caller.sees_everything else caller.name
    records, total = store.page(statuses=status_, limit=limit, offset=offset, owner=owner)
    samples = store.sample_tasks([r.id for r in records])
    items = [
        _public(r, store, manager, sample_tasks=samples[r.id], with_stats=False) for r in records
    ]
    return EvaluationList(items=items, total=total, limit=limit, offset=offset)


@router.get("/{evaluation_id}", response_model=EvaluationPublic, summary="One evaluation")
async def get_evaluation(evaluation_id: str, views: ViewsDep, caller: CallerDep) -> Response:
    """State, progress per request type, throughput, timestamps and error of an evaluation."""
    rendered = views.cached(evaluation_id)
    if rendered is None:
        rendered = await asyncio.wrap_future(views.render(evaluation_id))
    if not caller.sees(rendered.owner):
        raise unknown_evaluation(evaluation_id)
    return Response(content=rendered.answer, media_type="application/json")


def public_json(
    store: EvaluationStore, manager: EvaluationManager
) -> Callable[[EvaluationRecord], bytes]:
    """How :class:`rayeval.api.views.EvaluationViews` renders ``GET /evaluations/{id}``."""

    def build(record: EvaluationRecord) -> bytes:
        return _public(record, store, manager).model_dump_json(by_alias=True).encode()

    return build


@router.get(
    "/{evaluation_id}/results",
    responses={
        200: {"content": {"application/json": {}}, "description": "lm-eval's results JSON"},
        **_ERRORS,
    },
    summary="lm-eval's results JSON",
)
def get_results(evaluation_id: str, store: StoreDep, caller: CallerDep) -> Response:
    """The results file exactly as lm-eval writes it (``results_<timestamp>.json``).

    409 while the evaluation has not succeeded.
    """
    record = check_access(store.get(evaluation_id), caller)
    stored = store.results_json(evaluation_id)
    if stored is None:
        raise EvaluationStateError(_no_results(record))
    return Response(content=stored[0], media_type="application/json")


@router.get(
    "/{evaluation_id}/samples/{task}",
    responses={
        200: {"content": {"application/x-ndjson": {}}, "description": "lm-eval's samples JSONL"},
        **_ERRORS,
    },
    summary="One task's samples as JSONL",
)
def get_samples(
    evaluation_id: str,
    task: str,
    store: StoreDep,
    caller: CallerDep,
    doc_id: Annotated[
        int | None,
        Query(ge=0, le=MAX_SEQ, description="Only this document's lines (one per filter)."),
    ] = None,
) -> Response:
    """The task's samples file exactly as lm-eval writes it with ``--log_samples`` (with
    ``doc_id``: only that document's lines, as they are in the file).

    409 while the evaluation has not succeeded; 404 for a task without samples, or a document
    the task does not have.
    """
    record = check_access(store.get(evaluation_id), caller)
    if record.status is not EvaluationStatus.SUCCEEDED:
        raise EvaluationStateError(_no_results(record))
    jsonl = store.samples_jsonl(evaluation_id, task)
    if jsonl is None:
        tasks = store.sample_tasks([evaluation_id])[evaluation_id]
        if not record.config.log_samples:
            hint = 'it was submitted without log_samples: resubmit with "log_samples": true'
        else:
            hint = f"tasks with samples: {tasks}"
        raise EvaluationNotFoundError(
            f"evaluation {evaluation_id} has no samples for {task!r}: {hint}"
        )
    if doc_id is not None:
        jsonl = _document_lines(jsonl, doc_id)
        if not jsonl:
            raise EvaluationNotFoundError(
                f"evaluation {evaluation_id} has no document {doc_id} in {task!r}: the task's "
                f"documents are listed at {_url(evaluation_id)}/samples/{task}"
            )
    return Response(content=jsonl, media_type="application/x-ndjson")


def _document_lines(jsonl: str, doc_id: int) -> str:
    """The lines of a samples file that belong to document ``doc_id``."""
    lines = [
        line
        for line in jsonl.splitlines()
        if line.strip() and json.loads(line).get("doc_id") == doc_id
    ]
    return "".join(f"{line}\n" for line in lines)


@router.get(
    "/{evaluation_id}/events",
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}},
    summary="Server-Sent Events of an evaluation",
)
async def stream_events(
    evaluation_id: str,
    request: Request,
    store: StoreDep,
    feed: FeedDep,
    settings: SettingsDep,
    caller: CallerDep,
    last_event_id: Annotated[
        str | None,
        Header(description="Resume after this event id (browsers send it when reconnecting)."),
    ] = None,
    after: Annotated[
        int | None,
        Query(ge=0, le=MAX_SEQ, description="Same as Last-Event-ID, for clients without headers."),
    ] = None,
) -> StreamingResponse:
    """Every event of the evaluation from the first one (or after Last-Event-ID), then live ones.

    Events: ``state`` (status changes, with the error on failure), ``progress`` (per request
    type, plus overall totals), ``warning`` (a task has loglikelihood requests whose tokens do
    not measure it: ``{task, counts, example}``; or an experiment tracker did not record the
    evaluation: ``{tracker, message}``), ``task_result`` (one per task and group,
    when the evaluation ends: lm-eval computes metrics for all tasks together), ``result``
    (lm-eval's results JSON).
    The stream ends after the terminal ``state`` event. Each event's id is its number.
    """
    seq = _resume_point(last_event_id, after)
    record = await asyncio.to_thread(store.get, evaluation_id)  # 404 before the stream starts
    check_access(record, caller)
    return StreamingResponse(
        _sse(
            store,
            feed,
            evaluation_id,
            seq,
            settings.poll_interval_s,
            settings.sse_heartbeat_s,
            settings.sse_max_stream_s,
            request,
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post(
    "/{evaluation_id}/retry",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=EvaluationPublic,
    responses={**_ERRORS, 503: {"model": ErrorBody}},
    summary="Retry a failed or cancelled evaluation",
)
def retry_evaluation(
    evaluation_id: str, manager: ManagerDep, store: StoreDep, response: Response, caller: CallerDep
) -> EvaluationPublic:
    """Queue the evaluation's request again, as a new evaluation (its id is in ``Location``).

    Answers the failed run already computed come from the server's response cache: only the
    rest is computed. 409 unless the evaluation failed or was cancelled.
    """
    record = manager.retry(evaluation_id, caller)
    response.headers["Location"] = _url(record.id)
    return _public(record, store, manager)


@router.delete(
    "/{evaluation_id}",
    response_model=EvaluationPublic,
    responses=_ERRORS,
    summary="Cancel an evaluation",
)
def cancel_evaluation(
    evaluation_id: str, manager: ManagerDep, store: StoreDep, caller: CallerDep
) -> EvaluationPublic:
    """Stop the evaluation and release its actors and placement group; returns it, cancelled.

    409 if it already ended.
    """
    return _public(manager.cancel(evaluation_id, caller), store, manager)


# ------------------------------------------------------------------------------ helpers
def _url(evaluation_id: str) -> str:
    return f"/evaluations/{evaluation_id}"


def _no_results(record: EvaluationRecord) -> str:
    if record.status.is_terminal:
        reason = f" ({record.error})" if record.error else ""
        return f"evaluation {record.id} {record.status.value}{reason}: it has no results"
    return (
        f"evaluation {record.id} is {record.status.value}: results exist once it has succeeded; "
        f"follow it with GET {_url(record.id)}/events"
    )


def _public(
    record: EvaluationRecord,
    store: EvaluationStore,
    manager: EvaluationManager,
    sample_tasks: list[str] | None = None,
    with_stats: bool = True,
) -> EvaluationPublic:
    if sample_tasks is None:
        sample_tasks = store.sample_tasks([record.id])[record.id]
    stats = None
    if with_stats and record.status is EvaluationStatus.SUCCEEDED:
        stats = store.stats(record.id)
    base, request = _url(record.id), record.config
    return EvaluationPublic(
        id=record.id,
        kind=request.sweep.kind if request.sweep is not None else "evaluation",
        owner=record.owner,
        status=record.status,
        queue_position=manager.queue_position(record),
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        error=record.error,
        progress=ProgressPublic.of(record.progress, record.status in ACTIVE_STATUSES),
        throughput=_throughput(record),
        stats=stats,
        request=request,
        links=Links.model_validate(
            {
                "self": base,
                "events": f"{base}/events",
                "results": f"{base}/results",
                "samples": {task: f"{base}/samples/{task}" for task in sample_tasks},
                "sweep": f"{base}/sweep" if request.sweep is not None else None,
            }
        ),
    )


def _throughput(record: EvaluationRecord) -> Throughput:
    current = record.progress.latest()
    # What the ranks computed: answers from the response cache are not a rate.
    done = sum(max(0, p.done - p.cached) for p in record.progress.phases.values())
    requests_per_s = None
    if record.started_at is not None and done:
        end = record.finished_at or datetime.now(UTC)
        elapsed = (end - record.started_at).total_seconds()
        requests_per_s = done / elapsed if elapsed > 0 else None
    return Throughput(
        tokens_per_s=current.tokens_per_s if current is not None else None,
        requests_per_s=requests_per_s,
    )


def _resume_point(last_event_id: str | None, after: int | None) -> int:
    if last_event_id is None or not last_event_id.strip():
        return after or 0
    try:
        seq = int(last_event_id)
    except ValueError:
        seq = -1
    if not 0 <= seq <= MAX_SEQ:
        raise HTTPException(
            status_code=422,
            detail=f"Last-Event-ID must be an event id (an integer from 0 to {MAX_SEQ}), got "
            f"{last_event_id!r}",
        )
    return seq


async def _sse(
    store: EvaluationStore,
    feed: EventFeed,
    evaluation_id: str,
    seq: int,
    poll_s: float,
    heartbeat_s: float,
    max_stream_s: float,
    request: Request,
) -> AsyncIterator[str]:
    """Stored events after ``seq``, then new ones as they are stored, until the terminal one.

    The database is read when this process's store has written the evaluation since the last
    read (an in-memory counter), and at least every ``_RECHECK_S`` (another writer), so idle
    streams cost no queries; the streams of one evaluation share each read (``feed``).
    """
    yield f"retry: {int(max(poll_s, 1.0) * 1000)}\n\n"
    started = last_sent = time.monotonic()
    seen, read_at = -1, 0.0
    delivered = False
    while time.monotonic() - started < max_stream_s:
        if await request.is_disconnected():
            return
        version = store.version(evaluation_id)
        if version == seen and time.monotonic() - read_at < _RECHECK_S:
            if time.monotonic() - last_sent >= heartbeat_s:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            await asyncio.sleep(poll_s)
            continue
        seen, read_at = version, time.monotonic()
        events = await asyncio.to_thread(feed.events_since, evaluation_id, seq)
        for event in events:
            yield await _format(store, evaluation_id, event)
            seq = event.seq
            if _is_terminal(event):
                return
        if events:
            last_sent = time.monotonic()
            delivered = True
            seen = -1  # read again at once: a page of events may not be all of them
            continue
        if not delivered:  # a stream that delivered events ends with the terminal one
            record = await asyncio.to_thread(store.get, evaluation_id)
            if record.status.is_terminal and seq >= record.last_event_seq:
                return  # resumed after the end: nothing more will come
        if time.monotonic() - last_sent >= heartbeat_s:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        await asyncio.sleep(poll_s)


async def _format(store: EvaluationStore, evaluation_id: str, event: EventRecord) -> str:
    data = json.dumps(event.data)
    if event.type is EventKind.RESULT:  # results are stored once, in their own table
        stored = await asyncio.to_thread(store.results_json, evaluation_id)
        data = json.dumps(json.loads(stored[0])) if stored is not None else "{}"
    return f"id: {event.seq}\nevent: {event.type.value}\ndata: {data}\n\n"


def _is_terminal(event: EventRecord) -> bool:
    if event.type is not EventKind.STATE:
        return False
    state = event.payload()
    return isinstance(state, StateEvent) and state.status.is_terminal
