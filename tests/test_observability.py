"""What a team watches and compares: /metrics, the dashboard's plot and comparison, the client.

One real uvicorn server with an API token, on the session's Ray. Two evaluations run on it:
A (2 replicas, one request per micro-batch, so progress moves in many small steps) submitted with
``rayeval submit --wait`` in a thread, and B (one replica reserving 3 CPUs, so it waits in the
queue while A runs; more documents, so part of it comes from the response cache and its metrics
differ from A's). While they run, ``/metrics`` is scraped over HTTP. Then D, A's request again,
is answered by the response cache alone (no rank starts). Afterwards Chromium shows A's throughput
plot, D's answers from the cache, and compares A with B.

Nothing here depends on how fast the machine is. The server's demo tasks are a copy whose
``demo_mc`` aggregates ``acc_norm`` through a gate: an evaluation that has answered every request
stays running, its final progress stored, until the test has scraped it and opens its gate (one
per evaluation, by its number of documents). What moved in between is read from the progress
events the service recorded (``/evaluations/{id}/timeline``), not from scrapes racing the run.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_service import (
    CHROMIUM,
    CHROMIUM_ARGS,
    TERMINAL,
    ServerThread,
    body,
    make_settings,
)

TOKEN = "observability-token"
#: demo_gen_long generates up to 40 tokens per request: with one request per micro-batch its
#: request type takes many steps.
TASKS = ["demo_cloze", "demo_gen_long", "demo_mc"]
#: Documents per task of A and of B (and C): the gate of each evaluation is named by its count.
A_DOCS, B_DOCS = 12, 15
#: The request types of TASKS.
REQUEST_TYPES = {"loglikelihood", "generate_until"}
GATE = """\
import time
from pathlib import Path


def mean_when_open(items):
    \"\"\"lm-eval's mean, once the test has created open-<documents> beside this file.\"\"\"
    opened = Path(__file__).with_name(f"open-{len(items)}")
    deadline = time.monotonic() + 600
    while not opened.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return sum(items) / len(items)
"""


@pytest.fixture(scope="module")
def gated_tasks(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tasks, ``demo_mc``'s ``acc_norm`` aggregated by :data:`GATE`."""
    from tests.helpers import gated_tasks_dir

    return gated_tasks_dir(demo.tasks_dir, tmp_path_factory.mktemp("gated-tasks"), GATE)


@pytest.fixture(scope="module")
def server(
    demo: Any, ray_session: None, gated_tasks: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    settings = make_settings(tmp_path_factory.mktemp("observability"), gated_tasks, api_token=TOKEN)
    settings = settings.model_copy(update={"model_roots": [str(demo.model_dir.parent)]})
    handle = ServerThread(settings)
    handle.start()
    yield handle
    handle.stop()


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics over HTTP, parsed: family name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(response.text)
    }


def values(
    scrapes: list[dict[str, Any]], family: str, **labels: str
) -> list[tuple[dict[str, str], float]]:
    """Every sample of ``family`` whose labels include ``labels``, over all scrapes."""
    return [
        (sample_labels, value)
        for scraped in scrapes
        for sample_labels, value in scraped.get(family, [])
        if all(sample_labels.get(k) == v for k, v in labels.items())
    ]


def answered_and_held(evaluation: dict[str, Any]) -> bool:
    """Running with every request answered and stored, computing metrics (its stage says so):
    the evaluation waits at its gate."""
    phases, stage = evaluation["progress"]["phases"], evaluation["progress"]["stage"]
    return (
        evaluation["status"] == "running"
        and set(phases) == REQUEST_TYPES
        and all(p["done"] == p["total"] for p in phases.values())
        and stage is not None
        and stage["name"] == "computing_metrics"
        and stage["label"] == "computing metrics"
    )


@pytest.fixture(scope="module")
def runs(
    server: Any, demo: Any, gated_tasks: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A through `rayeval submit --wait`, B and C through the Python client, /metrics scraped."""
    import contextlib
    import io

    from rayeval.api.cli import main
    from rayeval.api.client import RayEvalClient

    out = tmp_path_factory.mktemp("submitted")
    argv = [
        "submit", "--url", server.url,
        "--model_args", f"pretrained={demo.model_dir},dtype=float32",
        "--tasks", ",".join(TASKS), "--limit", str(A_DOCS), "--batch_size", "1",
        "--bootstrap_iters", "100", "--log_samples", "--num_replicas", "2",
        "--wait", "--output_path", str(out),
    ]  # fmt: skip
    cli: dict[str, Any] = {}
    stdout, stderr = io.StringIO(), io.StringIO()

    def submit_with_cli() -> None:
        os.environ["RAYEVAL_API_TOKEN"] = TOKEN  # the CLI reads the token from the environment
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                cli["status"] = main(argv)
        finally:
            os.environ.pop("RAYEVAL_API_TOKEN", None)

    with RayEvalClient(server.url, token=TOKEN) as client:
        before = scrape(server.url)
        thread = threading.Thread(target=submit_with_cli, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not client.list_evaluations()["items"]:
            assert thread.is_alive(), stderr.getvalue()
            assert time.monotonic() < deadline, "rayeval submit did not submit"
            time.sleep(0.2)
        (a,) = client.list_evaluations()["items"]
        b_body = body(demo, tasks=TASKS, limit=B_DOCS, bootstrap_iters=100)
        b_body["parallelism"] = {"num_replicas": 1, "cpus_per_rank": 3}
        b = client.submit(b_body)
        c = client.submit(b_body)  # queued behind B, then cancelled by `rayeval cancel`
        gates = {a["id"]: A_DOCS, b["id"]: B_DOCS}
        # A's gate opens once `rayeval submit --wait` said what A waits for.
        said = lambda: f"{a['id']}: running: computing metrics" in stderr.getvalue()  # noqa: E731
        followed = _follow(client, server.url, thread, gates, c, gated_tasks, said)
        thread.join(timeout=60)
        after = scrape(server.url)
        final_a, final_b = client.get(a["id"]), client.get(b["id"])
        timeline_a = client.timeline(a["id"])
        d, stages = _again_from_cache(client, final_a)
    print(f"{len(followed['scrapes'])} scrapes")
    return {
        "a": final_a, "b": final_b, "c": c, "d": d, "stages": stages, "before": before,
        "after": after,
        "out": out, "cli": {**cli, **followed.pop("cli")}, "timeline_a": timeline_a,
        "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), **followed,
    }  # fmt: skip


def _again_from_cache(client: Any, a: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """D: A's request again, evaluated to the end before, so the response cache answers all;
    D's end, and the stages A and D went through (their stored stream)."""
    d = client.wait(client.submit(a["request"])["id"], poll_s=0.2)
    stages = {
        e: [x["data"]["name"] for x in client.events(e) if x["event"] == "stage"]
        for e in (a["id"], d["id"])
    }
    return d, stages


def _follow(
    client: Any,
    url: str,
    thread: threading.Thread,
    gates: dict[str, int],
    c: dict[str, Any],
    gate_dir: Path,
    watch_said: Any,
) -> dict[str, Any]:
    """Scrape /metrics until A's submitter and B have ended. The third scrape is followed by
    `rayeval cancel C` (C is queued behind B, which cannot end before its gate opens); each of
    A and B, once it waits at its gate, is scraped (``held``) and then let go (A once
    ``watch_said()``: its submitter's watch said so)."""
    import contextlib
    import io

    from rayeval.api.cli import main

    scrapes: list[dict[str, Any]] = []
    held: dict[str, dict[str, Any]] = {}
    cli: dict[str, Any] = {}
    a, b = list(gates)
    deadline = time.monotonic() + 600
    while thread.is_alive() or client.get(b)["status"] not in TERMINAL:
        scrapes.append(scrape(url))
        if len(scrapes) == 3:
            with contextlib.redirect_stdout(io.StringIO()) as said:
                cli["cancel"] = main(["cancel", c["id"], "--url", url, "--token", TOKEN])
            cli["cancel_out"] = said.getvalue()
        for evaluation, docs in gates.items():
            if (
                "cancel" in cli
                and evaluation not in held
                and answered_and_held(client.get(evaluation))
                and (evaluation != a or watch_said())
            ):
                held[evaluation] = scrape(url)
                scrapes.append(held[evaluation])
                (gate_dir / f"open-{docs}").touch()
        assert time.monotonic() < deadline, "the evaluations did not end in 600 s"
        time.sleep(0.1)
    return {"scrapes": scrapes, "held": held, "cli": cli}


@pytest.mark.service
def test_metrics_move_during_a_run(runs: dict[str, Any]) -> None:
    a, b, scrapes = runs["a"]["id"], runs["b"]["id"], runs["scrapes"]
    assert runs["a"]["status"] == runs["b"]["status"] == "succeeded", (runs["a"], runs["b"])
    assert set(runs["held"]) == {a, b}, "an evaluation ended without waiting at its gate"
    assert len(scrapes) >= 5, "too few scrapes to see anything move"

    def state_count(scraped: dict[str, Any], state: str) -> float:
        return next(v for labels, v in scraped["rayeval_evaluations"] if labels["state"] == state)

    assert state_count(runs["after"], "succeeded") == state_count(runs["before"], "succeeded") + 2
    assert state_count(runs["after"], "cancelled") == state_count(runs["before"], "cancelled") + 1
    assert max(state_count(s, "running") for s in scrapes) >= 1
    queue = [v for s in scrapes for _, v in s["rayeval_queue_length"]]
    assert max(queue) >= 1 and queue[-1] == 0, queue  # B and C waited while A ran, then B started

    # While A ran, /metrics served its progress per request type: the counts the service recorded.
    recorded: dict[str, list[int]] = {}
    for point in runs["timeline_a"]["points"]:
        recorded.setdefault(point["request_type"], []).append(point["done"])
    assert set(recorded) == REQUEST_TYPES, recorded
    for request_type, done in recorded.items():
        assert done == sorted(done) and done[-1] > 0, (request_type, done)
    held_a = values([runs["held"][a]], "rayeval_evaluation_requests_done", evaluation=a)
    planned = values([runs["held"][a]], "rayeval_evaluation_requests_planned", evaluation=a)
    assert (
        {labels["request_type"]: v for labels, v in held_a}
        == {request_type: done[-1] for request_type, done in recorded.items()}
        == {labels["request_type"]: v for labels, v in planned}
    )
    for labels, value in values(scrapes, "rayeval_evaluation_requests_done", evaluation=a):
        assert value in recorded[labels["request_type"]], (labels, value, recorded)
    assert not values([runs["before"]], "rayeval_evaluation_requests_done", evaluation=a)
    for rate in ("tokens", "requests"):
        family = f"rayeval_evaluation_{rate}_per_second"
        assert max(v for _, v in values(scrapes, family, evaluation=a)) > 0, family
    assert values(scrapes, "rayeval_evaluation_eta_seconds", evaluation=a)
    # Both replicas of A worked; utilisation is a share of wall time.
    replicas = values(scrapes, "rayeval_replica_requests_per_second", evaluation=a)
    assert {labels["replica"] for labels, v in replicas if v > 0} == {"0", "1"}
    assert values(scrapes, "rayeval_replica_tokens_per_second", evaluation=a)
    utilisation = [v for _, v in values(scrapes, "rayeval_replica_utilisation_ratio", evaluation=a)]
    assert utilisation and all(0 <= u <= 1.05 for u in utilisation) and max(utilisation) > 0
    # Each rank's resident memory (a process holding torch and the model: well over 50 MiB).
    memory = values(scrapes, "rayeval_rank_resident_memory_bytes", evaluation=a)
    assert {(rank["replica"], rank["shard_rank"]) for rank, _ in memory} == {("0", "0"), ("1", "0")}
    assert all(v > 50 * 2**20 for _, v in memory), memory
    load = [v for _, v in values(scrapes, "rayeval_evaluation_load_seconds", evaluation=a)]
    startup = [v for _, v in values(scrapes, "rayeval_evaluation_startup_seconds", evaluation=a)]
    assert load and min(load) > 0 and startup and min(startup) > 0
    # B repeats A's first twelve documents: those answers come from the response cache.
    hits = values(scrapes, "rayeval_evaluation_cache_hits", evaluation=b)
    assert max(v for _, v in hits) > 0, hits
    # Finished evaluations leave the per-evaluation series.
    assert not values([runs["after"]], "rayeval_evaluation_requests_done", evaluation=a)
    assert runs["after"]["process_resident_memory_bytes"][0][1] > 0


@pytest.mark.service
def test_metrics_need_the_token(server: Any) -> None:
    response = httpx.get(server.url + "/metrics", timeout=30)
    assert response.status_code == 401 and "Authorization: Bearer" in response.json()["detail"]


@pytest.mark.service
def test_stages_and_answers_from_the_cache(runs: dict[str, Any]) -> None:
    """A's start-up and its metrics are stages; D, answered by the cache alone, starts no rank,
    and its progress counts those answers."""
    a, d = runs["a"]["id"], runs["d"]["id"]
    stages = runs["stages"]
    assert stages[a][:2] == ["placing", "building_requests"], stages
    assert {"computing", "computing_metrics"} <= set(stages[a]), stages
    assert "placing" not in stages[d] and "computing_metrics" in stages[d], stages
    assert runs["d"]["status"] == "succeeded", runs["d"]["error"]
    progress = runs["d"]["progress"]
    assert progress["done"] == progress["total"] == progress["cached"] > 0, progress
    assert set(progress["phases"]) == REQUEST_TYPES and progress["stage"] is None
    assert all(p["cached"] == p["done"] == p["total"] for p in progress["phases"].values())
    assert all(s["requests"] == 0 for s in runs["d"]["stats"].values()), runs["d"]["stats"]
    assert progress["total"] == runs["a"]["progress"]["total"]
    assert runs["d"]["throughput"]["requests_per_s"] in (None, 0)
    # The CLI's watch said what A waited for (lines: its stderr is not a terminal).
    assert f"{a}: running: computing metrics" in runs["stderr"], runs["stderr"]


@pytest.mark.service
def test_submit_waits_with_progress_bars_and_writes_lm_eval_files(
    runs: dict[str, Any], server: Any
) -> None:
    from rayeval.api.client import RayEvalClient

    assert runs["cli"]["status"] == 0, runs["stderr"]
    a = runs["a"]
    assert f"submitted {a['id']}" in runs["stdout"]
    assert "|demo_mc" in runs["stdout"] and "acc" in runs["stdout"]  # lm-eval's table
    assert "loglikelihood" in runs["stderr"] and "req" in runs["stderr"]  # a bar per type
    assert a["request"]["parallelism"]["num_replicas"] == 2
    assert a["request"]["batch_size"] == 1 and a["request"]["limit"] == 12
    (model_dir,) = runs["out"].iterdir()
    (results_file,) = model_dir.glob("results_*.json")
    with RayEvalClient(server.url, token=TOKEN) as client:
        assert results_file.read_text() == client.results_text(a["id"])
        for task in TASKS:
            (samples_file,) = model_dir.glob(f"samples_{task}_*.jsonl")
            assert samples_file.read_text() == client.samples_text(a["id"], task)
        assert client.samples(a["id"], "demo_mc")[0]["doc_id"] == 0
    # `rayeval cancel` cancelled C while it was queued.
    assert runs["cli"]["cancel"] == 0 and "cancelled" in runs["cli"]["cancel_out"]


@pytest.mark.service
def test_status_results_cancel_commands(
    runs: dict[str, Any],
    server: Any,
    capsys: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rayeval.api.cli import main

    a, b = runs["a"]["id"], runs["b"]["id"]
    monkeypatch.setenv("RAYEVAL_API_TOKEN", TOKEN)
    monkeypatch.setenv("RAYEVAL_URL", server.url)
    caplog.set_level(logging.INFO)
    assert main(["status"]) == 0
    # A client command does not log the HTTP client's line per request.
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    listed = capsys.readouterr().out
    assert a in listed and b in listed and runs["c"]["id"] in listed and "cancelled" in listed
    assert main(["status", b, "--watch"]) == 0
    shown = capsys.readouterr().out
    assert "succeeded" in shown and "loglikelihood:" in shown and "tokens/s" in shown
    assert main(["status", runs["d"]["id"], "--watch"]) == 0
    said, n = capsys.readouterr(), runs["d"]["progress"]["phases"]["loglikelihood"]["total"]
    assert f"loglikelihood: {n}/{n} requests ({n} from cache), 0 tokens/s" in said.out, said.out
    assert f"{n}/{n} req (0.0 req/s, 0 tokens/s, {n} from cache)" in said.err, said.err
    assert main(["results", b, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n-samples"]["demo_mc"]["effective"] == 15
    # Refusals name the fix; nothing is a traceback. The server's answers exit 1, usage 2.
    assert main(["cancel", a]) == 1
    assert "already succeeded" in capsys.readouterr().err
    monkeypatch.setenv("RAYEVAL_API_TOKEN", "wrong")
    assert main(["status", a]) == 1
    assert "Authorization: Bearer" in capsys.readouterr().err
    monkeypatch.setenv("RAYEVAL_URL", "http://127.0.0.1:9")
    assert main(["status"]) == 1
    assert "cannot reach the rayeval server" in capsys.readouterr().err
    assert main(["submit", "--model_args", "pretrained=x", "--tasks", "demo_mc",
                 "--include_path", "/tmp", "--use_cache", "c"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--include_path" in err and "--use_cache" in err and "server's operator" in err


@pytest.mark.e2e
def test_dashboard_plot_eta_and_comparison(
    runs: dict[str, Any], server: Any, demo: Any, gated_tasks: Path, tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    from rayeval.api.client import RayEvalClient

    a, b = runs["a"]["id"], runs["b"]["id"]
    with RayEvalClient(server.url, token=TOKEN) as client:
        results = {e: client.results(e) for e in (a, b)}
        timeline = client.timeline(a)
    assert timeline["complete"] and len(timeline["points"]) >= 2
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.add_init_script(f"sessionStorage.setItem('rayeval-token', {TOKEN!r})")
            page.goto(server.url + "/#" + a)
            page.locator("#metrics tr[data-task='demo_mc']").first.wait_for(timeout=30_000)
            _check_progress_and_plot(page, timeline)
            _check_comparison(page, results, a, b)
            if os.environ.get("RAYEVAL_SCREENSHOT"):  # how docs/dashboard.png is made
                page.screenshot(path=os.environ["RAYEVAL_SCREENSHOT"], full_page=True)
            _check_from_cache(page, runs["d"])
            _check_stage(page, server, demo, gated_tasks)
            assert errors == []
        finally:
            browser.close()


def _check_progress_and_plot(page: Any, timeline: dict[str, Any]) -> None:
    """A finished evaluation's page: progress per request type, its plot, metrics, samples."""
    # Progress per request type, finished: ETA says done; requests/s shown.
    for phase in ("loglikelihood", "generate_until"):
        row = page.locator(f"#phases tr[data-phase='{phase}']")
        assert row.locator("td.eta").text_content() == "done"
    # The throughput plot: one line per request type, drawn from the timeline.
    plot = page.locator("#throughput-plot")
    page.wait_for_function(
        "document.querySelector('#throughput-plot').dataset.points > 0", timeout=30_000
    )
    assert plot.get_attribute("data-points") == str(len(timeline["points"]))
    types = plot.locator("polyline.series").evaluate_all(
        "lines => lines.map(l => l.dataset.requestType)"
    )
    assert set(types) == {p["request_type"] for p in timeline["points"]}
    coloured = _coloured_pixels(page, plot.screenshot())
    assert coloured > 200, f"the plot shows almost nothing ({coloured} coloured pixels)"
    # Only metrics ("metric,filter" keys): not lm-eval's name and sample_len entries.
    assert page.locator("#metrics tr[data-metric='sample_len']").count() == 0
    # Samples links of the finished evaluation.
    assert page.locator("#samples-links a").count() == len(TASKS)


def _check_comparison(page: Any, results: dict[str, Any], a: str, b: str) -> None:
    """Compare A and B: per task and metric, each value with its stderr, differences marked."""
    for evaluation in (a, b):
        page.locator(f"#evaluations tr[data-id='{evaluation}'] input.compare").check()
    page.click("#compare-button")
    page.locator("#compare-table tbody tr").first.wait_for(timeout=30_000)
    # One model twice: each column says what tells it apart (A ran on 2 replicas, 12 documents).
    heads = [page.locator(f"#compare-table th[data-evaluation='{e}']") for e in (a, b)]
    assert "layout 2x1, limit 12" in (heads[0].text_content() or "")
    assert "layout 1x1, limit 15" in (heads[1].text_content() or "")
    for task in TASKS:
        metrics = results[a]["results"][task]
        for key, value in metrics.items():
            if key == "alias" or "_stderr," in key or not isinstance(value, float):
                continue
            metric, filter_ = key.split(",")
            row = page.locator(
                f"#compare-table tr[data-task='{task}'][data-metric='{metric}']"
                f"[data-filter='{filter_}']"
            )
            cells = row.locator("td.value")
            assert cells.nth(0).text_content().startswith(f"{value:.4f}")
            stderr = metrics.get(f"{metric}_stderr,{filter_}")
            if isinstance(stderr, float):
                assert cells.nth(0).text_content().endswith(f" ± {stderr:.4f}")
            other = results[b]["results"][task][key]
            assert cells.nth(1).text_content().startswith(f"{other:.4f}")
            marked = "diff" in (cells.nth(1).get_attribute("class") or "")
            assert marked == (other != value), (task, key, value, other)
        samples = page.locator(f"#compare-table tr[data-task='{task}'] a.samples")
        assert samples.count() >= 2
    assert page.locator("#compare-table td.value.diff").count() > 0, "A and B differ"
    # The paired comparison (tests/test_compare.py) refuses these two, saying why.
    refusal = page.locator(f"#paired .paired[data-a='{a}'][data-b='{b}'] .paired-error")
    refusal.wait_for(timeout=30_000)
    assert "other documents" in (refusal.text_content() or "")  # A's 12 documents, B's 15


def _check_from_cache(page: Any, d: dict[str, Any]) -> None:
    """D, answered by the response cache alone, is done and says so: no empty plot's wait."""
    cached = d["progress"]["cached"]
    row = page.locator(f"#evaluations tr[data-id='{d['id']}']")
    assert f"({cached} from cache)" in (row.text_content() or "")
    row.locator("td.mono").click()
    page.wait_for_function(
        "document.querySelector('#plot-empty').textContent.includes('response cache')",
        timeout=30_000,
    )
    assert page.locator("#plot-empty").is_visible()
    for phase in REQUEST_TYPES:
        assert page.locator(f"#phases tr[data-phase='{phase}'] td.eta").text_content() == "done"


def _check_stage(page: Any, server: Any, demo: Any, gate_dir: Path) -> None:
    """E (three documents of demo_mc, whose gate is shut) waits while lm-eval computes its
    metrics: the page says so beside its state, with the seconds so far."""
    from rayeval.api.client import RayEvalClient

    with RayEvalClient(server.url, token=TOKEN) as client:
        e = client.submit(body(demo, tasks=["demo_mc"], limit=3, bootstrap_iters=0))
        row = page.locator(f"#evaluations tr[data-id='{e['id']}'] td.mono")
        row.wait_for(timeout=30_000)  # the list is polled
        row.click()
        stage = "document.querySelector('#detail-stage').textContent"
        page.wait_for_function(f"{stage}.startsWith('computing metrics · ')", timeout=120_000)
        assert page.locator("#detail-status").text_content() == "running"
        (gate_dir / "open-3").touch()
        assert client.wait(e["id"], poll_s=0.2)["status"] == "succeeded"
        page.wait_for_function(f"{stage} === ''", timeout=30_000)


def _coloured_pixels(page: Any, png: bytes) -> int:
    """Pixels of a screenshot that are neither near-white background nor grey (axes, labels),
    counted by the browser's own PNG decoder."""
    script = """async (data) => {
        const image = new Image();
        image.src = "data:image/png;base64," + data;
        await image.decode();
        const canvas = document.createElement("canvas");
        canvas.width = image.width; canvas.height = image.height;
        const context = canvas.getContext("2d");
        context.drawImage(image, 0, 0);
        const pixels = context.getImageData(0, 0, image.width, image.height).data;
        let coloured = 0;
        for (let i = 0; i < pixels.length; i += 4) {
            const [r, g, b] = [pixels[i], pixels[i + 1], pixels[i + 2]];
            if (Math.max(r, g, b) - Math.min(r, g, b) > 60) coloured++;
        }
        return coloured;
    }"""
    return int(page.evaluate(script, base64.b64encode(png).decode()))
