"""The REST service end to end: a real uvicorn server, real Ray, real SQLite, a real browser.

One server (in a background thread of this process) and the session's Ray cluster
(``ray_session``: 4 logical CPUs) serve the whole module; runner and rank actors are real Ray
actors, and the evaluations run the bundled tiny Llama on the bundled tasks. Sharing this process's
Ray keeps the module within minutes on two cores (starting a Ray costs tens of seconds there),
lets the tests look at Ray directly (leftover actors, placement groups), and lets a restarted
server find the first server's runner actors, exactly as a restarted API process would on a
long-lived cluster.

Covered: fidelity against lm-eval's own ``hf`` backend through the results and samples
endpoints, the SSE stream (live, backlog, Last-Event-ID), restart (finished results kept, live
runners re-attached, lost runners failed), FIFO admission, cancellation without leftovers, every
bad input as a 4xx, auth, the loopback-only rule, the torch-free API, and the dashboard in
Chromium. Tests that need the server (and so Ray and evaluations) are in the ``service`` and
``e2e`` tiers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import assert_same_results, hf_reference

#: The smallest stored configuration (a store test needs only that it parses).
CONFIG_JSON = {"model_args": {"pretrained": "m"}, "tasks": ["t"]}

TASKS = ["demo_cloze", "demo_gen_short", "demo_mc"]
RUN = {"limit": 6, "bootstrap_iters": 0}
TERMINAL = {"succeeded", "failed", "cancelled"}
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ server
class ServerThread:
    """A uvicorn server for ``create_app(settings)`` in a background thread, on a free port."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.url = ""
        self._port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        import uvicorn

        from rayeval.api.app import create_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # A free port the first time (ours until the server closes it: no race); the same port
        # on a restart, so clients keep working, as with a real server.
        sock.bind(("127.0.0.1", self._port))
        self._port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self._port}"
        config = uvicorn.Config(
            create_app(self.settings),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            assert self._thread.is_alive(), "the server failed to start (see the log above)"
            assert time.monotonic() < deadline, f"the server did not start in {timeout_s}s"
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), f"the server did not stop in {timeout_s}s"

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, timeout=60.0, headers=headers)


def make_settings(data_dir: Path, include_path: Path, **overrides: Any) -> Any:
    from rayeval.api.settings import Settings

    return Settings(
        host="127.0.0.1",
        data_dir=data_dir,
        include_paths=[str(include_path)],
        model_roots=[str(include_path.parent)],
        poll_interval_s=0.2,
        sse_heartbeat_s=1.0,
        cancel_timeout_s=20.0,
        **overrides,
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rayeval-data")


@pytest.fixture(scope="module")
def server(demo: Any, ray_session: None, data_dir: Path) -> Iterator[ServerThread]:
    handle = ServerThread(make_settings(data_dir, demo.tasks_dir))
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


# ----------------------------------------------------------------------------- helpers
def body(demo: Any, **overrides: Any) -> dict[str, Any]:
    """A valid POST /evaluations body for the bundled model and tasks."""
    return {
        "model": "hf",
        "model_args": {"pretrained": str(demo.model_dir), "dtype": "float32"},
        "tasks": TASKS,
        "batch_size": "auto",
        "log_samples": True,
        **RUN,
        "parallelism": {"num_replicas": 2, "shard_size": 1},
        **overrides,
    }


def submit(client: httpx.Client, payload: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/evaluations", json=payload)
    assert response.status_code == 202, response.text
    evaluation = response.json()
    assert response.headers["location"] == f"/evaluations/{evaluation['id']}"
    return evaluation


def wait_for(
    client: httpx.Client,
    evaluation_id: str,
    done: Callable[[dict[str, Any]], bool],
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Poll GET /evaluations/{id} until ``done`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        evaluation = client.get(f"/evaluations/{evaluation_id}").json()
        if done(evaluation):
            return evaluation
        assert time.monotonic() < deadline, f"timed out waiting; last seen: {evaluation}"
        time.sleep(0.2)


def finished(evaluation: dict[str, Any]) -> bool:
    return evaluation["status"] in TERMINAL


def read_events(url: str, path: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Read an SSE stream to its end: a list of {id, event, data}."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    timeout = httpx.Timeout(30.0, read=60.0)
    with httpx.stream("GET", url + path, headers=headers or {}, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                if "event" in current:
                    events.append(current)
                current = {}
            elif line.startswith(":") or line.startswith("retry:"):
                continue
            else:
                field, _, value = line.partition(": ")
                current[field] = int(value) if field == "id" else value
    for event in events:
        event["data"] = json.loads(event["data"])
    return events


def lm_eval_files(results: dict[str, Any], out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """What lm-eval's own tracker writes for in-memory results: the results JSON and samples."""
    import copy

    from lm_eval.loggers import EvaluationTracker

    results = copy.deepcopy(results)
    samples = results.pop("samples")
    tracker = EvaluationTracker(output_path=str(out))
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    (results_file,) = out.rglob("results_*.json")
    written = {
        task: (results_file.parent / f"samples_{task}_{tracker.date_id}.jsonl").read_text()
        for task in results["configs"]
    }
    return json.loads(results_file.read_text()), written


def parse_samples(jsonl: str, output_type: str) -> list[dict[str, Any]]:
    """lm-eval's samples JSONL back to comparable dicts: scores revived from their strings."""
    samples = [json.loads(line) for line in jsonl.splitlines() if line.strip()]
    if output_type != "generate_until":  # lm-eval writes (logprob, is_greedy) as strings
        for sample in samples:
            sample["resps"] = _revive(sample["resps"])
    return samples


def _revive(value: Any) -> Any:
    if isinstance(value, list):
        return [_revive(v) for v in value]
    if value in ("True", "False"):
        return value == "True"
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def ray_leftovers(evaluation_id: str) -> tuple[list[str], list[str]]:
    """Alive actors named after the evaluation, and its placement groups not yet removed."""
    import ray

    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith((f"rayeval-{evaluation_id}", f"rayeval-runner-{evaluation_id}"))
    ]
    groups = [
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info["name"] == f"rayeval-{evaluation_id}" and info["state"] != "REMOVED"
    ]
    return names, groups


def leftovers_after(evaluation_id: str, timeout_s: float = 60.0) -> tuple[list[str], list[str]]:
    """:func:`ray_leftovers` once there are none, or what is still there after ``timeout_s``.

    An evaluation that ends is released in the background (the manager's releaser), a moment
    after its final state is stored: a check right after it would race that release.
    """
    deadline = time.monotonic() + timeout_s
    while (left := ray_leftovers(evaluation_id)) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# ------------------------------------------------------------------ the main evaluation
@pytest.fixture(scope="module")
def reference(demo: Any, task_manager: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """lm-eval's hf backend on the same model and tasks, as the files lm-eval writes."""
    results = hf_reference(demo.model_dir, task_manager, TASKS, **RUN)
    return results, *lm_eval_files(results, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def main_run(
    server: ServerThread, client: httpx.Client, demo: Any, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The 2x1 evaluation of the bundled tasks, followed live over SSE from submission on."""
    evaluation = submit(client, body(demo))
    live: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=lambda: live.extend(
            read_events(server.url, f"/evaluations/{evaluation['id']}/events")
        ),
        daemon=True,
    )
    reader.start()
    request.getfixturevalue("reference")  # computed here, while the evaluation runs on Ray
    final = wait_for(client, evaluation["id"], finished)
    reader.join(timeout=60)
    assert not reader.is_alive(), "the SSE stream did not end after the terminal event"
    return {"submitted": evaluation, "final": final, "live_events": live}


@pytest.mark.e2e
def test_results_and_samples_equal_lm_eval_hf(
    main_run: dict[str, Any], reference: Any, client: httpx.Client
) -> None:
    final = main_run["final"]
    assert final["status"] == "succeeded", final["error"]
    evaluation_id = final["id"]
    ref_results, ref_file, ref_samples_files = reference

    response = client.get(f"/evaluations/{evaluation_id}/results")
    assert response.status_code == 200
    ours = response.json()
    # The schema lm-eval writes: same top-level keys as lm-eval's own results file.
    assert set(ours) == set(ref_file)
    for key in ("versions", "n-shot", "higher_is_better", "n-samples"):
        assert ours[key] == ref_file[key], key
    assert ours["config"]["model"] == "hf"
    layout = ours["config"]["rayeval_layout"]
    assert (layout["num_replicas"], layout["shard_size"], layout["device"]) == (2, 1, "cpu")
    assert layout["shard_strategy"] is None  # nothing sharded at G = 1

    assert set(final["links"]["samples"]) == set(TASKS)
    ours_samples, ref_samples = {}, {}
    for task in TASKS:
        response = client.get(final["links"]["samples"][task])
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        output_type = ours["configs"][task]["output_type"]
        ours_samples[task] = parse_samples(response.text, output_type)
        ref_samples[task] = parse_samples(ref_samples_files[task], output_type)
    assert_same_results(
        {"results": ref_results["results"], "samples": ref_samples},
        {"results": ours["results"], "samples": ours_samples},
    )

    assert final["progress"]["done"] == final["progress"]["total"] > 0
    assert {"loglikelihood", "generate_until"} <= set(final["progress"]["phases"])
    assert final["throughput"]["tokens_per_s"] > 0
    assert final["stats"]["loglikelihood"]["requests"] > 0
    assert (
        final["started_at"] >= final["created_at"] and final["finished_at"] >= final["started_at"]
    )


@pytest.mark.service
def test_event_stream_live_backlog_and_resume(
    main_run: dict[str, Any], server: ServerThread, client: httpx.Client
) -> None:
    evaluation_id = main_run["final"]["id"]
    live = main_run["live_events"]
    assert [e["id"] for e in live] == list(range(1, len(live) + 1)), "ids are 1, 2, 3, ..."
    states = [e["data"]["status"] for e in live if e["event"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    kinds = [e["event"] for e in live]
    running = next(i for i, e in enumerate(live) if e["data"].get("status") == "running")
    first_progress, first_result = kinds.index("progress"), kinds.index("task_result")
    assert running < first_progress < first_result < kinds.index("result")
    assert kinds[-1] == "state" and live[-1]["data"]["status"] == "succeeded"
    progress = [e["data"] for e in live if e["event"] == "progress"]
    assert all(0 < p["done"] <= p["total"] for p in progress)
    assert any(p["done"] == p["total"] for p in progress)
    assert {e["data"]["task"] for e in live if e["event"] == "task_result"} == set(TASKS)
    (result,) = [e["data"] for e in live if e["event"] == "result"]
    assert result == client.get(f"/evaluations/{evaluation_id}/results").json()

    # A late client gets the whole backlog, then the stream ends.
    path = f"/evaluations/{evaluation_id}/events"
    assert read_events(server.url, path) == live
    # Last-Event-ID (header, as browsers send it, or ?after=) resumes after that event.
    assert read_events(server.url, path, {"Last-Event-ID": "3"}) == live[3:]
    assert read_events(server.url, path + "?after=5") == live[5:]
    assert read_events(server.url, path, {"Last-Event-ID": str(len(live))}) == []
    response = client.get(path, headers={"Last-Event-ID": "soon"})
    assert response.status_code == 422 and "Last-Event-ID" in response.json()["detail"]


@pytest.mark.e2e
def test_dashboard_lists_evaluation_and_shows_metrics(
    main_run: dict[str, Any], server: ServerThread, client: httpx.Client
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    evaluation_id = main_run["final"]["id"]
    results = client.get(f"/evaluations/{evaluation_id}/results").json()
    expected = {task: results["results"][task] for task in TASKS}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.url + "/")
            row = page.locator(f"#evaluations tr[data-id='{evaluation_id}']")
            row.wait_for(timeout=30_000)
            assert row.get_attribute("data-status") == "succeeded"
            row.click()
            page.locator("#metrics tr[data-task='demo_mc']").first.wait_for(timeout=30_000)
            assert page.text_content("#detail-status") == "succeeded"
            for task, metrics in expected.items():
                for key, value in metrics.items():
                    if key == "alias" or "_stderr," in key or not isinstance(value, float):
                        continue
                    metric = key.split(",")[0]
                    shown = page.locator(
                        f"#metrics tr[data-task='{task}'][data-metric='{metric}'] td.value"
                    ).first.text_content()
                    assert shown == f"{value:.4f}", (task, metric, shown, value)
            assert errors == []
        finally:
            browser.close()


@pytest.mark.service
def test_restart_keeps_finished_and_fails_lost_runs(
    main_run: dict[str, Any], server: ServerThread, client: httpx.Client, demo: Any
) -> None:
    from rayeval.service.jobs.store import EvaluationStore
    from rayeval.service.vocabulary.states import EvaluationStatus

    evaluation_id = main_run["final"]["id"]
    results_before = client.get(f"/evaluations/{evaluation_id}/results").content
    samples_url = main_run["final"]["links"]["samples"]["demo_mc"]
    samples_before = client.get(samples_url).content
    events_before = read_events(server.url, f"/evaluations/{evaluation_id}/events")

    server.stop()
    # While the server is down, the database says an evaluation was starting: its runner
    # actor does not exist on the cluster, so the restarted server must fail it with a reason.
    store = EvaluationStore(server.settings.effective_database_url)
    spec = {**main_run["final"]["request"]}
    lost = store.create(_spec_dict(spec), {"CPU": 1.0})
    assert store.transition(lost.id, EvaluationStatus.STARTING)
    store.close()
    server.start()

    assert client.get(f"/evaluations/{evaluation_id}").json()["status"] == "succeeded"
    assert client.get(f"/evaluations/{evaluation_id}/results").content == results_before
    assert client.get(samples_url).content == samples_before
    assert read_events(server.url, f"/evaluations/{evaluation_id}/events") == events_before
    failed = client.get(f"/evaluations/{lost.id}").json()
    assert failed["status"] == "failed"
    assert "runner actor" in failed["error"] and "resubmit" in failed["error"]


def _spec_dict(request: dict[str, Any]) -> dict[str, Any]:
    """A stored config from a public request (the request is the config)."""
    from rayeval.service.vocabulary.config import EvaluationConfig

    return EvaluationConfig.model_validate(request).to_json()


# ------------------------------------------------------------- admission, restart, cancel
@pytest.mark.service
def test_admission_fifo_cancel_and_reattach(
    server: ServerThread, client: httpx.Client, demo: Any
) -> None:
    """Scheduling on the 4-CPU cluster, in one scenario so that evaluations start side by side.

    A (1x3) and C (1x1) fit together and start at once; B (1x3) and D (1x3) wait, FIFO. D is
    cancelled while queued. The API restarts while A and C run: their detached runners are
    re-attached. C is cancelled while running and Ray keeps nothing of it. B starts only after
    A has finished.
    """
    small = {
        "model_args": f"pretrained={demo.model_dir},dtype=float32",  # lm-eval's string form
        "tasks": "demo_cloze",
        "limit": 4,
        "num_fewshot": 1,  # requests no earlier test computed: A is not answered by the cache
        "parallelism": {"num_replicas": 1, "shard_size": 3},
    }
    long_run = {
        "tasks": ["demo"],
        "limit": None,
        "num_fewshot": 3,
        "batch_size": 1,
        "log_samples": False,
        "parallelism": {"num_replicas": 1, "shard_size": 1},
    }
    a = submit(client, body(demo, **small))
    c = submit(client, body(demo, **long_run))
    b = submit(client, body(demo, **small))
    d = submit(client, body(demo, **small, log_samples=False))
    for started in (a, c):
        wait_for(client, started["id"], lambda e: e["status"] != "queued", 120)

    # B and D wait in submission order; nothing about them exists yet.
    queued = client.get("/evaluations", params={"status": "queued"}).json()["items"]
    assert [(e["id"], e["queue_position"]) for e in queued] == [(d["id"], 2), (b["id"], 1)]
    response = client.get(f"/evaluations/{b['id']}/results")
    assert response.status_code == 409 and "is queued" in response.json()["detail"]
    assert client.get(f"/evaluations/{b['id']}/samples/demo_cloze").status_code == 409
    cancelled = client.delete(f"/evaluations/{d['id']}")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["started_at"] is None

    # The API restarts; A's and C's runner actors live on and are re-attached.
    server.restart()
    for evaluation in (a, c):
        status = client.get(f"/evaluations/{evaluation['id']}").json()
        assert status["status"] in {"starting", "running", "succeeded"}, status["error"]

    _cancel_while_running(client, c)
    a, b = _a_then_b(server, client, a, b)
    for evaluation in (a, b, d):
        assert leftovers_after(evaluation["id"]) == ([], [])
    # The manager never overwrote a cancel with a "runner died" failure.
    assert client.get(f"/evaluations/{c['id']}").json()["status"] == "cancelled"
    assert client.get(f"/evaluations/{d['id']}").json()["status"] == "cancelled"


def _cancel_while_running(client: httpx.Client, c: dict[str, Any]) -> None:
    """Cancelling C while it runs releases its runner, rank actor and placement group at once."""
    running = wait_for(client, c["id"], lambda e: e["status"] in TERMINAL | {"running"}, 180)
    assert running["status"] == "running", running["error"]
    actors, groups = ray_leftovers(c["id"])
    assert len(actors) == 2 and groups, "C's runner and its rank actor should be alive"
    sent = time.monotonic()
    response = client.delete(f"/evaluations/{c['id']}")
    took = time.monotonic() - sent
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "cancelled" and took < 20, took
    assert ray_leftovers(c["id"]) == ([], [])
    again = client.delete(f"/evaluations/{c['id']}")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    assert client.get(f"/evaluations/{c['id']}/results").status_code == 409


def _a_then_b(
    server: ServerThread, client: httpx.Client, a: dict[str, Any], b: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A then B, never both at once; B started only after A had finished."""
    a = wait_for(client, a["id"], finished)
    b = wait_for(client, b["id"], finished)
    assert a["status"] == b["status"] == "succeeded", (a["error"], b["error"])
    # A's ranks are released as soon as lm-eval is done with them, before A's results are
    # stored: B may start in between, but never while A's ranks still compute.
    a_events = read_events(server.url, f"/evaluations/{a['id']}/events")
    a_last_batch = max(e["data"]["updated_at"] for e in a_events if e["event"] == "progress")
    b_started = datetime.fromisoformat(b["started_at"]).replace(tzinfo=UTC).timestamp()
    assert b_started >= a_last_batch, "B started while A's ranks were computing"
    states = [e["data"]["status"] for e in a_events if e["event"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"], "A ran exactly once"
    return a, b


# --------------------------------------------------------------------------- bad inputs
OMIT = object()  # a field left out of the body
BAD_BODIES = [
    ("not JSON", "not valid JSON"),
    ({"tasks": OMIT}, "tasks: required field missing"),
    ({"model_args": OMIT}, "model_args: required field missing"),
    ({"model_args": {"dtype": "float32"}}, "needs pretrained"),
    ({"extra_field": 1}, "unknown field 'extra_field'"),
    ({"include_path": "/tmp"}, "include_path: task directories come only from the server"),
    ({"output_path": "/tmp"}, "GET /evaluations/{id}/results"),
    ({"num_replicas": 2}, '"parallelism"'),
    ({"model": "vllm"}, "model: 'vllm' is not supported: rayeval runs lm-eval's Hugging Face"),
    ({"model_args": {"pretrained": "/nonexistent/model"}}, "is not a model under this server"),
    ({"model_args": "pretrained=./no/such/model,dtype=float32"}, "is not a model under this"),
    ({"model_args": {"pretrained": "/etc"}}, "is not a model under this server's model roots"),
    ({"model_args": "pretrained=org/model,tokenizer=/etc/passwd"}, "tokenizer: '/etc/passwd'"),
    ({"model_args": "pretrained=org/model,trust_remote_code=True"}, "--allow-remote-code"),
    (
        {"model_args": {"pretrained": "org/model", "trust_remote_code": "no"}},
        "trust_remote_code: 'no' is not a boolean",
    ),
    ({"model_args": "pretrained=org/model,cache_dir=/tmp"}, "cache_dir: not settable"),
    ({"model_args": "pretrained=org/model,subfolder=../../etc"}, "subfolder: a relative"),
    ({"gen_kwargs": {"custom_generate": "/tmp/x", "trust_remote_code": True}}, "custom_generate"),
    ({"gen_kwargs": "a"}, "gen_kwargs.a: not a generation setting"),
    ({"gen_kwargs": {"temperature": -1}}, "gen_kwargs.temperature: -1 is not a valid value"),
    ({"limit": 1e308}, "limit: Input should be less than or equal to"),
    ('{"model_args": "pretrained=org/m", "tasks": "demo_mc", "limit": Infinity}', "limit"),
    ({"num_fewshot": 1e30}, "num_fewshot"),
    ({"seed": 2**40}, "seed"),
    ({"samples": {"demo_nope": [0]}, "limit": None}, "samples: unknown tasks: 'demo_nope'"),
    (
        {"model_args": "pretrained=org/model,parallelize=True"},
        "parallelize: rayeval shards the model itself: use parallelism.shard_size instead",
    ),
    ({"tasks": ["../../etc/task.yaml"]}, "look like paths"),
    ({"tasks": []}, "at least one task"),
    ({"tasks": ["demo_nope"]}, "tasks: unknown tasks: 'demo_nope'"),
    (
        {"parallelism": {"num_replicas": 3, "shard_size": 2}},
        "6 CPU requested, 4 in the cluster. Lower parallelism.num_replicas / "
        "parallelism.shard_size, or add nodes",
    ),
    ({"parallelism": {"num_replicas": 0}}, "parallelism.num_replicas"),
    (
        {"parallelism": {"shard_size": 3, "shard_strategy": "tp"}},
        "shard_strategy tp cannot shard this model: num_attention_heads=4 is not divisible by "
        "shard_size 3",
    ),
    ({"parallelism": {"shard_strategy": "megatron"}}, "parallelism.shard_strategy"),
    ({"parallelism": {"replicas": 2}}, "unknown field 'parallelism.replicas'"),
    ({"batch_size": "big"}, "is not a batch size"),
    ({"limit": -1}, "limit"),
    ({"fewshot_as_multiturn": True}, "apply_chat_template"),
    ({"samples": {"demo_mc": [0, 1]}}, "--limit must be None"),
    ({"seed": [1, 2]}, "seed expects"),
    ({"timeouts": {"step_s": 0}}, "timeouts.step_s"),
]


@pytest.fixture(scope="module")
def task_index_ready(client: httpx.Client) -> None:
    """Unknown tasks are told apart only once lm-eval's index is built (in the background)."""
    deadline = time.monotonic() + 300
    while client.get("/healthz").json()["task_index"] != "ready":
        assert time.monotonic() < deadline, "lm-eval's task index was not built in 300s"
        time.sleep(1.0)


@pytest.mark.service
@pytest.mark.parametrize(("overrides", "message"), BAD_BODIES, ids=lambda v: str(v)[:40])
def test_bad_input_is_a_422_naming_the_fix(
    overrides: Any, message: str, client: httpx.Client, demo: Any, task_index_ready: None
) -> None:
    if isinstance(overrides, str):
        response = client.post(
            "/evaluations", content=overrides, headers={"content-type": "application/json"}
        )
        assert "Infinity" in overrides or overrides == "not JSON"
    else:
        payload = {k: v for k, v in body(demo, **overrides).items() if v is not OMIT}
        response = client.post("/evaluations", json=payload)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert message in detail, detail
    assert "--num_replicas" not in detail and "--shard_" not in detail, "a REST body has no flags"


@pytest.mark.service
def test_a_body_that_is_not_a_json_object_says_what_to_send(
    client: httpx.Client, demo: Any
) -> None:
    payload = json.dumps(body(demo)).encode()
    form = "application/x-www-form-urlencoded"  # what `curl -d` sends
    for headers, message in (
        ({}, "(this request had no Content-Type;"),
        ({"content-type": form}, f"(this request had Content-Type '{form}';"),
        ({"content-type": "text/plain"}, "Content-Type 'text/plain'"),
    ):
        response = client.post("/evaluations", content=payload, headers=headers)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert "with the header Content-Type: application/json" in detail, detail
        assert message in detail, detail
    for content, message in ((b"", "the body is empty"), (b"[1]", "must be a JSON object")):
        response = client.post(
            "/evaluations", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text
        assert message in response.json()["detail"], response.text


@pytest.mark.service
def test_unknown_ids_and_bad_queries(client: httpx.Client, main_run: dict[str, Any]) -> None:
    for path in (
        "/evaluations/nope",
        "/evaluations/nope/results",
        "/evaluations/nope/events",
        "/evaluations/nope/samples/demo_mc",
    ):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "GET /evaluations" in response.json()["detail"]
    assert client.delete("/evaluations/nope").status_code == 404
    evaluation_id = main_run["final"]["id"]
    response = client.get(f"/evaluations/{evaluation_id}/samples/demo_rolling")
    assert response.status_code == 404 and "demo_mc" in response.json()["detail"]
    assert client.get("/evaluations", params={"status": "done"}).status_code == 422
    assert client.get("/evaluations", params={"limit": 0}).status_code == 422

    page = client.get("/evaluations", params={"limit": 1}).json()
    assert len(page["items"]) == 1 and page["total"] >= 1
    everything = client.get("/evaluations", params={"limit": 200}).json()["items"]
    created = [e["created_at"] for e in everything]
    assert created == sorted(created, reverse=True), "newest first"
    succeeded = client.get("/evaluations", params={"status": "succeeded"}).json()["items"]
    assert succeeded and all(e["status"] == "succeeded" for e in succeeded)


@pytest.mark.service
def test_missing_and_forbidden_paths_get_one_answer(client: httpx.Client, demo: Any) -> None:
    """No file oracle: a path that exists outside the model roots reads like a missing one."""

    def detail(path: str) -> str:
        response = client.post(
            "/evaluations", json=body(demo, model_args={"pretrained": path, "dtype": "float32"})
        )
        assert response.status_code == 422, response.text
        return str(response.json()["detail"]).replace(repr(path), "PATH")

    assert detail("/etc") == detail("/no/such/dir") == detail(str(demo.model_dir / "missing"))
    assert detail(str(demo.model_dir.parent / "tasks")) == detail("/etc"), "not a model dir"


@pytest.mark.service
def test_big_numbers_and_foreign_hosts_are_4xx(client: httpx.Client, server: ServerThread) -> None:
    for params in ({"offset": 2**63}, {"offset": -1}, {"limit": 10**30}):
        assert client.get("/evaluations", params=params).status_code == 422, params
    response = client.get("/evaluations/x/events", params={"after": 2**63})
    assert response.status_code in (404, 422)
    response = client.get("/evaluations/x/events", headers={"Last-Event-ID": str(2**63)})
    assert response.status_code in (404, 422)
    # DNS rebinding: a tokenless server answers only to its own names.
    foreign = client.get("/evaluations", headers={"Host": "attacker.example"})
    assert foreign.status_code == 400 and "--allowed-host" in foreign.json()["detail"]
    port = server.url.rsplit(":", 1)[1]
    assert client.get("/healthz", headers={"Host": f"localhost:{port}"}).status_code == 200


def page_references(html: str) -> list[str]:
    """Every URL an API docs page loads: links, scripts, its spec (Swagger's ``url:``)."""
    import re

    pattern = r"""(?:href|src|spec-url)=["']([^"']+)["']|\burl:\s*["']([^"']+)["']"""
    return [a or b for a, b in re.findall(pattern, html)]


@pytest.mark.service
def test_api_docs_load_everything_from_this_server(client: httpx.Client) -> None:
    """/docs works without internet: each asset it references is served here."""
    response = client.get("/docs")
    assert response.status_code == 200
    references = page_references(response.text)
    assert any(url.endswith("swagger-ui-bundle.js") for url in references), references
    assert any(url.endswith(".css") for url in references), references
    for url in references:
        assert url.startswith("/") and not url.startswith("//"), f"/docs loads {url}"
        fetched = client.get(url)
        assert fetched.status_code == 200 and fetched.content, url
    # ReDoc's bundle fetches its logo from its CDN whatever the page says: not served.
    assert client.get("/redoc").status_code == 404


@pytest.mark.e2e
def test_api_docs_render_offline_in_a_browser(server: ServerThread) -> None:
    """Chromium renders /docs with every request (the script's own included) to this server."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            requested: list[str] = []
            page.on("request", lambda request: requested.append(request.url))
            page.goto(server.url + "/docs")
            operations = page.locator("#swagger-ui .opblock-summary-path")
            operations.first.wait_for(timeout=30_000)
            page.wait_for_load_state("networkidle")
            assert "/evaluations" in operations.all_text_contents()
            foreign = [url for url in requested if not url.startswith(server.url + "/")]
            assert foreign == [], foreign
        finally:
            browser.close()


@pytest.mark.unit
def test_openapi_is_true_to_the_server(tmp_path: Path) -> None:
    from rayeval.api.app import create_app
    from rayeval.api.settings import Settings

    open_schema = create_app(Settings(data_dir=tmp_path)).openapi()
    assert "securitySchemes" not in open_schema.get("components", {})
    post = open_schema["paths"]["/evaluations"]["post"]
    assert "security" not in post
    error = post["responses"]["422"]["content"]["application/json"]["schema"]
    assert error["$ref"].endswith("/ErrorBody")
    assert "400" in open_schema["paths"]["/evaluations"]["get"]["responses"]
    guarded = create_app(Settings(data_dir=tmp_path, api_token="t")).openapi()
    assert guarded["components"]["securitySchemes"]
    assert guarded["paths"]["/evaluations"]["post"]["security"]


@pytest.mark.service
def test_killed_runner_then_retry_computes_only_the_rest(
    server: ServerThread, client: httpx.Client, demo: Any, task_manager: Any, tmp_path: Path
) -> None:
    """Every answer is kept as it completes: a retry of a crashed evaluation reuses them all and
    its results equal a clean run's (lm-eval's hf backend here)."""
    import ray

    tasks = ["demo_cloze", "demo_mc"]
    # 40 docs each; perplexity's stderr is bootstrapped: the runner's single-process bootstrap
    # (no pool forked from its thread) must give lm-eval's pooled numbers.
    run = {"limit": None, "num_fewshot": 2, "bootstrap_iters": 1000}
    payload = body(demo, tasks=tasks, batch_size=1, parallelism={"num_replicas": 1}, **run)
    crashed = submit(client, payload)
    wait_for(client, crashed["id"], lambda e: e["progress"]["done"] >= 8 or finished(e), 240)
    ray.kill(ray.get_actor(f"rayeval-runner-{crashed['id']}", namespace="rayeval"))
    crashed = wait_for(client, crashed["id"], finished, 60)
    assert crashed["status"] == "failed" and "runner actor" in crashed["error"]
    done_before = crashed["progress"]["done"]

    response = client.post(f"/evaluations/{crashed['id']}/retry")
    assert response.status_code == 202, response.text
    retried = wait_for(client, response.json()["id"], finished, 300)
    assert retried["status"] == "succeeded", retried["error"]
    cached = sum(phase["cached"] for phase in retried["stats"].values())
    computed = sum(phase["requests"] for phase in retried["stats"].values())
    assert cached >= done_before > 0, (cached, done_before)
    # Nothing the killed runner finished is computed again (the response cache counts it).
    assert sum(phase["recomputed"] for phase in retried["stats"].values()) == 0
    # Progress counts the cached answers as done: the whole evaluation, not only what ran.
    progress = retried["progress"]
    assert progress["done"] == progress["total"] == cached + computed
    assert progress["cached"] == cached
    assert cached + computed == 40 + 40 * 4, "every request once: computed or from the cache"
    assert client.post(f"/evaluations/{retried['id']}/retry").status_code == 409

    reference = hf_reference(demo.model_dir, task_manager, tasks, **run)
    _, reference_files = lm_eval_files(reference, tmp_path)
    ours = client.get(f"/evaluations/{retried['id']}/results").json()
    samples, reference_samples = {}, {}
    for task, url in retried["links"]["samples"].items():
        output_type = ours["configs"][task]["output_type"]
        samples[task] = parse_samples(client.get(url).text, output_type)
        reference_samples[task] = parse_samples(reference_files[task], output_type)
    assert_same_results(
        {"results": reference["results"], "samples": reference_samples},
        {"results": ours["results"], "samples": samples},
    )


def _task_aggregated_by(tasks: Path, name: str, aggregation: str) -> None:
    """A multiple-choice task ``name`` in ``tasks`` whose ``acc`` is aggregated by
    ``aggregation`` (the body of ``def aggregate(items):`` in the folder's utils.py)."""
    import yaml

    from rayeval.service.demo import DATA_DIR

    tasks.mkdir(exist_ok=True)
    (tasks / "utils.py").write_text(f"import time\n\n\ndef aggregate(items):\n{aggregation}\n")
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(DATA_DIR / "mc_test.jsonl")}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "AGG", "higher_is_better": True}],
    }
    text = yaml.safe_dump(config).replace("AGG", "!function utils.aggregate")
    (tasks / f"{name}.yaml").write_text(text)


@pytest.mark.service
def test_a_stalled_evaluation_fails_naming_where_and_is_released(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    """lm-eval stuck after the last batch (here: a metric aggregation that never returns) is
    noticed by the progress watchdog, not left holding its ranks."""
    tasks = tmp_path / "tasks"
    _task_aggregated_by(tasks, "stall_mc", "    time.sleep(3600)\n    return 0.0")
    settings = make_settings(tmp_path / "data", tasks, stall_timeout_s=3.0)
    settings = settings.model_copy(update={"model_roots": [str(demo.model_dir.parent)]})
    stalled_server = ServerThread(settings)
    stalled_server.start()
    try:
        with stalled_server.client() as c:
            payload = body(demo, tasks=["stall_mc"], limit=2, timeouts={"step_s": 5.0})
            payload["parallelism"] = {"num_replicas": 1}
            evaluation = submit(c, payload)
            final = wait_for(c, evaluation["id"], finished, 180)
        assert final["status"] == "failed", final
        assert "no progress for" in final["error"], final["error"]
        assert "lm-eval was computing metrics" in final["error"], final["error"]
        assert leftovers_after(evaluation["id"]) == ([], [])
    finally:
        stalled_server.stop()


@pytest.mark.service
def test_a_failed_evaluation_s_error_names_the_cause_and_its_event_the_traceback(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    """An exception inside the run (here: a task's metric aggregation) fails the evaluation:
    REST's ``error`` names it, and the stream's failed state event carries the traceback, down
    to the line of the task's own code that raised."""
    tasks = tmp_path / "tasks"
    _task_aggregated_by(tasks, "boom_mc", "    raise ValueError('boom in the aggregation')")
    settings = make_settings(tmp_path / "data", tasks)
    settings = settings.model_copy(update={"model_roots": [str(demo.model_dir.parent)]})
    failing_server = ServerThread(settings)
    failing_server.start()
    try:
        with failing_server.client() as c:
            payload = body(demo, tasks=["boom_mc"], limit=2)
            payload["parallelism"] = {"num_replicas": 1}
            evaluation = submit(c, payload)
            final = wait_for(c, evaluation["id"], finished, 180)
        assert final["status"] == "failed", final
        assert "ValueError: boom in the aggregation" in final["error"], final["error"]
        events = read_events(failing_server.url, f"/evaluations/{evaluation['id']}/events")
        (state,) = [e["data"] for e in events if e["data"].get("status") == "failed"]
        assert state["error"] == final["error"]
        assert state["traceback"].startswith("Traceback (most recent call last):"), state
        assert 'utils.py", line 5, in aggregate' in state["traceback"], state["traceback"]
        assert leftovers_after(evaluation["id"]) == ([], [])
    finally:
        failing_server.stop()


@pytest.mark.service
def test_warm_replicas_serve_the_next_evaluation_then_give_way(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    """With --warm-replicas, a second evaluation of the same model and layout runs on the first
    one's loaded ranks with identical results; a queued evaluation that needs the room gets it,
    and shutdown releases what is kept."""
    settings = make_settings(
        tmp_path / "data", demo.tasks_dir, warm_replicas=1, response_cache=False
    )
    warm_server = ServerThread(settings)
    warm_server.start()
    try:
        with warm_server.client() as c:
            first = wait_for(c, submit(c, body(demo))["id"], finished, 300)
            assert first["status"] == "succeeded", first["error"]
            kept = ray_leftovers(first["id"])
            assert len(kept[0]) == 3 and kept[1], f"runner and 2 ranks kept: {kept}"
            pids = _rank_pids(first["id"])

            second = wait_for(c, submit(c, body(demo))["id"], finished, 300)
            assert second["status"] == "succeeded", second["error"]
            assert ray_leftovers(second["id"]) == ([], []), "nothing new was started"
            assert _rank_pids(first["id"]) == pids, "the same rank processes served it"
            for task in TASKS:
                ours = [c.get(e["links"]["samples"][task]).text for e in (first, second)]
                assert ours[0] == ours[1], f"{task}: samples differ warm vs cold"
            results = [c.get(f"/evaluations/{e['id']}/results").json() for e in (first, second)]
            assert results[0]["results"] == results[1]["results"]

            # Three replicas do not fit beside the kept two ranks on 4 CPUs: they are released.
            wide = body(demo, parallelism={"num_replicas": 3, "shard_size": 1})
            third = wait_for(c, submit(c, wide)["id"], finished, 300)
            assert third["status"] == "succeeded", third["error"]
            assert leftovers_after(first["id"]) == ([], [])
            assert ray_leftovers(third["id"])[0], "the last one is kept"
    finally:
        warm_server.stop()
    assert ray_leftovers(third["id"]) == ([], []), "shutdown releases kept replicas"


def _rank_pids(owner: str) -> list[int]:
    """Process ids of the rank actors named after ``owner``."""
    import ray

    ranks = [
        ray.get_actor(entry["name"], namespace=entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(f"rayeval-{owner}-r")
    ]
    infos = ray.get([rank.node_info.remote() for rank in ranks], timeout=60)
    return sorted(info.pid for info in infos)


# --------------------------------------------------------------------- auth and binding
@pytest.mark.service
def test_token_guards_every_endpoint_but_healthz(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    token = "s3cret-token"
    guarded = ServerThread(make_settings(tmp_path, demo.tasks_dir, api_token=token))
    guarded.start()
    try:
        with (
            guarded.client() as anonymous,
            guarded.client("wrong") as wrong,
            guarded.client(token) as authorised,
        ):
            assert anonymous.get("/healthz").status_code == 200
            assert anonymous.get("/").status_code == 200  # the page holds no data
            for method, path in [
                ("GET", "/evaluations"),
                ("POST", "/evaluations"),
                ("GET", "/evaluations/x"),
                ("GET", "/evaluations/x/results"),
                ("GET", "/evaluations/x/samples/demo_mc"),
                ("GET", "/evaluations/x/events"),
                ("DELETE", "/evaluations/x"),
            ]:
                for who in (anonymous, wrong):
                    response = who.request(method, path, json={})
                    assert response.status_code == 401, (method, path)
                    assert response.headers["www-authenticate"] == "Bearer"
                    assert "Authorization: Bearer" in response.json()["detail"]
            assert authorised.get("/evaluations").status_code == 200
            assert authorised.get("/evaluations/x").status_code == 404
    finally:
        guarded.stop()


@pytest.mark.unit
def test_refuses_public_address_without_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAYEVAL_API_TOKEN"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayeval.api.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 2
    assert "refusing to listen on '0.0.0.0' without an API token" in done.stderr
    assert "--api-token" in done.stderr


@pytest.mark.unit
def test_loopback_rule() -> None:
    from pydantic import ValidationError

    from rayeval.api.settings import Settings, is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "example.com"))
    assert Settings(host="0.0.0.0", api_token="t").host == "0.0.0.0"
    with pytest.raises(ValidationError, match="without an API token"):
        Settings(host="0.0.0.0", api_token="")


# ----------------------------------------------------------------------- layering rules
@pytest.mark.unit
def test_api_never_imports_torch() -> None:
    code = (
        "import sys; import rayeval.api.app, rayeval.api.cli, rayeval.service.vocabulary.config, "
        "rayeval.service.jobs.manager, rayeval.service.jobs.runner_actor; "
        "from rayeval.api.settings import Settings; rayeval.api.app.create_app(Settings()); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.unit
def test_status_lifecycle(tmp_path: Path) -> None:
    """The state machine: terminal states have no way out, and the store allows only its moves."""
    from rayeval.service.jobs.store import EvaluationStore
    from rayeval.service.vocabulary.states import EvaluationStatus as S

    assert {s.value for s in S if s.is_terminal} == TERMINAL
    assert {s.value for s in S if s.is_active} == {"starting", "running"}
    assert S.sources_of(S.RUNNING) == {S.STARTING}
    assert S.sources_of(S.STARTING) == {S.QUEUED}
    assert not S.QUEUED.can_become(S.SUCCEEDED) and not S.SUCCEEDED.can_become(S.FAILED)

    store = EvaluationStore(f"sqlite:///{tmp_path / 'states.db'}")
    store.create_schema()
    record = store.create(CONFIG_JSON, {"CPU": 1.0})
    assert not store.transition(record.id, S.RUNNING), "queued -> running skips starting"
    assert not store.finish_succeeded(record.id, "{}", {}, {}, [])
    assert store.transition(record.id, S.STARTING)
    assert not store.transition(record.id, S.CANCELLED, only_from=[S.QUEUED])
    assert store.transition(record.id, S.RUNNING)
    assert store.transition(record.id, S.FAILED, error="boom")
    assert not any(store.transition(record.id, to) for to in S), "failed is final"
    states = [e.data["status"] for e in store.events_since(record.id, 0)]
    assert states == ["queued", "starting", "running", "failed"]
    store.close()
