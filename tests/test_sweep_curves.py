"""The dashboard shows a checkpoint sweep as curves, from a real sweep on a real server.

A "training run" of the bundled tiny Llama saves three DCP checkpoints (one process each: the
trained weights plus seeded noise, less at later steps; see ``tests/checkpoint_run.py``), and
one sweep over them is submitted over REST in another order than their steps
(``step-300, step-100, step-200``). The server's demo tasks are a copy whose ``demo_mc``
aggregates ``acc_norm`` through a gate: lm-eval has no stderr for that aggregation (``"N/A"``,
so that curve has no band), and the k-th checkpoint to be aggregated waits until the test opens
gate k. So while the sweep runs, Chromium is seen to add each checkpoint's points, in step
order, as it finishes. At the end every curve has three points whose values are the ``/sweep``
JSON's, a band exactly where a numeric stderr exists, and clicking a point (or a table row)
shows that checkpoint's metrics as its results file has them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.checkpoint_run import save_one_process
from tests.test_service import (
    CHROMIUM,
    CHROMIUM_ARGS,
    ServerThread,
    body,
    finished,
    make_settings,
    submit,
    wait_for,
)

STEPS = {"step-100": 0.6, "step-200": 0.25, "step-300": 0.0}  # noise scale per step
SUBMITTED = ["step-300", "step-100", "step-200"]  # evaluation order: not the steps' order
TASKS = ["demo_mc", "demo_cloze"]
#: The k-th checkpoint aggregated creates ``called-k`` beside this file, then waits for ``open-k``.
GATE = """\
import time
from pathlib import Path


def mean_when_open(items):
    \"\"\"lm-eval's mean, once the test has created open-<k> for the k-th call.\"\"\"
    here = Path(__file__).parent
    calls = len(list(here.glob("called-*"))) + 1
    (here / f"called-{calls}").touch()
    deadline = time.monotonic() + 300
    while not (here / f"open-{calls}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return sum(items) / len(items)
"""
GATE_WAIT_S = 120


@pytest.fixture(scope="module")
def gated_tasks(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tasks, ``demo_mc``'s ``acc_norm`` aggregated by :data:`GATE`."""
    from tests.helpers import gated_tasks_dir

    return gated_tasks_dir(demo.tasks_dir, tmp_path_factory.mktemp("gated-tasks"), GATE)


@pytest.fixture(scope="module")
def run_dir(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training run: three DCP checkpoints of the demo model, each with its own weights."""
    root = tmp_path_factory.mktemp("sweep-run")
    for seed, (step, scale) in enumerate(STEPS.items()):
        save_one_process(demo.model_dir, root / step, scale, seed=seed)
    return root


@pytest.fixture(scope="module")
def server(
    demo: Any,
    ray_session: None,
    gated_tasks: Path,
    run_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerThread]:
    settings = make_settings(tmp_path_factory.mktemp("sweep-service"), gated_tasks)
    roots = [str(demo.model_dir.parent), str(run_dir)]
    handle = ServerThread(settings.model_copy(update={"model_roots": roots}))
    handle.start()
    yield handle
    handle.stop()


def _sweep(client: httpx.Client, evaluation: dict[str, Any]) -> dict[str, Any]:
    response = client.get(evaluation["links"]["sweep"])
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.e2e
def test_dashboard_draws_a_sweep_as_curves(
    server: ServerThread, demo: Any, gated_tasks: Path, run_dir: Path, tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    payload = body(
        demo,
        tasks=TASKS,
        limit=8,
        bootstrap_iters=10,
        parallelism={"num_replicas": 1, "shard_size": 1},
        sweep={"checkpoints": [str(run_dir / name) for name in SUBMITTED]},
    )
    with server.client() as client, sync_playwright() as playwright:
        evaluation = submit(client, payload)
        assert evaluation["kind"] == "sweep"
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.url}/#{evaluation['id']}")
            page.locator("#sweep").wait_for(state="visible", timeout=30_000)
            _watch_points_arrive(page, gated_tasks)
            final = wait_for(client, evaluation["id"], finished, timeout_s=120)
            assert final["status"] == "succeeded", final
            sweep = _sweep(client, final)
            _check_curves(page, sweep)
            _check_a_point_and_a_row(page, client, sweep)
            if os.environ.get("RAYEVAL_SCREENSHOT"):  # how docs/sweep_curves.png is made
                box = page.locator("#sweep").bounding_box()
                margin = 16
                clip = {
                    "x": box["x"] - margin,
                    "y": box["y"] - margin,
                    "width": box["width"] + 2 * margin,
                    "height": box["height"] + 2 * margin,
                }
                page.screenshot(path=os.environ["RAYEVAL_SCREENSHOT"], clip=clip)
            assert errors == []
        finally:
            browser.close()
            for k in range(1, len(SUBMITTED) + 1):  # a failed check must not leave it waiting
                (gated_tasks / f"open-{k}").touch()


def _points_shown(page: Any) -> list[str]:
    """The checkpoints the first curve shows, left to right (none before a curve is drawn)."""
    return list(
        page.evaluate(
            "() => [...(document.querySelector('#sweep-curves svg.curve')"
            "?.querySelectorAll('circle.point') || [])].map(d => d.dataset.label)"
        )
    )


def _watch_points_arrive(page: Any, gates: Path) -> None:
    """Open the gates one at a time: each checkpoint's points appear as it finishes, the page
    keeping them in step order (here 300; 100, 300; 100, 200, 300)."""
    assert page.locator("#sweep-empty").is_visible()  # nothing finished: gate 1 is closed
    for k, name in enumerate(SUBMITTED, start=1):
        deadline = time.monotonic() + GATE_WAIT_S
        while not (gates / f"called-{k}").exists():
            assert time.monotonic() < deadline, f"checkpoint {k} ({name}) was never aggregated"
            time.sleep(0.05)
        assert len(_points_shown(page)) == k - 1  # checkpoint k waits at its gate
        (gates / f"open-{k}").touch()
        page.wait_for_function(
            "n => document.querySelector('#sweep-curves svg.curve')"
            "?.querySelectorAll('circle.point').length === n",
            arg=k,
            timeout=GATE_WAIT_S * 1000,
        )
        assert _points_shown(page) == [step for step in STEPS if step in SUBMITTED[:k]]


def _metric_keys(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(task, metric, filter) of every number lm-eval reports in a record's results."""
    keys = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, comma, filter_ = key.partition(",")
            if comma and "_stderr" not in metric and isinstance(value, float | int):
                keys.append((task, metric, filter_))
    return keys


def _check_curves(page: Any, sweep: dict[str, Any]) -> None:
    """One curve per task and metric: three points in step order, each value the /sweep JSON's,
    and a band exactly where every checkpoint has a numeric stderr."""
    records = sweep["checkpoints"]
    assert [r["label"] for r in records] == SUBMITTED  # evaluation order
    assert all(r["status"] == "succeeded" for r in records), records
    by_label = {r["label"]: r for r in records}
    keys = _metric_keys(records[0]["results"])
    assert {task for task, _, _ in keys} == set(TASKS)
    assert page.locator("#sweep-curves svg.curve").count() == len(keys)
    banded = 0
    for task, metric, filter_ in keys:
        plot = page.locator(
            f"#sweep-curves svg.curve[data-task='{task}'][data-metric='{metric}']"
            f"[data-filter='{filter_}']"
        )
        dots = plot.locator("circle.point").evaluate_all(
            "dots => dots.map(d => [d.dataset.label, Number(d.dataset.value),"
            " Number(d.getAttribute('cx')), d.dataset.stderr, Number(d.getAttribute('cy'))])"
        )
        _check_heights(dots)
        assert [label for label, *_ in dots] == list(STEPS)  # step order
        xs = [dot[2] for dot in dots]
        assert xs == sorted(xs) and len(set(xs)) == len(xs)
        stderrs = []
        for label, value, _, stderr, _ in dots:
            results = by_label[label]["results"][task]
            assert value == results[f"{metric},{filter_}"]  # exact: JS prints doubles round-trip
            stderrs.append(results.get(f"{metric}_stderr,{filter_}"))
            if isinstance(stderrs[-1], float):
                assert float(stderr) == stderrs[-1]
            else:
                assert stderr == ""
        bands = plot.locator(".band")
        if all(isinstance(s, float) for s in stderrs):
            assert bands.count() == 1
            assert bands.get_attribute("data-labels") == " ".join(STEPS)
            _check_band(bands.get_attribute("points") or "", dots)
            banded += 1
        else:
            assert bands.count() == 0, (task, metric, stderrs)
    assert 0 < banded < len(keys), "expected curves with a band and one without (acc_norm)"
    assert (
        page.locator(
            "#sweep-curves svg.curve[data-task='demo_mc'][data-metric='acc_norm'] .band"
        ).count()
        == 0
    )
    rows = page.locator("#sweep-table tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.label, r.dataset.status])"
    )
    assert rows == [[label, "succeeded"] for label in STEPS]


def _check_heights(dots: list[Any]) -> None:
    """A higher value is drawn higher (a smaller y), an equal one at the same height."""
    for _, value, _, _, y in dots:
        for _, other, _, _, other_y in dots:
            if value > other:
                assert y < other_y
            elif value == other:
                assert y == pytest.approx(other_y)


def _check_band(polygon: str, dots: list[Any]) -> None:
    """The band runs through each point, ``value ± stderr``: as far above it as below."""
    corners = [tuple(map(float, corner.split(","))) for corner in polygon.split()]
    upper, lower = corners[: len(dots)], corners[len(dots) :][::-1]
    for (_, _, x, stderr, y), (ux, uy), (lx, ly) in zip(dots, upper, lower, strict=True):
        assert ux == lx == pytest.approx(x, abs=0.06)
        if float(stderr) > 0:
            assert uy < y < ly
        assert y - uy == pytest.approx(ly - y, abs=0.15)


def _check_a_point_and_a_row(page: Any, client: httpx.Client, sweep: dict[str, Any]) -> None:
    """A point, then a row, shows that checkpoint's metrics equal to its results file."""
    by_label = {r["label"]: r for r in sweep["checkpoints"]}
    plot = page.locator("#sweep-curves svg.curve[data-task='demo_mc'][data-metric='acc']")
    plot.locator("circle.point[data-label='step-200']").click()
    _check_checkpoint_panel(page, client, by_label["step-200"])
    page.locator("#sweep-table tbody tr[data-label='step-100']").click()
    _check_checkpoint_panel(page, client, by_label["step-100"])


def _check_checkpoint_panel(page: Any, client: httpx.Client, record: dict[str, Any]) -> None:
    panel = page.locator(f"#checkpoint[data-label='{record['label']}']")
    panel.wait_for(state="visible", timeout=30_000)
    response = client.get(record["links"]["results"])
    assert response.status_code == 200, response.text
    results = response.json()
    assert (
        page.locator("#checkpoint-results-link").get_attribute("href")
        == (record["links"]["results"])
    )
    shown = page.locator("#checkpoint-metrics tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.task, r.dataset.metric, r.dataset.filter,"
        " r.querySelector('td.value').textContent, r.querySelector('td.stderr').textContent])"
    )
    expected = []
    sections = {**results["results"], **results.get("groups", {})}
    for task, metrics in sections.items():
        for key, value in metrics.items():
            metric, comma, filter_ = key.partition(",")
            if key == "alias" or not comma or "_stderr" in metric:
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_}")
            expected.append(
                [
                    task,
                    metric,
                    filter_,
                    f"{value:.4f}" if isinstance(value, float) else str(value),
                    ""
                    if stderr is None
                    else f"{stderr:.4f}"
                    if isinstance(stderr, float)
                    else str(stderr),
                ]
            )
    assert shown == expected
    links = page.locator("#checkpoint-samples a").evaluate_all("a => a.map(x => x.textContent)")
    assert sorted(links) == sorted(record["links"]["samples"]) == sorted(TASKS)
