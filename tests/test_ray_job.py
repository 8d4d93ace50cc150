"""``ray job submit -- rayeval run``: a real Ray head on loopback runs the CLI as a Ray job.

The head is started the way an operator starts one (``ray start --head --block``, here in the
background with every port chosen free, its own ``--temp-dir`` so that no other Ray session on the
machine can find or join it) and stopped by its pid and process group. The dashboard and its job
API listen on 127.0.0.1; Ray's own services use this machine's address, as every local Ray does
(Ray maps a loopback node address to it). The job's log must show
progress while it runs, and the files it writes must be the files ``lm_eval run`` writes, with the
same results. Also here: publishing lm-eval's output files to an fsspec URL
(:mod:`rayeval.service.engine.outputs`), on fsspec's in-memory filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.errors import ConfigError, RayEvalError
from rayeval.service.engine.outputs import OutputTarget, is_url
from tests.helpers import (
    assert_same_results,
    demo_cli_args,
    kill_processes_naming,
    read_outputs,
    run_lm_eval_cli,
    stop_process_group,
)

VENV_BIN = Path(sys.executable).parent
HEAD_START_TIMEOUT_S = 180
HEAD_START_ATTEMPTS = 2
JOB_TIMEOUT_S = 420
_HEAD_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)


# ------------------------------------------------------------------------ the Ray head
def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open until every one is chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _ray_env(temp_dir: Path) -> dict[str, str]:
    """This process's environment (offline HF, RAY_AUTH_MODE), no other cluster's address."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(temp_dir)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    # On a loaded machine the raylet's agents can take longer to start than Ray's defaults allow.
    env.setdefault("RAY_agent_register_timeout_ms", "120000")
    env.setdefault("RAY_worker_register_timeout_seconds", "120")
    return env


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head with the dashboard's job API on loopback; yields (job API URL, environment).

    A head whose start fails (Ray's own startup deadlines on an overloaded machine) is stopped
    and started once more on fresh ports and a fresh temp dir.
    """
    logs = tmp_path_factory.mktemp("ray-head")
    for attempt in range(1, HEAD_START_ATTEMPTS + 1):
        temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))  # short: Ray's socket paths
        env = _ray_env(temp_dir)
        ports = dict(zip(_HEAD_PORT_FLAGS, _free_ports(len(_HEAD_PORT_FLAGS)), strict=True))
        command = [str(VENV_BIN / "ray"), "start", "--head", "--block",
                   "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
                   "--num-cpus", "4", "--num-gpus", "0",
                   "--temp-dir", str(temp_dir), "--disable-usage-stats"]  # fmt: skip
        for flag, port in ports.items():
            command += [flag, str(port)]
        url = f"http://127.0.0.1:{ports['--dashboard-port']}"
        log = logs / f"head-{attempt}.log"
        with log.open("w") as log_file:
            head = subprocess.Popen(
                command,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                problem = _wait_for_head(url, head, log)
                if problem is None:
                    yield url, env
                    return
            finally:
                stop_process_group(head)
                kill_processes_naming(str(temp_dir))
                shutil.rmtree(temp_dir, ignore_errors=True)
        if attempt == HEAD_START_ATTEMPTS:
            pytest.fail(f"{problem}:\n{log.read_text(errors='replace')[-4000:]}")


def _wait_for_head(url: str, head: subprocess.Popen[bytes], log: Path) -> str | None:
    """Wait (bounded) until ``ray start`` reports the runtime up and the job API answers.

    Returns:
        None when the head is ready, else what went wrong.
    """
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.poll() is not None:
            return f"ray start exited with {head.returncode}"
        # The dashboard can answer while the raylet is still failing: wait for both.
        if "Ray runtime started" in log.read_text(errors="replace"):
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=5) as response:
                    if response.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(1)
    return f"the Ray head at {url} was not ready within {HEAD_START_TIMEOUT_S}s"


# ------------------------------------------------------------------------ the job
def _ray(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _submit(
    env: dict[str, str], url: str, submission_id: str, working_dir: Path, entrypoint: list[str]
) -> subprocess.CompletedProcess[str]:
    """``ray job submit --no-wait``; retried (bounded) while the head's job agent is not up yet."""
    deadline = time.monotonic() + 120
    while True:
        submitted = subprocess.run(
            [str(VENV_BIN / "ray"), "job", "submit", "--no-wait", "--address", url,
             "--submission-id", submission_id, "--working-dir", str(working_dir),
             "--", *entrypoint],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        output = submitted.stdout + submitted.stderr
        if "No available agent" not in output or time.monotonic() > deadline:
            return subprocess.CompletedProcess(submitted.args, submitted.returncode, output, "")
        time.sleep(3)


@pytest.mark.e2e
def test_ray_job_submit_runs_rayeval_and_writes_what_lm_eval_writes(
    ray_head: tuple[str, dict[str, str]], demo: Any, tmp_path: Path
) -> None:
    url, env = ray_head
    common = demo_cli_args(demo)
    working_dir = tmp_path / "job"  # what the job ships: a small directory, not the repo
    working_dir.mkdir()
    (working_dir / "README.txt").write_text("rayeval job test\n")
    submission_id = f"rayeval-test-{uuid.uuid4().hex[:8]}"
    entrypoint = [str(VENV_BIN / "rayeval"), "run", *common, "--batch_size", "auto",
                  "--num_replicas", "1", "--shard_size", "2",
                  "--output_path", str(tmp_path / "ours"),
                  "--placement_timeout", "120", "--load_timeout", "300",
                  "--step_timeout", "300", "--collective_timeout", "300"]  # fmt: skip
    submitted = _submit(env, url, submission_id, working_dir, entrypoint)
    assert submitted.returncode == 0, f"ray job submit failed:\n{submitted.stdout[-4000:]}"
    follow_log = tmp_path / "follow.log"
    with follow_log.open("w") as log_file:
        # `ray job logs -f` streams the job's log until the job ends; meanwhile lm-eval runs here.
        follow = subprocess.Popen(
            [str(VENV_BIN / "ray"), "job", "logs", "--follow", "--address", url, submission_id],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            run_lm_eval_cli(["run", *common, "--device", "cpu", "--batch_size", "4",
                              "--output_path", str(tmp_path / "ref")])  # fmt: skip
            follow.wait(timeout=JOB_TIMEOUT_S)
        except BaseException:
            _ray(env, "job", "stop", "--address", url, submission_id, timeout=60)
            stop_process_group(follow)
            raise
    streamed = follow_log.read_text(errors="replace")
    from ray.job_submission import JobStatus, JobSubmissionClient

    status = JobSubmissionClient(url).get_job_status(submission_id)
    assert status == JobStatus.SUCCEEDED, f"job {status}:\n{streamed[-6000:]}"

    # Progress reached the job log while the job ran; the driver printed lm-eval's table.
    for phase in ("rayeval loglikelihood", "rayeval generate_until"):
        assert phase in streamed, f"no progress for {phase} in the streamed job log"
    assert "|demo_mc" in streamed and "layout: 1x2" in streamed

    ref_name, ref_results, ref_samples = read_outputs(tmp_path / "ref")
    our_name, our_results, our_samples = read_outputs(tmp_path / "ours")
    assert our_name == ref_name == str(demo.model_dir).replace("/", "__")
    assert set(our_results) == set(ref_results)
    assert our_results["config"]["model"] == "hf"
    for key in ("configs", "versions", "n-shot", "higher_is_better", "n-samples"):
        assert our_results[key] == ref_results[key], key
    assert set(our_samples) == set(ref_samples) == {"demo_gen_short", "demo_mc"}
    assert_same_results(
        {"results": ref_results["results"], "samples": ref_samples},
        {"results": our_results["results"], "samples": our_samples},
    )


# ------------------------------------------------------------- fsspec output paths
@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh directory on fsspec's (process-wide) in-memory filesystem."""
    import fsspec

    root = f"/rayeval-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _tracker_writes(local_path: str) -> None:
    """lm-eval's own EvaluationTracker saves aggregated results under ``local_path``."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=local_path)
    tracker.general_config_tracker.model_name_sanitized = "org__tiny"
    tracker.save_results_aggregated(results={"results": {"demo_mc": {"acc,none": 0.5}}}, samples={})


@pytest.mark.unit
def test_local_output_path_is_used_as_is(tmp_path: Path) -> None:
    with OutputTarget(str(tmp_path / "out")) as target:
        assert not target.remote and target.local_path == str(tmp_path / "out")
        assert target.publish() == []
    assert not is_url("/srv/results") and is_url("s3://bucket/run") and is_url("file:///x")


@pytest.mark.unit
def test_url_output_is_staged_then_published_in_lm_eval_layout(memory_root: str) -> None:
    import fsspec

    with OutputTarget(f"{memory_root}/runs") as target:
        assert target.remote and not is_url(target.local_path)
        _tracker_writes(target.local_path)
        published = target.publish()
        staging = Path(target.local_path)
    assert len(published) == 1
    assert published[0].startswith(f"{memory_root}/runs/org__tiny/results_")
    with fsspec.open(published[0], "r") as handle:
        assert json.load(handle)["results"] == {"demo_mc": {"acc,none": 0.5}}
    assert not staging.exists(), "the staging directory outlived the target"


@pytest.mark.unit
def test_json_output_url_gets_files_beside_it(memory_root: str) -> None:
    with OutputTarget(f"{memory_root}/runs/summary.json") as target:
        _tracker_writes(target.local_path)
        published = target.publish()
    assert len(published) == 1
    assert published[0].startswith(f"{memory_root}/runs/summary_")
    assert published[0].endswith(".json")


@pytest.mark.unit
def test_failed_upload_keeps_the_staged_files(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    target = OutputTarget(f"file://{blocker}/runs")
    _tracker_writes(target.local_path)
    with pytest.raises(RayEvalError, match=r"the results were written to .* copying them to"):
        target.publish()
    target.close()
    assert any(Path(target.local_path).rglob("results_*.json")), "staged results were deleted"
    shutil.rmtree(Path(target.local_path).parent, ignore_errors=True)


@pytest.mark.unit
def test_unusable_url_fails_before_any_work() -> None:
    with pytest.raises(ConfigError, match="Protocol not known: nosuch"):
        OutputTarget("nosuch://bucket/run")
    import importlib.util

    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(ConfigError, match=r"pip install 'rayeval\[s3\]'"):
            OutputTarget("s3://bucket/run")
