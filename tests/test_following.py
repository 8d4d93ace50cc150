"""Following an evaluation: what runner events become, and when the watchdog fails it (tables).

Pure functions over typed state, beside admission's plan: no Ray, no database here.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rayeval.service.jobs.following import (
    Watch,
    digest,
    stall_limit,
    stalled,
    task_results,
    unreachable,
    verdict,
    where_stopped,
)
from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.vocabulary.config import EvaluationConfig, TimeoutSettings
from rayeval.service.vocabulary.events import (
    EvaluationProgress,
    PhaseReport,
    Progress,
    ProgressEvent,
    RequestWarning,
    RunnerFailed,
    RunnerProgress,
    RunnerSucceeded,
    RunnerWarning,
    RunOutputs,
    WarningEvent,
)
from rayeval.service.vocabulary.states import EvaluationStatus

pytestmark = pytest.mark.unit

#: placement 10 + load 100 before the first batch, step 50 after; the server adds its 1000.
TIMEOUTS = TimeoutSettings(placement_s=10, load_s=100, step_s=50)
STALL_S = 1000.0


def _progress(phase: str, done: int, total: int, at: float = 0.0) -> PhaseReport:
    report = Progress(phase=phase, done=done, total=total, tokens_per_s=1.0, real_token_fraction=1)
    return PhaseReport.of(report, updated_at=at)


NONE = EvaluationProgress()
HALF = EvaluationProgress(phases={"loglikelihood": _progress("loglikelihood", 3, 8)})
ANSWERED = EvaluationProgress(
    phases={
        "loglikelihood": _progress("loglikelihood", 8, 8, at=1.0),
        "generate_until": _progress("generate_until", 2, 2, at=2.0),
    }
)


def _watch(
    progress: EvaluationProgress = NONE,
    silent_s: float = 0.0,
    asked_s: float | None = None,
) -> Watch:
    now = 10_000.0
    asked_at = None if asked_s is None else now - asked_s
    return Watch(now, now - silent_s, asked_at, progress, TIMEOUTS, bootstrap_iters=7)


@pytest.mark.parametrize(
    "asked_s, limit_s, fails",
    [
        (None, 120.0, False),  # no call in flight: nothing to wait for
        (0.0, 120.0, False),
        (120.0, 120.0, False),  # at the limit: still waiting
        (120.5, 120.0, True),
        (5.0, 1.0, True),
    ],
)
def test_a_runner_is_unreachable_past_the_limit(
    asked_s: float | None, limit_s: float, fails: bool
) -> None:
    error = unreachable(_watch(asked_s=asked_s), limit_s)
    assert (error is not None) == fails
    if fails:
        assert error == (
            f"the runner actor did not answer for {limit_s:g}s: check the Ray cluster "
            "(dashboard, `ray status`) and resubmit"
        )


@pytest.mark.parametrize(
    "progress, limit_s",
    [
        (NONE, STALL_S + 10 + 100),  # before its first batch: placement and load
        (HALF, STALL_S + 50),  # batches run: one step
        (ANSWERED, STALL_S + 50),
    ],
)
def test_the_stall_limit_adds_the_evaluation_s_own_wait(
    progress: EvaluationProgress, limit_s: float
) -> None:
    assert stall_limit(_watch(progress), STALL_S) == limit_s
    assert stalled(_watch(progress, silent_s=limit_s), STALL_S) is None
    assert stalled(_watch(progress, silent_s=limit_s + 1), STALL_S) is not None


@pytest.mark.parametrize(
    "progress, where",
    [
        (
            NONE,
            "before its first batch (reserving resources, loading the model or building requests)",
        ),
        (HALF, "after 3/8 loglikelihood requests"),
        (
            ANSWERED,  # the latest report names the request type
            "after 2/2 generate_until requests: every request was answered, so lm-eval was "
            "computing metrics (bootstrap_iters=7) or building the next request type",
        ),
    ],
)
def test_a_stall_names_where_it_stopped(progress: EvaluationProgress, where: str) -> None:
    assert where_stopped(_watch(progress)) == where
    error = stalled(_watch(progress, silent_s=5000.0), STALL_S)
    assert error is not None
    assert error.startswith(
        f"no progress for 5000s (limit {stall_limit(_watch(progress), STALL_S):.0f}s"
    )
    assert f"it stopped {where}." in error and "--stall-timeout" in error


@pytest.mark.parametrize(
    "silent_s, asked_s, expected",
    [
        (0.0, None, None),
        (0.0, 200.0, "unreachable"),
        (5000.0, None, "stalled"),
        (5000.0, 200.0, "stalled"),  # both: the stall (it names where it stopped) wins
    ],
)
def test_the_verdict(silent_s: float, asked_s: float | None, expected: str | None) -> None:
    error = verdict(_watch(HALF, silent_s=silent_s, asked_s=asked_s), STALL_S, 120.0)
    if expected is None:
        assert error is None
    else:
        assert error is not None
        assert error.startswith("no progress" if expected == "stalled" else "the runner actor")


def test_a_watch_reads_the_evaluation_s_config() -> None:
    config = EvaluationConfig.model_validate(
        {
            "model_args": {"pretrained": "org/model"},
            "tasks": ["t"],
            "bootstrap_iters": 3,
            "timeouts": {"step_s": 5},
        }
    )
    now = datetime.now(UTC)
    record = EvaluationRecord(
        "e1", 1, EvaluationStatus.RUNNING, config, {}, now, now, None, None, HALF, 0, 0
    )
    watch = Watch.of(record, now=100.0, heard_at=90.0, asked_at=None)
    assert watch.timeouts.step_s == 5 and watch.bootstrap_iters == 3
    assert watch.progress == HALF and stall_limit(watch, STALL_S) == STALL_S + 5


def _event(seq: int, phase: str, done: int, total: int) -> RunnerProgress:
    progress = Progress(phase=phase, done=done, total=total, tokens_per_s=2, real_token_fraction=1)
    return RunnerProgress(seq=seq, time=100.0 + seq, progress=progress)


OUTPUTS = RunOutputs(results_json="{}", samples={}, stats={})
WARNING = RequestWarning(task="t", counts={"empty_continuation": 1}, example={})


@pytest.mark.parametrize(
    "events, moved, ended, kinds",
    [
        ([RunnerWarning(seq=1, time=1.0, warning=WARNING)], False, None, ["warning"]),
        (
            [_event(1, "loglikelihood", 1, 8), _event(2, "loglikelihood", 2, 8)],
            True,
            None,
            ["progress"],  # one event per request type that moved: its latest
        ),
        (
            [
                _event(1, "loglikelihood", 8, 8),
                RunnerWarning(seq=2, time=2.0, warning=WARNING),
                _event(3, "generate_until", 1, 2),
                RunnerSucceeded(seq=4, time=4.0, outputs=OUTPUTS),
            ],
            True,
            "succeeded",
            ["warning", "progress", "progress"],
        ),
        ([RunnerFailed(seq=1, time=1.0, error="boom", kind="E")], False, "failed", []),
    ],
)
def test_runner_events_become_stored_progress_and_stream_events(
    events: list, moved: bool, ended: str | None, kinds: list[str]
) -> None:
    digested = digest(HALF, events)
    assert digested.cursor == events[-1].seq
    assert digested.moved == moved
    assert (digested.ended.type.value if digested.ended else None) == ended
    assert [event.KIND.value for event in digested.events] == kinds
    for event in digested.events:
        if isinstance(event, ProgressEvent):
            assert digested.progress.phases[event.phase] == PhaseReport.parse(event.dump())
            assert (event.overall_done, event.overall_total) == (
                digested.progress.done,
                digested.progress.total,
            )
        else:
            assert event == WarningEvent.of_warning(WARNING)


def test_progress_keeps_each_request_type_s_latest_report() -> None:
    digested = digest(HALF, [_event(7, "loglikelihood", 5, 8), _event(8, "generate_until", 1, 4)])
    assert {p: (r.done, r.total) for p, r in digested.progress.phases.items()} == {
        "loglikelihood": (5, 8),
        "generate_until": (1, 4),
    }
    assert digested.progress.phases["generate_until"].updated_at == 108.0


def test_each_stage_is_an_event_and_the_latest_is_kept() -> None:
    """Stages move nothing (a starting evaluation stays starting) but each is on the stream."""
    from rayeval.service.vocabulary.events import RunnerStage, Stage, StageEvent, StageName

    placing = Stage(name=StageName.PLACING, started_at=1.0, ranks=2)
    building = Stage(name=StageName.BUILDING_REQUESTS, started_at=2.0, ranks_ready=0, ranks=2)
    events = [
        RunnerStage(seq=1, time=1.0, stage=placing),
        RunnerStage(seq=2, time=2.0, stage=building),
    ]
    digested = digest(HALF, events)
    assert not digested.moved and digested.progress.stage == building
    assert digested.events == [StageEvent.of_stage(placing), StageEvent.of_stage(building)]
    assert digest(digested.progress, [_event(3, "loglikelihood", 5, 8)]).progress.stage == building


def test_task_results_come_from_lm_eval_s_results_file() -> None:
    results = '{"results": {"a": {"acc,none": 0.5}, "g": {}}, "configs": {}}'
    assert [(e.task, e.metrics) for e in task_results(results)] == [
        ("a", {"acc,none": 0.5}),
        ("g", {}),
    ]
    assert task_results("{}") == []
