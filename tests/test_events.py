"""The typed progress and events: each type survives JSON, and its JSON has the keys the service
wrote before the types existed (stored rows and clients read them). No Ray here."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rayeval.service.vocabulary.events import (
    RUNNER_EVENTS,
    EvaluationProgress,
    PhaseCounts,
    PhaseReport,
    Progress,
    ProgressEvent,
    RankMemory,
    ReplicaReuse,
    ReplicaWork,
    RequestWarning,
    ResultEvent,
    RunnerFailed,
    RunnerProgress,
    RunnerStage,
    RunnerStatus,
    RunnerSucceeded,
    RunnerWarning,
    RunOutputs,
    Stage,
    StageEvent,
    StageName,
    StateEvent,
    TaskResultEvent,
    WarningEvent,
    stream_event,
)
from rayeval.service.vocabulary.states import EvaluationStatus, EventKind

pytestmark = pytest.mark.unit

PROGRESS = Progress(
    phase="loglikelihood",
    done=6,
    total=10,
    tokens_per_s=120.5,
    real_token_fraction=0.75,
    seconds=2.5,
    cached=1,
    replicas={"0": ReplicaWork(requests=4, tokens=200, busy_s=1.5)},
    rank_memory={"0": [RankMemory(rss_mib=512.0, device_mib=0.0)]},
    load_s=3.0,
    startup_s=4.0,
)
PROGRESS_KEYS = {
    "phase",
    "done",
    "total",
    "tokens_per_s",
    "real_token_fraction",
    "seconds",
    "cached",
    "replicas",
    "rank_memory",
    "load_s",
    "startup_s",
}
REPORT = PhaseReport.of(PROGRESS, updated_at=1700000000.0)
STORED = EvaluationProgress(phases={"loglikelihood": REPORT})
WARNING = RequestWarning(
    task="demo_mc",
    counts={"empty_continuation": 2},
    example={"doc_id": 3, "context": "Q:", "continuation": ""},
)
OUTPUTS = RunOutputs(
    results_json='{"results": {}}',
    samples={"demo_mc": '{"doc_id": 0}\n'},
    stats={"loglikelihood": {"requests": 10, "replica_utilisation": {"0": 0.5}}},
    replicas=ReplicaReuse(reused=True, kept=False),
)

STAGE = Stage(name=StageName.BUILDING_REQUESTS, started_at=1700000000.0, ranks_ready=1, ranks=2)
STAGE_KEYS = {"name", "started_at", "ranks_ready", "ranks"}

#: Every type, one instance each, with the keys its JSON carries.
CASES: list[tuple[BaseModel, set[str]]] = [
    (ReplicaWork(requests=1, tokens=2, busy_s=0.5), {"requests", "tokens", "busy_s"}),
    (RankMemory(rss_mib=1.0, device_mib=2.0), {"rss_mib", "device_mib"}),
    (PROGRESS, PROGRESS_KEYS),
    (WARNING, {"task", "counts", "example"}),
    (REPORT, PROGRESS_KEYS | {"updated_at"}),
    (STORED, {"phases"}),
    (OUTPUTS, {"results_json", "samples", "stats", "replicas"}),
    (
        RunnerStatus(evaluation_id="b", owner="a", running=True, kept=False),
        {"evaluation_id", "owner", "running", "kept"},
    ),
    (StateEvent(status=EvaluationStatus.FAILED, error="boom"), {"status", "error"}),
    (
        StateEvent(status=EvaluationStatus.FAILED, error="boom", traceback="Traceback ..."),
        {"status", "error", "traceback"},
    ),
    (
        ProgressEvent.of_phase(REPORT, STORED),
        PROGRESS_KEYS | {"updated_at", "overall_done", "overall_total"},
    ),
    (WarningEvent.of_warning(WARNING), {"task", "counts", "example"}),
    (TaskResultEvent(task="demo_mc", metrics={"acc,none": 0.5}), {"task", "metrics"}),
    (ResultEvent(), set()),
    (STAGE, STAGE_KEYS),
    (StageEvent.of_stage(STAGE), STAGE_KEYS),
    (STORED.at_stage(STAGE), {"phases", "stage"}),
]


@pytest.mark.parametrize("value, keys", CASES, ids=[type(v).__name__ for v, _ in CASES])
def test_each_type_round_trips_through_json_with_its_keys(value: Any, keys: set[str]) -> None:
    text = json.dumps(value.dump())
    assert type(value).parse(json.loads(text)) == value
    assert set(json.loads(text)) == keys


def test_runner_events_round_trip_as_a_list() -> None:
    events = [
        RunnerProgress(seq=1, time=1.0, progress=PROGRESS),
        RunnerWarning(seq=2, time=2.0, warning=WARNING),
        RunnerSucceeded(seq=3, time=3.0, outputs=OUTPUTS),
        RunnerFailed(seq=4, time=4.0, error="ConfigError: no task", kind="ConfigError"),
        RunnerStage(seq=5, time=5.0, stage=STAGE),
    ]
    text = RUNNER_EVENTS.dump_json(events)
    assert RUNNER_EVENTS.validate_json(text) == events
    kinds = ["progress", "warning", "succeeded", "failed", "stage"]
    assert [e["type"] for e in json.loads(text)] == kinds


def test_stored_events_read_back_as_their_kind() -> None:
    for event in (
        StateEvent(status=EvaluationStatus.QUEUED),
        ProgressEvent.of_phase(REPORT, STORED),
        WarningEvent.of_warning(WARNING),
        TaskResultEvent(task="t", metrics={}),
        ResultEvent(),
        StageEvent.of_stage(STAGE),
    ):
        kind, data = event.stored()
        assert isinstance(kind, EventKind)
        assert stream_event(kind, json.loads(json.dumps(data))) == event


def test_the_json_is_what_the_service_wrote_before() -> None:
    """The exact stored forms of a state change, a progress event and stored progress."""
    assert StateEvent(status=EvaluationStatus.QUEUED).stored() == (
        EventKind.STATE,
        {"status": "queued", "error": None},
    )
    before = {
        "phase": "loglikelihood",
        "done": 6,
        "total": 10,
        "tokens_per_s": 120.5,
        "real_token_fraction": 0.75,
        "seconds": 2.5,
        "cached": 1,
        "replicas": {"0": {"requests": 4, "tokens": 200, "busy_s": 1.5}},
        "rank_memory": {"0": [{"rss_mib": 512.0, "device_mib": 0.0}]},
        "load_s": 3.0,
        "startup_s": 4.0,
        "updated_at": 1700000000.0,
    }
    assert STORED.dump() == {"phases": {"loglikelihood": before}}
    assert ProgressEvent.of_phase(REPORT, STORED).dump() == {
        **before,
        "overall_done": 6,
        "overall_total": 10,
    }


def test_stored_progress_sums_and_tolerates_other_versions() -> None:
    generate = PhaseReport.of(
        PROGRESS.model_copy(update={"phase": "generate_until", "done": 2, "total": 2}),
        updated_at=1700000001.0,
    )
    both = STORED.with_reports({"generate_until": generate})
    assert (both.done, both.total) == (8, 12)
    assert both.latest() == generate and not both.all_answered()
    assert EvaluationProgress().latest() is None and EvaluationProgress().all_answered()
    # A row written by another version: unknown keys are dropped, missing ones take defaults.
    row = {"phases": {"loglikelihood": {**REPORT.dump(), "future": 1}}, "other": {}}
    assert EvaluationProgress.parse(row) == STORED
    assert PhaseCounts.parse({"done": 1, "total": 2, "tokens_per_s": 0.0,
                              "real_token_fraction": 1.0}).seconds == 0.0  # fmt: skip
    # What the engine and the runner build refuses keys it does not know.
    with pytest.raises(ValidationError):
        Progress.parse({**PROGRESS.dump(), "tokens": 3})


def test_stages_say_what_is_waited_for() -> None:
    """The labels the status, the dashboard and the console show between batches."""

    def label(name: StageName, ready: int | None = None, ranks: int | None = None) -> str:
        return Stage(name=name, started_at=0.0, ranks_ready=ready, ranks=ranks).label

    assert label(StageName.PLACING, None, 4) == "placing 4 ranks"
    assert label(StageName.BUILDING_REQUESTS, 1, 2) == "building requests, 1/2 ranks loaded"
    assert label(StageName.BUILDING_REQUESTS) == "building requests"
    assert label(StageName.LOADING, 0, 2) == "0/2 ranks loaded"
    assert label(StageName.COMPUTING, 2, 2) == "computing"
    assert label(StageName.COMPUTING_METRICS, 2, 2) == "computing metrics"
    # A row stored before stages existed has none; a later version's stage keys are dropped.
    assert EvaluationProgress.parse(STORED.dump()).stage is None
    future = {**STORED.at_stage(STAGE).dump()}
    future["stage"] = {**future["stage"], "future": 1}
    assert EvaluationProgress.parse(future).stage == STAGE
    # A new stage is kept when request types move, and is not lost by a batch without one.
    moved = STORED.at_stage(STAGE).with_reports({"loglikelihood": REPORT}).at_stage(None)
    assert moved.stage == STAGE


def test_cached_answers_count_as_done_but_not_as_a_rate() -> None:
    counts = PhaseCounts(done=10, total=10, tokens_per_s=0.0, real_token_fraction=1.0,
                         seconds=2.0, cached=6)  # fmt: skip
    assert counts.requests_per_s == 2.0
    whole = counts.model_copy(update={"cached": 10, "seconds": 0.0})
    assert whole.requests_per_s == 0.0
