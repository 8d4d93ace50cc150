"""Experiment tracking: one MLflow run (and one W&B run) per evaluation, from ``rayeval run`` and
from the service; a tracker that cannot be reached only warns.

A real MLflow tracking server (``mlflow server`` on a SQLite file: a subprocess this module starts
and waits for) receives the runs, which are read back with MLflow's own client. W&B runs offline
(``WANDB_MODE=offline``); its run file is read as ``wandb sync`` reads it. The service's runs go
through a real uvicorn server on the session's Ray; its runner actors see the server's
``WANDB_*`` variables. The last test stops the MLflow server and checks that a tracked evaluation
still succeeds, with a ``warning`` event on its stream.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import read_outputs, stop_process_group

VENV_BIN = Path(sys.executable).parent
TASKS = ["demo_mc", "demo_cloze"]
PUBLIC_URL = "http://rayeval.test:8000"


# ------------------------------------------------------------------------ MLflow server
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MlflowServer:
    """``mlflow server`` on a SQLite file under ``root``, artifacts beside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = f"http://127.0.0.1:{_free_port()}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180.0) -> None:
        port = self.uri.rsplit(":", 1)[1]
        log = self.root / "mlflow-server.log"
        with log.open("w") as out:
            self._process = subprocess.Popen(
                [str(VENV_BIN / "mlflow"), "server",
                 "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                 "--artifacts-destination", str(self.root / "artifacts"),
                 "--host", "127.0.0.1", "--port", port, "--workers", "1"],
                cwd=self.root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._process.poll() is None, f"mlflow server exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.uri}/health", timeout=5).status_code == 200:
                    return
            assert time.monotonic() < deadline, f"mlflow server not up:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            stop_process_group(self._process)

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'rayeval[dev]'")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


def the_run(server: MlflowServer, experiment: str) -> Any:
    """The one run of ``experiment``."""
    client = server.client()
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    (run,) = client.search_runs([found.experiment_id])
    return run


def check_run(
    server: MlflowServer, run: Any, results_text: str, samples: dict[str, str], tmp: Path
) -> None:
    """Metrics with stderrs as in the results, lm-eval's files as artifacts, FINISHED."""
    from rayeval.service.trackers import run_metrics

    results = json.loads(results_text)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == pytest.approx(run_metrics(results))
    for task in TASKS:
        metrics = results["results"][task]
        assert run.data.metrics[f"{task}/acc"] == pytest.approx(metrics["acc,none"])
        assert run.data.metrics[f"{task}/acc_stderr"] == pytest.approx(metrics["acc_stderr,none"])
    assert run.data.params["parallelism.num_replicas"] == "2"
    assert json.loads(run.data.params["tasks"]) == TASKS
    client = server.client()
    names = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    (results_name,) = [name for name in names if name.startswith("results_")]
    by_task = {task: [n for n in names if n.startswith(f"samples_{task}_")] for task in TASKS}
    assert names == {results_name, *(found for names in by_task.values() for found in names)}
    local = Path(client.download_artifacts(run.info.run_id, results_name, str(tmp)))
    assert json.loads(local.read_text()) == results
    for task, text in samples.items():
        (name,) = by_task[task]
        local = Path(client.download_artifacts(run.info.run_id, name, str(tmp)))
        assert local.read_text() == text


# --------------------------------------------------------------------------- rayeval run
def run_cli(demo: Any, out: Path, *extra: str) -> tuple[int, str, str]:
    """``rayeval run`` in this process on two demo tasks; (status, stdout, stderr)."""
    from rayeval.api.cli import main

    argv = [
        "run", "--model", "hf", "--model_args", f"pretrained={demo.model_dir},dtype=float32",
        "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS), "--limit", "4",
        "--num_replicas", "2", "--bootstrap_iters", "100", "--log_samples",
        "--output_path", str(out), *extra,
    ]  # fmt: skip
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.mark.e2e
def test_rayeval_run_records_one_mlflow_run(
    mlflow_server: MlflowServer, demo: Any, ray_session: None, tmp_path: Path
) -> None:
    status, printed, said = run_cli(
        demo, tmp_path / "out",
        "--mlflow_tracking_uri", mlflow_server.uri,
        "--tracking", "experiment=cli-test,run_name=tiny-cli",
    )  # fmt: skip
    assert status == 0, said
    assert "|demo_mc" in printed
    assert "recorded in MLflow: " + mlflow_server.uri in said
    _, results, _ = read_outputs(tmp_path / "out")
    (model_dir,) = (tmp_path / "out").iterdir()
    (results_file,) = model_dir.glob("results_*.json")
    samples = {task: next(model_dir.glob(f"samples_{task}_*.jsonl")).read_text() for task in TASKS}
    run = the_run(mlflow_server, "cli-test")
    assert run.info.run_name == "tiny-cli"
    assert run.data.params["model_args.pretrained"] == str(demo.model_dir)
    assert run.data.tags["rayeval.model"] == str(demo.model_dir)
    assert "rayeval.evaluation_id" not in run.data.tags  # only the service has ids
    check_run(mlflow_server, run, results_file.read_text(), samples, tmp_path / "downloaded")
    assert results == json.loads(results_file.read_text())


@pytest.mark.e2e
def test_rayeval_run_with_mlflow_down_warns_and_succeeds(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    status, printed, said = run_cli(demo, tmp_path / "out", "--mlflow_tracking_uri", down)
    assert status == 0, said
    assert "|demo_mc" in printed
    assert f"WARNING: mlflow: the evaluation was not recorded in MLflow at {down}" in said
    assert "tracking server runs" in said  # names what to check
    assert time.monotonic() - started < 240  # bounded retries: not minutes of backoff


@pytest.mark.e2e
def test_a_sweep_records_one_mlflow_run_per_checkpoint(
    mlflow_server: MlflowServer, demo: Any, ray_session: None, tmp_path: Path
) -> None:
    """Two checkpoints of the demo model's architecture (HF files): the trained model, and one
    trained for 60 steps instead of 300."""
    import shutil

    from rayeval.service.demo import build_tiny_model

    late = Path(shutil.copytree(demo.model_dir, tmp_path / "ckpts" / "step-300"))
    early = build_tiny_model(tmp_path / "ckpts" / "step-60", train_steps=60)
    status, printed, said = run_cli(
        demo, tmp_path / "out",
        "--checkpoints", f"{early},{late}",
        "--mlflow_tracking_uri", mlflow_server.uri, "--tracking", "experiment=sweep-test",
    )  # fmt: skip
    assert status == 0, said
    assert "step-60: succeeded" in printed and "step-300: succeeded" in printed
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name("sweep-test")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"step-60", "step-300"}
    for label, checkpoint in (("step-60", early), ("step-300", late)):
        run = runs[label]
        assert run.data.tags["rayeval.checkpoint"] == str(checkpoint)
        assert run.data.params["model_args.checkpoint"] == str(checkpoint)
        (results_file,) = (tmp_path / "out" / label).glob("*/results_*.json")
        results = json.loads(results_file.read_text())
        assert run.data.metrics["demo_mc/acc"] == pytest.approx(
            results["results"]["demo_mc"]["acc,none"]
        )
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert results_file.name in names and len(names) == 1 + len(TASKS)


# ------------------------------------------------------------------------------ the service
@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """W&B offline for the module; the runner actors see these variables (the server's)."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'rayeval[dev]'")
    root = tmp_path_factory.mktemp("wandb")
    saved = {key: os.environ.get(key) for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true"})
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tracked_server(
    demo: Any,
    ray_session: None,
    mlflow_server: MlflowServer,
    wandb_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    from tests.test_service import ServerThread, make_settings

    settings = make_settings(
        tmp_path_factory.mktemp("tracked-service"),
        demo.tasks_dir,
        mlflow_tracking_uri=mlflow_server.uri,
        wandb_project="rayeval-test",
        public_url=PUBLIC_URL,
    )
    server = ServerThread(settings)
    server.start()
    yield server
    server.stop()


def run_on_server(server: Any, demo: Any, **overrides: Any) -> dict[str, Any]:
    """Submit a demo evaluation and wait until it ends; its final state."""
    from tests.test_service import body, finished, submit, wait_for

    payload = body(demo, **{"tasks": TASKS, "limit": 4, "bootstrap_iters": 100, **overrides})
    with server.client() as client:
        evaluation = submit(client, payload)
        return wait_for(client, evaluation["id"], finished)


def wandb_runs(root: Path) -> list[Path]:
    return sorted((root / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.service
def test_service_records_a_tracked_evaluation_in_mlflow_and_wandb(
    tracked_server: Any, mlflow_server: MlflowServer, demo: Any, wandb_dir: Path, tmp_path: Path
) -> None:
    from tests.test_trackers import wandb_records

    tracking = {"experiment": "service-test", "run_name": "tiny", "tags": {"team": "evals"}}
    final = run_on_server(tracked_server, demo, tracking=tracking)
    assert final["status"] == "succeeded", final
    assert final["request"]["tracking"] == tracking
    with tracked_server.client() as client:
        results_text = client.get(f"/evaluations/{final['id']}/results").text
        samples = {t: client.get(f"/evaluations/{final['id']}/samples/{t}").text for t in TASKS}
    run = the_run(mlflow_server, "service-test")
    assert run.info.run_name == "tiny"
    assert run.data.tags["rayeval.evaluation_id"] == final["id"]
    assert run.data.tags["rayeval.url"] == f"{PUBLIC_URL}/#{final['id']}"
    assert run.data.tags["team"] == "evals"
    check_run(mlflow_server, run, results_text, samples, tmp_path)
    (run_file,) = wandb_runs(wandb_dir)
    summary = {key: value for kind, key, value in wandb_records(run_file) if kind == "summary"}
    results = json.loads(results_text)["results"]
    assert summary["demo_mc/acc"] == pytest.approx(results["demo_mc"]["acc,none"])
    assert summary["demo_mc/acc_stderr"] == pytest.approx(results["demo_mc"]["acc_stderr,none"])


@pytest.mark.service
def test_service_records_nothing_unless_asked(
    tracked_server: Any, mlflow_server: MlflowServer, demo: Any, wandb_dir: Path
) -> None:
    client = mlflow_server.client()
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    wandb_before = wandb_runs(wandb_dir)
    final = run_on_server(tracked_server, demo, limit=2)
    assert final["status"] == "succeeded", final
    after = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    assert after == before and wandb_runs(wandb_dir) == wandb_before


@pytest.mark.service
def test_service_with_mlflow_down_succeeds_with_a_warning_event(
    tracked_server: Any, mlflow_server: MlflowServer, demo: Any
) -> None:
    """Last in the module: the MLflow server is stopped first."""
    from tests.test_service import read_events

    mlflow_server.stop()
    final = run_on_server(tracked_server, demo, limit=2, tracking={})
    assert final["status"] == "succeeded", final
    events = read_events(tracked_server.url, f"/evaluations/{final['id']}/events")
    warnings = [e["data"] for e in events if e["event"] == "warning" and "tracker" in e["data"]]
    (warning,) = [w for w in warnings if w["tracker"] == "mlflow"]
    assert f"not recorded in MLflow at {mlflow_server.uri}" in warning["message"]
    assert [e["data"]["status"] for e in events if e["event"] == "state"][-1] == "succeeded"


# ------------------------------------------------------------------------------ unit tier
RESULTS: dict[str, Any] = {
    "results": {
        "demo_mc": {"alias": "demo_mc", "acc,none": 0.5, "acc_stderr,none": 0.1, "n": 3},
        "gsm": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"},
        "wiki": {"word_perplexity,none": 9.5, "word_perplexity_stderr,none": "N/A"},
    },
    "groups": {"all": {"acc,none": 0.4, "acc_stderr,none": 0.05, "flag,none": True}},
}


@pytest.mark.unit
def test_every_metric_and_stderr_is_named_for_mlflow() -> None:
    from rayeval.service.trackers import run_metrics

    assert run_metrics(RESULTS) == {
        "demo_mc/acc": 0.5,
        "demo_mc/acc_stderr": 0.1,
        "gsm/exact_match/strict-match": 0.25,
        "wiki/word_perplexity": 9.5,
        "all/acc": 0.4,
        "all/acc_stderr": 0.05,
    }


@pytest.mark.unit
def test_params_tags_and_wandb_arguments_of_an_evaluation() -> None:
    from rayeval.service.trackers import Trackers, run_name, run_params, run_tags, wandb_init_args
    from rayeval.service.vocabulary.config import EvaluationConfig

    config = EvaluationConfig.model_validate(
        {
            "model_args": {"pretrained": "/ckpts/step-100/", "dtype": "float32"},
            "tasks": ["demo_mc"],
            "parallelism": {"num_replicas": 2},
            "tracking": {"experiment": "sweep", "tags": {"team": "evals"}},
        }
    )
    trackers = Trackers("http://mlflow", "proj", server_url="http://srv:8000/", evaluation_id="e1")
    assert run_name(config) == "step-100"
    params = run_params(config)
    assert params["model_args.pretrained"] == "/ckpts/step-100/"
    assert params["parallelism.num_replicas"] == "2" and params["tasks"] == '["demo_mc"]'
    assert not any(key.startswith("tracking") for key in params)
    assert run_tags(config, trackers) == {
        "team": "evals",
        "rayeval.model": "/ckpts/step-100/",
        "rayeval.evaluation_id": "e1",
        "rayeval.url": "http://srv:8000/#e1",
    }
    args = wandb_init_args(config, trackers)
    assert args["project"] == "proj" and args["name"] == "step-100" and args["group"] == "sweep"
    assert "rayeval.evaluation_id=e1" in args["tags"] and "http://srv:8000/#e1" in args["notes"]
    assert trackers.names == ("mlflow", "wandb") and Trackers().names == ()
    assert Trackers(**trackers.to_json()) == trackers


@pytest.mark.unit
def test_tracking_from_the_command_line_and_refused_without_a_tracker() -> None:
    from pydantic import ValidationError

    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args
    from rayeval.service.jobs.validation import ServerPolicy, tracking_problems
    from rayeval.service.vocabulary.config import EvaluationConfig

    base = ["run", "--model_args", "pretrained=/models/m", "--tasks", "demo_mc"]
    config, host = config_from_args(build_parser().parse_args(base))
    assert config.tracking is None and host.trackers.names == ()
    uri = ["--mlflow_tracking_uri", "http://mlflow:5000"]
    config, host = config_from_args(build_parser().parse_args([*base, *uri]))
    assert config.tracking is not None and config.tracking.experiment is None  # asked by naming
    assert host.trackers.mlflow_tracking_uri == "http://mlflow:5000"
    named = ["--tracking", "experiment=sweep,run_name=100"]
    config, _ = config_from_args(build_parser().parse_args([*base, *uri, *named]))
    assert config.tracking is not None
    assert (config.tracking.experiment, config.tracking.run_name) == ("sweep", "100")
    problems = tracking_problems(config, ServerPolicy())
    assert problems and "--mlflow-tracking-uri" in problems[0] and "drop" in problems[0]
    assert tracking_problems(config, ServerPolicy(trackers=("mlflow",))) == []
    with pytest.raises(ValidationError, match="tags"):
        EvaluationConfig.model_validate(
            {"model_args": {"pretrained": "m"}, "tasks": ["t"], "tracking": {"tags": {"a,b": "x"}}}
        )


@pytest.mark.unit
def test_server_tracker_settings(tmp_path: Path) -> None:
    from rayeval.api.settings import Settings

    settings = Settings(
        data_dir=tmp_path, port=8123, mlflow_tracking_uri="http://mlflow", wandb_project="p"
    )
    assert settings.trackers.names == ("mlflow", "wandb")
    assert settings.trackers.server_url == "http://127.0.0.1:8123"
    assert Settings(data_dir=tmp_path, public_url="https://evals.example").trackers.server_url == (
        "https://evals.example"
    )
    assert Settings(data_dir=tmp_path).trackers.names == ()


@pytest.mark.unit
def test_tracker_warnings_travel_from_runner_to_stream() -> None:
    from rayeval.service.jobs.following import digest
    from rayeval.service.vocabulary.events import (
        RUNNER_EVENTS,
        EvaluationProgress,
        RequestWarning,
        RunnerWarning,
        TrackerWarning,
        TrackerWarningEvent,
        WarningEvent,
        stream_event,
    )

    tracker = TrackerWarning(tracker="mlflow", message="not recorded")
    request = RequestWarning(task="t", counts={"empty_continuation": 1}, example={})
    assert (
        RunnerWarning.parse(RunnerWarning(seq=1, time=1.0, warning=request).dump()).warning
        == request
    )
    events = [
        RunnerWarning(seq=1, time=1.0, warning=tracker),
        RunnerWarning(seq=2, time=2.0, warning=request),
    ]
    assert RUNNER_EVENTS.validate_json(RUNNER_EVENTS.dump_json(events)) == events
    stream = digest(EvaluationProgress(), events).events
    assert stream == [TrackerWarningEvent(**dict(tracker)), WarningEvent.of_warning(request)]
    for event in stream:
        kind, data = event.stored()
        assert stream_event(kind, json.loads(json.dumps(data))) == event
