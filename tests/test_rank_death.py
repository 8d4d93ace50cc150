"""A rank whose process dies is reported as which rank, how it ended (the signal, a fatal error,
an uncaught C++ exception such as gloo's) and its last lines of output (actors/rank_death.py),
read from its own log files on its node."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from rayeval.actors.rank_death import _cause, death_report
from tests.helpers import assert_same_results, evaluate, hf_reference

#: Ray's text for a dead actor (its fields as Ray 2.60 writes them).
RAY_TEXT = """The actor died unexpectedly before finishing this task.
\tclass_name: ShardWorker
\tactor_id: 635c6fa2c5572146598a15e301000000
\tpid: {pid}
\tname: rayeval-1a2b3c4d-r1-s0
\tnamespace: 66fceae8
\tip: {ip}
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit \
detail: Worker unexpectedly exits with a connection error code 2. End of file."""


@pytest.mark.unit
@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        (["*** SIGSEGV received at time=1796606533 on cpu 0 ***",
          "Fatal Python error: Segmentation fault"],
         "killed by SIGSEGV; Fatal Python error: Segmentation fault"),
        (["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
          "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= "
          "op.nbytes. 3080 vs 3072", "*** SIGABRT received at time=1 on cpu 1 ***"],
         "killed by SIGABRT; a C++ gloo::EnforceNotMet was not caught ([enforce fail at "
         "gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 3080 vs 3072)"),
        ([], "its process ended without a signal or fatal error in its output (an exit(); Ray "
             "does not report the exit code)"),
    ],
    ids=["segfault", "gloo-abort", "exit"],
)  # fmt: skip
def test_how_a_rank_ended_is_read_from_its_output(lines: list[str], cause: str) -> None:
    assert _cause(lines, RAY_TEXT) == cause


@pytest.mark.unit
def test_ray_s_fields_name_the_rank_without_its_output() -> None:
    """Where no output can be read (here: no pid to look for), the report still names the rank
    from Ray's fields, and says how it ended as far as Ray's text tells."""
    report = death_report(RuntimeError(RAY_TEXT.format(pid="a", ip="10.0.0.9")))
    assert report.summary().startswith("replica 1 rank 0 (pid a on 10.0.0.9) died: ")


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGABRT], ids=["SIGSEGV", "SIGABRT"])
def test_a_rank_killed_by_a_signal_is_reported_with_its_last_lines(
    signum: int, demo: Any, task_manager: Any, ray_session: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A real signal to replica 0's rank mid-run: the other replica finishes the evaluation
    (exact), and the warning names replica 0 rank 0, its pid and node, the signal, and the
    lines its process wrote last (Python's fault dump with the rank's stack)."""
    import ray

    from rayeval.service.engine.lm import RayEvalLM

    run = {"limit": 6, "bootstrap_iters": 0}
    tasks = ["demo_cloze", "demo_gen_short"]
    killed: list[int] = []

    def kill_replica_0(progress: Any) -> None:
        if not killed and progress.done > 0:
            info = ray.get(ray.get_actor(f"{lm.engine.name}-r0-s0").node_info.remote(), timeout=30)
            os.kill(info.pid, signum)
            killed.append(info.pid)

    lm = RayEvalLM(pretrained=str(demo.model_dir), num_replicas=2, batch_size=1,
                   on_progress=kill_replica_0)  # fmt: skip
    with caplog.at_level("WARNING", logger="rayeval"), lm:
        ours = evaluate(lm, task_manager, tasks, **run)
    assert killed, "the signal was never sent"
    assert_same_results(hf_reference(demo.model_dir, task_manager, tasks, **run), ours)
    # Each request type's dispatcher that had work on replica 0 reports it lost.
    lost = next(r.getMessage() for r in caplog.records if "replica 0 lost" in r.getMessage())
    name = signal.Signals(signum).name
    assert f"replica 0 lost: replica 0 rank 0 (pid {killed[0]} on " in lost, lost
    assert f"died: killed by {name}" in lost, lost
    assert "its last lines of output (" in lost and f"-{killed[0]}.err):" in lost, lost
    assert "Stack (most recent call first)" in lost or "File " in lost, lost
