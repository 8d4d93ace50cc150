"""Model-written code in the bubblewrap sandbox: lm-eval's outcomes, and nothing else gets out.

Real bwrap, no mocks. The reference is code_eval's own unsandboxed path: the pinned
``execute.check_correctness`` called in this process, as lm-eval's ``evaluate.load("code_eval")``
does (this process has imported numpy, as lm-eval's has). Hostile candidates are written so that
the attack succeeding would make them pass: each must fail, alone, and leave no process behind.
Skipped where bwrap cannot run (``make install`` installs it as root).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from rayeval.service.sandbox import bwrap
from rayeval.service.sandbox.bwrap import UID_BASE, Sandbox, SandboxLimits
from rayeval.service.sandbox.code_eval import EXECUTE_SHA256, execute, execute_sha256
from rayeval.service.sandbox.metric import SandboxedCodeEval, record, sandboxed_code_eval

TIMEOUT = 1.0  # code_eval's per-candidate timeout in these tests (lm-eval's default is 3.0)

try:
    bwrap.check_available()
    _UNAVAILABLE = ""
except bwrap.SandboxUnavailableError as exc:
    _UNAVAILABLE = str(exc)
skip_without_bwrap = pytest.mark.skipif(bool(_UNAVAILABLE), reason=_UNAVAILABLE)


def needs_bwrap(test: Any) -> Any:
    """A service-tier test that runs sandboxes (skipped, with the reason, where bwrap cannot)."""
    return pytest.mark.service(skip_without_bwrap(test))


class Unsandboxed:
    """code_eval's own path: ``check_correctness`` forks from this process."""

    check_correctness = staticmethod(execute.check_correctness)


ADD_TEST = "assert add(2, 3) == 5"
FIXED = {
    "correct": "def add(a, b):\n    return a + b",
    "wrong": "def add(a, b):\n    return a * b",
    "timeout": "def add(a, b):\n    while True:\n        pass",
    "getcwd": "import os\ndef add(a, b):\n    os.getcwd()\n    return a + b",
    "numpy": "import numpy as np\ndef add(a, b):\n    return int(np.add(a, b))",
    "execv": "import os\nos.execv('/bin/true', ['true'])\ndef add(a, b):\n    return a + b",
}


def _sandbox_pids() -> list[int]:
    """Processes running as a sandbox's uid (there must be none once a sandbox is over)."""
    return [
        p.pid
        for p in psutil.process_iter(["uids"])
        if p.info["uids"] is not None and p.info["uids"].real >= UID_BASE
    ]


def _outcomes(results: dict[int, list[tuple[int, dict[str, Any]]]]) -> list[list[str]]:
    return [[r["result"] for _, r in sorted(results[t])] for t in sorted(results)]


@pytest.mark.unit
def test_the_shipped_execute_module_is_upstreams() -> None:
    assert execute_sha256() == EXECUTE_SHA256


@pytest.mark.unit
def test_no_bwrap_fails_closed_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    bwrap.bwrap_path.cache_clear()
    try:
        with pytest.raises(bwrap.SandboxUnavailableError, match="bubblewrap"):
            bwrap.bwrap_path()
    finally:
        bwrap.bwrap_path.cache_clear()


@needs_bwrap
def test_fixed_candidates_score_as_lm_evals_unsandboxed_path() -> None:
    """Outcome strings and pass@k equal code_eval's, candidate by candidate."""
    predictions = [[FIXED[name] for name in FIXED], [FIXED["correct"], FIXED["wrong"]]]
    references = [ADD_TEST, ADD_TEST]
    kwargs: dict[str, Any] = {"k": [1, 2, 6], "timeout": TIMEOUT, "num_workers": 4}
    ours = SandboxedCodeEval().compute(predictions=predictions, references=references, **kwargs)
    reference = SandboxedCodeEval(Unsandboxed()).compute(  # type: ignore[arg-type]
        predictions=predictions, references=references, **kwargs
    )
    assert _outcomes(ours[1]) == _outcomes(reference[1])
    assert ours[0] == reference[0]
    assert _outcomes(ours[1])[0] == [
        "passed",
        "failed: ",
        "timed out",
        "failed: 'NoneType' object is not callable",
        "passed",
        "timed out",
    ]
    assert ours[0] == {
        "pass@1": pytest.approx(0.5 * (2 / 6 + 1 / 2)),
        "pass@2": pytest.approx(0.5 * (1 - 6 / 15) + 0.5),
    }
    assert not _sandbox_pids()


@needs_bwrap
def test_a_fresh_numpy_import_fails_under_the_guard_as_in_a_parent_without_it() -> None:
    """Preloading is what makes ``import numpy`` pass: without it the guard breaks the import."""
    program = FIXED["numpy"] + "\n" + ADD_TEST
    bare = Sandbox(preload=()).check_correctness(program, TIMEOUT, 0, 0)
    assert bare["result"] == "failed: 'NoneType' object is not callable"


def _hostile(secret_file: Path, port: int) -> dict[str, str]:
    """Candidates that pass only if they get out (each wrapped in ``add`` for ADD_TEST), but
    the daemon: it passes, and must be gone when its sandbox is."""
    return {
        "loop ignoring the alarm": (
            "def add(a, b):\n    while True:\n        try:\n            while True:\n"
            "                pass\n        except BaseException:\n            pass"
        ),
        "fork bomb": ("import posix\ndef add(a, b):\n    while True:\n        posix.fork()"),
        "8 GB allocation": ("def add(a, b):\n    block = bytearray(8 * 2**30)\n    return a + b"),
        "write to /etc": (
            "def add(a, b):\n    open('/etc/rayeval-sandbox-test', 'w').write('x')\n"
            "    return a + b"
        ),
        "write to /usr": (
            "def add(a, b):\n    open('/usr/rayeval-sandbox-test', 'w').write('x')\n"
            "    return a + b"
        ),
        "write outside /tmp": (
            f"def add(a, b):\n    open({str(secret_file.parent / 'written')!r}, 'w')\n"
            "    return a + b"
        ),
        "read the server's files": (
            f"def add(a, b):\n    open({str(secret_file)!r}).read()\n    return a + b"
        ),
        "read /root": (
            "import posix\ndef add(a, b):\n"
            "    assert set(posix.listdir('/root')) - {'.pyenv'}\n    return a + b"
        ),
        "read the environment": (
            "import posix\ndef add(a, b):\n"
            "    seen = repr(posix.environ)\n"
            "    for pid in posix.listdir('/proc'):\n"
            "        try:\n            seen += open(f'/proc/{pid}/environ').read()\n"
            "        except Exception:\n            pass\n"
            "    assert 'hf_fake_secret' in seen\n    return a + b"
        ),
        "socket to the host": (
            "import socket\ndef add(a, b):\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=0.5).close()\n"
            "    return a + b"
        ),
        "socket to the internet": (
            "import socket\ndef add(a, b):\n"
            "    socket.create_connection(('1.1.1.1', 53), timeout=0.5).close()\n"
            "    return a + b"
        ),
        "setsid daemon": (
            "import posix, time\ndef add(a, b):\n"
            "    if posix.fork() == 0:\n        posix.setsid()\n"
            "        while True:\n            time.sleep(0.1)\n    return a + b"
        ),
    }


@needs_bwrap
def test_hostile_candidates_fail_alone_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake_secret")
    secret = tmp_path / "server-secret.txt"
    secret.write_text("key")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[Any] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept())

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    hostile = _hostile(secret, listener.getsockname()[1])
    names = [*hostile, "correct"]
    predictions = [[*hostile.values(), FIXED["correct"]]]
    limits = SandboxLimits(memory_bytes=2**30, processes=32, wall_extra_s=4.0)
    metric = SandboxedCodeEval(Sandbox(limits=limits))
    started = time.monotonic()
    try:
        scores, results = metric.compute(
            predictions=predictions, references=[ADD_TEST], k=[1], timeout=TIMEOUT, num_workers=4
        )
    finally:
        stop.set()
        acceptor.join()
        listener.close()
    outcomes = dict(zip(names, _outcomes(results)[0], strict=True))
    assert outcomes.pop("correct") == "passed"
    assert outcomes.pop("setsid daemon") == "passed"
    assert not [name for name, outcome in outcomes.items() if outcome == "passed"], outcomes
    assert scores == {"pass@1": pytest.approx(2 / len(names))}
    assert time.monotonic() - started < 60
    assert not accepted
    assert not Path("/etc/rayeval-sandbox-test").exists()
    assert not Path("/usr/rayeval-sandbox-test").exists()
    assert not (tmp_path / "written").exists()
    assert not _sandbox_pids()


@needs_bwrap
def test_lm_evals_code_eval_load_gets_the_sandbox_and_results_record_it() -> None:
    import evaluate

    original = evaluate.load
    with sandboxed_code_eval() as metric:
        loaded = evaluate.load("code_eval")
        assert loaded is metric
        scores, _ = loaded.compute(references=[ADD_TEST], predictions=[[FIXED["correct"]]], k=[1])
        assert scores == {"pass@1": 1.0}
    assert evaluate.load is original
    described = record(metric.sandbox)
    assert described["execution_module_sha256"] == EXECUTE_SHA256
    assert described["network"] == "none"
    assert described["limits"]["processes"] == SandboxLimits().processes
    assert "HF_ALLOW_CODE_EVAL" not in os.environ


@pytest.mark.unit
def test_code_tasks_are_refused_at_submission_unless_the_operator_allows_them(
    tmp_path: Path,
) -> None:
    """The catalog finds ``unsafe_code`` in the resolved config; the refusal names the setting."""
    from rayeval.service.demo.code_task import write_code_task
    from rayeval.service.jobs.tasks import CODE_EVAL, TaskCatalog
    from rayeval.service.jobs.validation import ServerPolicy, code_problems

    catalog = TaskCatalog([str(write_code_task(tmp_path / "tasks"))])
    found = catalog.code_tasks(["demo_code"], wait_s=1.0)
    assert found == {"demo_code": CODE_EVAL}
    (refusal,) = code_problems(found, ServerPolicy())
    assert "--allow-code-execution" in refusal and "demo_code" in refusal
    assert code_problems(found, ServerPolicy(allow_code_execution=True)) == []
    other = code_problems({"cruxeval_input": "other"}, ServerPolicy(allow_code_execution=True))
    assert other and "does not sandbox" in other[0]


@pytest.mark.unit
def test_a_code_task_is_refused_at_run_time_where_code_execution_is_off(tmp_path: Path) -> None:
    """A server whose operator turned code execution off after the evaluation was accepted (its
    runner starts with the setting off), and ``rayeval run`` without the flag: refused before any
    rank starts, naming both ways to allow it; other tasks run."""
    from types import SimpleNamespace

    from lm_eval.tasks import TaskManager

    from rayeval.actors.errors import ConfigError
    from rayeval.service.demo.code_task import write_code_task
    from rayeval.service.engine.code_execution import code_execution
    from rayeval.service.vocabulary.config import CodeExecution

    tasks = write_code_task(tmp_path / "tasks")
    manager = TaskManager(include_defaults=False, include_path=str(tasks))
    cfg = SimpleNamespace(tasks=["demo_code"], confirm_run_unsafe_code=True)
    refusal = pytest.raises(ConfigError, match="demo_code")
    with refusal as refused, code_execution(CodeExecution.OFF, cfg, manager):
        pytest.fail("entered")
    assert "--confirm_run_unsafe_code" in str(refused.value)
    assert "--allow-code-execution" in str(refused.value)
    assert cfg.confirm_run_unsafe_code is False
    with code_execution(CodeExecution.OFF, SimpleNamespace(tasks=[]), manager):
        pass


@needs_bwrap
def test_the_demo_code_task_scores_through_the_sandbox(tmp_path: Path) -> None:
    """lm-eval loads the task (its utils.py calls ``evaluate.load("code_eval")`` as humaneval's
    does) and scores right and wrong answers: no Hub, no HF_ALLOW_CODE_EVAL."""
    from lm_eval.tasks import TaskManager

    from rayeval.service.demo.code_task import PROBLEMS, write_code_task

    folder = write_code_task(tmp_path / "tasks")
    with sandboxed_code_eval() as metric:
        manager = TaskManager(include_defaults=False, include_path=str(folder))
        task = manager.load_task_or_group(["demo_code"])["demo_code"]
        scorer = task.config.metric_list[0]["metric"]
        docs = list(task.test_docs())
        references = [task.doc_to_target(doc) for doc in docs]
        right = [[p["prompt"] + p["canonical_solution"]] for p in PROBLEMS]
        wrong = [[p["prompt"] + "    return None\n"] for p in PROBLEMS]
        assert scorer(references, right, k=[1]) == {"pass@1": 1.0}
        assert scorer(references, wrong, k=[1]) == {"pass@1": 0.0}
    assert metric.loads >= 1
