"""What a person sees: ``rayeval run`` and ``make run`` print rayeval's own lines, one progress bar
per request type and the results; everything else goes to a log file under ``.rayeval/``.

The unit test drives the console in this process (prints, library logs, a Python warning, a child
process writing to the inherited descriptor). The end-to-end tests run the real commands as
subprocesses on the bundled demo, each with its own embedded Ray, and read their console.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import stop_process_group

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
#: What Ray prefixes its workers' forwarded output with (the lines the console must not carry).
WORKER_PREFIX = re.compile(r"\((EvaluationRunner|ShardWorker)[^)]*pid=\d+")
HARMLESS = "`pretrained` model kwarg is not of type `str`"


@pytest.mark.unit
def test_console_keeps_rayeval_lines_and_logs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rayeval.actors.errors import LOG_FILE_ONLY
    from rayeval.api.cli.console import console
    from rayeval.service.console import progress_stream

    monkeypatch.setenv("RAYEVAL_LOG_DIR", str(tmp_path / "logs"))
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    root_handlers = list(logging.getLogger().handlers)
    with console("run", verbose=False) as shown:
        print("a library's print")
        logging.getLogger("lm_eval.evaluator").warning("a library's warning")
        logging.getLogger("rayeval.service.engine.lm").info("rayeval's own line")
        logging.getLogger("rayeval.service.engine.lm").warning("rayeval's own warning")
        logging.getLogger("rayeval.actors.group").error("a rank's traceback", extra=LOG_FILE_ONLY)
        warnings.warn("a Python warning from a library", UserWarning, stacklevel=1)
        subprocess.run(["echo", "a child process"], check=True, timeout=30)
        progress_stream().write("rayeval loglikelihood: 50%\n")
        print("lm-eval's table", file=shown.out)
    assert sys.stdout is out and sys.stderr is err
    assert logging.getLogger().handlers == root_handlers
    assert shown.log_file is not None and shown.log_file.parent == tmp_path / "logs"
    log = shown.log_file.read_text()
    kept = ("a library's print", "a library's warning", "a Python warning", "a child process",
            "a rank's traceback")  # fmt: skip
    for line in kept:
        assert line in log, line
        assert line not in out.getvalue() + err.getvalue(), line
    assert out.getvalue() == "lm-eval's table\n"
    said = err.getvalue().splitlines()
    assert said[0].startswith("rayeval run: logs of lm-eval") and str(shown.log_file) in said[0]
    assert re.fullmatch(r"\d\d:\d\d:\d\d rayeval's own line", said[1]), said
    assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING: rayeval's own warning", said[2]), said
    assert said[3] == "rayeval loglikelihood: 50%"
    assert "rayeval's own line" in log  # the log file has everything

    with console("run", verbose=True) as shown:
        assert shown.log_file is None and shown.out is out and shown.err is err


def run_console(command: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> Any:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.e2e
def test_rayeval_run_console_has_no_worker_output_and_the_results(
    demo: Any, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAYEVAL_LOG_DIR"}
    done = run_console(
        [str(VENV / "bin" / "rayeval"), "run", "--model", "hf",
         "--model_args", f"pretrained={demo.model_dir},dtype=float32",
         "--include_path", str(demo.tasks_dir), "--tasks", "demo_mc,demo_gen_short",
         "--limit", "6", "--num_replicas", "2", "--batch_size", "auto",
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path, env=env, timeout_s=900,
    )  # fmt: skip
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:]
    assert not WORKER_PREFIX.search(console), console[-4000:]
    assert HARMLESS not in console and " lm_eval." not in console
    assert "|demo_mc" in done.stdout and "layout: 2x1" in done.stdout  # lm-eval's table
    for phase in ("loglikelihood", "generate_until"):
        assert f"rayeval {phase}: 100%" in done.stderr  # one bar per request type
    first = done.stderr.splitlines()[0]
    match = re.search(r"go to (\S+\.log)", first)
    assert match and first.startswith("rayeval run: logs of lm-eval"), first
    log = (tmp_path / match.group(1)).read_text()
    assert match.group(1).startswith(".rayeval/logs/run-")
    assert "lm_eval.evaluator" in log and "Started a local Ray instance" in log
    assert WORKER_PREFIX.search(log), "Ray's worker output should be in the log"
    assert HARMLESS not in log  # dropped at the source, not just hidden


@pytest.mark.unit
def test_watch_writes_plain_lines_where_there_is_no_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve --demo`` and ``submit --wait`` into a file or a pipe: lines, no cursor codes."""
    from rayeval.api.cli import remote

    def state(status: str, done: int, seconds: float, stage: str | None = None) -> dict[str, Any]:
        counts = {"done": done, "total": 8, "tokens_per_s": 100.0, "real_token_fraction": 1.0}
        phase = {**counts, "seconds": seconds, "cached": 2}
        phases = {"loglikelihood": phase} if status not in ("queued", "starting") else {}
        named = (
            {"name": stage.replace(" ", "_"), "label": stage, "elapsed_s": 3.2} if stage else None
        )
        return {"status": status, "progress": {"phases": phases, "stage": named}}

    class Server:  # the one seam: what the server answers, poll after poll
        def wait(self, evaluation_id: str, on_update: Any) -> dict[str, Any]:
            states = [state("queued", 0, 0), state("starting", 0, 0, "building requests")]
            states += [state("starting", 0, 0, "building requests")]  # the same: no line
            states += [state("running", 2, 0), state("running", 4, 1), state("running", 6, 2)]
            states += [state("running", 8, 3, "computing metrics"), state("succeeded", 8, 4)]
            for evaluation in states:
                on_update(evaluation)
            return states[-1]

    monkeypatch.setattr(remote, "LINE_INTERVAL_S", 3600.0)  # one line at the start, one at the end
    stream = io.StringIO()
    assert remote.watch(Server(), "e1", stream)["status"] == "succeeded"  # type: ignore[arg-type]
    assert stream.getvalue().splitlines() == [
        "e1: queued",
        "e1: starting: building requests (3 s)",
        "e1: running",
        "loglikelihood: 2/8 req (0.0 req/s, 100 tokens/s, 2 from cache)",
        "e1: running: computing metrics (3 s)",
        "loglikelihood: 8/8 req (2.0 req/s, 100 tokens/s, 2 from cache)",
        "e1: succeeded",
    ]


@pytest.mark.unit
def test_a_progress_bar_redraws_seldom_where_there_is_no_terminal() -> None:
    """A bar in a log or a pipe (``rayeval run`` as a Ray job, a runner's worker log): each
    redraw is a line there, so it redraws every ``LINE_INTERVAL_S`` (and at the end), where on a
    terminal it redraws in place as it moves."""
    from collections import Counter

    from rayeval.service.console import progress_on
    from rayeval.service.engine.dispatch.phases import PhaseStats, PhaseTracker, StartUp

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def frames(stream: io.StringIO) -> list[str]:
        with progress_on(stream):
            tracker = PhaseTracker(
                "loglikelihood", PhaseStats(), Counter(), range(1), {}, StartUp(None, None),
                None, disable_tqdm=False, expected=8,
            )  # fmt: skip
            for _ in range(8):
                time.sleep(0.15)
                tracker.expect(Counter(), answered=1)
            tracker.close()
        return [frame for frame in stream.getvalue().split("\r") if frame.strip()]

    in_a_log, on_a_terminal = frames(io.StringIO()), frames(Terminal())
    assert len(in_a_log) == 2, in_a_log  # the start and the end
    assert "0/8" in in_a_log[0] and "8/8" in in_a_log[-1], in_a_log
    assert len(on_a_terminal) >= 6, on_a_terminal


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.e2e
def test_make_run_shows_the_demo_lines(demo: Any, tmp_path: Path) -> None:
    """``make run`` (its install step skipped: this environment is installed) until the demo
    evaluation has ended; then Ctrl-C."""
    port = _free_port()
    env = {**os.environ, "RAYEVAL_LOG_DIR": str(tmp_path / "logs")}
    output = tmp_path / "make-run.txt"
    with output.open("w") as sink:
        make = subprocess.Popen(
            ["make", "-o", "install", "run", f"VENV={VENV}", f"PORT={port}",
             f"DEMO_DIR={demo.model_dir.parent}", f"SERVICE_DIR={tmp_path / 'service'}"],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 900
            while "Stop the server with Ctrl-C." not in output.read_text(errors="replace"):
                assert make.poll() is None, output.read_text(errors="replace")[-4000:]
                assert time.monotonic() < deadline, output.read_text(errors="replace")[-4000:]
                time.sleep(1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(make.pid, signal.SIGINT)
            make.wait(timeout=90)
        finally:
            stop_process_group(make)
    console = output.read_text(errors="replace")
    assert re.search(r"rayeval demo: evaluation \w+ submitted", console), console[-4000:]
    assert f"dashboard:   http://127.0.0.1:{port}/#" in console
    assert re.search(r"rayeval demo: evaluation \w+ succeeded in \d+ s", console)
    assert "|demo" in console and "acc" in console  # lm-eval's table
    assert not WORKER_PREFIX.search(console), console[-4000:]
    assert HARMLESS not in console and '"GET /' not in console  # no access log either
    assert "\x1b[" not in console and "\r" not in console, "cursor codes in a file"
    assert re.search(r"^loglikelihood: \d+/\d+ req", console, re.MULTILINE), console[-4000:]
    (log_file,) = (tmp_path / "logs").glob("serve-*.log")
    log = log_file.read_text(errors="replace")
    assert WORKER_PREFIX.search(log) and "uvicorn" in log
