"""Paired comparison end to end: ``GET /compare``, ``rayeval compare`` and the dashboard's view.

Two real evaluations on one uvicorn server (the session's Ray), samples logged: A runs the bundled
tiny model, B the same architecture and tokenizer trained for a fifth of the steps (an earlier
checkpoint), on the same documents. The endpoint's answer must be what
:func:`rayeval.service.comparison.compare` computes from the very files the server serves (its
statistics are checked against scipy and a direct computation in ``tests/test_comparison.py``);
``rayeval compare`` prints that answer for two ids, and the same statistics for the lm-eval
result directories ``rayeval results --output_path`` writes. Beside them: an evaluation without
samples, one on other documents and a cancelled one, each refused with the reason. Chromium shows
the comparison view: differences, intervals and p-values as the endpoint says, significant ones
marked, and a flipped document's samples in A and B.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

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

TASKS = ["demo_mc", "demo_cloze", "demo_gen_short"]
DOCS = 20


@pytest.fixture(scope="module")
def earlier_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's architecture and tokenizer, trained for 60 steps instead of 300."""
    from rayeval.service.demo import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("earlier") / "model", train_steps=60)


@pytest.fixture(scope="module")
def server(
    demo: Any, ray_session: None, earlier_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    settings = make_settings(tmp_path_factory.mktemp("compare-service"), demo.tasks_dir)
    roots = [str(demo.model_dir.parent), str(earlier_model.parent)]
    handle = ServerThread(settings.model_copy(update={"model_roots": roots}))
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def runs(server: ServerThread, demo: Any, earlier_model: Path) -> dict[str, dict[str, Any]]:
    """A and B (paired), C (no samples), D (other documents), E (cancelled), all ended."""
    common = {"tasks": TASKS, "bootstrap_iters": 100}
    later = {"pretrained": str(earlier_model), "dtype": "float32"}
    bodies = {
        "a": body(demo, **common, limit=DOCS),
        "b": body(demo, **common, limit=DOCS, model_args=later),
        "c": body(demo, **common, limit=5, log_samples=False),
        "d": body(demo, **common, limit=5),
        "e": body(demo, **common, limit=5),
    }
    with server.client() as client:
        submitted = {name: submit(client, payload) for name, payload in bodies.items()}
        assert client.delete(f"/evaluations/{submitted['e']['id']}").status_code == 200
        final = {
            name: wait_for(client, evaluation["id"], finished, timeout_s=900)
            for name, evaluation in submitted.items()
        }
    for name in "abcd":
        assert final[name]["status"] == "succeeded", final[name]
    assert final["e"]["status"] == "cancelled"
    return final


def fetched(client: httpx.Client, evaluation_id: str) -> Any:
    """What the server serves of an evaluation, as a comparison reads it."""
    from rayeval.service.comparison import EvaluationSamples
    from rayeval.service.result_files import parse_samples

    results = client.get(f"/evaluations/{evaluation_id}/results").json()
    samples = {
        task: parse_samples(client.get(f"/evaluations/{evaluation_id}/samples/{task}").text)
        for task in TASKS
    }
    return EvaluationSamples(evaluation_id, results, samples)


@pytest.fixture(scope="module")
def answer(server: ServerThread, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    a, b = runs["a"]["id"], runs["b"]["id"]
    with server.client() as client:
        response = client.get("/compare", params={"a": a, "b": b})
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.service
def test_compare_is_the_service_comparison_of_the_served_files(
    server: ServerThread, runs: dict[str, dict[str, Any]], answer: dict[str, Any]
) -> None:
    from rayeval.service.comparison import compare

    a, b = runs["a"]["id"], runs["b"]["id"]
    with server.client() as client:
        first, second = fetched(client, a), fetched(client, b)
    assert answer == json.loads(json.dumps(compare(first, second).to_json()))
    assert (answer["a"], answer["b"], answer["difference"]) == (a, b, "b - a")
    rows = {(m["task"], m["metric"]): m for m in answer["metrics"]}
    assert {task for task, _ in rows} == set(TASKS)
    for task in TASKS:
        for key, value in first.results["results"][task].items():
            metric, comma, _ = key.partition(",")
            if not comma or "_stderr" in metric or not isinstance(value, float):
                continue
            row = rows[(task, metric)]
            assert row["documents"] == DOCS
            assert row["a"] == pytest.approx(value)
            assert row["b"] == pytest.approx(second.results["results"][task][key])
            assert row["flipped"] == {"better": len(row["better"]), "worse": len(row["worse"])}
            assert row["significant"] == (row["p_value"] < 0.05)
    assert rows[("demo_mc", "acc")]["test"] == "mcnemar"
    assert rows[("demo_cloze", "perplexity")]["test"] == "sign-flip permutation"
    assert any(m["difference"] != 0 for m in answer["metrics"]), "A and B should differ"
    # What tells them apart, beside their ids: the model (the rest ran alike).
    assert list(answer["differs"]) == ["model"], answer["differs"]


@pytest.mark.service
def test_compare_refuses_naming_why(server: ServerThread, runs: dict[str, dict[str, Any]]) -> None:
    a = runs["a"]["id"]
    with server.client() as client:

        def refused(b: str, status: int) -> str:
            response = client.get("/compare", params={"a": a, "b": b})
            assert response.status_code == status, response.text
            return str(response.json()["detail"])

        assert "no-such-id" in refused("no-such-id", 404)
        assert "cancelled" in refused(runs["e"]["id"], 409)
        assert '"log_samples": true' in refused(runs["c"]["id"], 422)
        assert "other documents" in refused(runs["d"]["id"], 422)
        assert client.get("/compare", params={"a": a}).status_code == 422


@pytest.mark.service
def test_samples_of_one_document(server: ServerThread, runs: dict[str, dict[str, Any]]) -> None:
    a = runs["a"]["id"]
    with server.client() as client:
        whole = client.get(f"/evaluations/{a}/samples/demo_mc").text
        one = client.get(f"/evaluations/{a}/samples/demo_mc", params={"doc_id": 3})
        missing = client.get(f"/evaluations/{a}/samples/demo_mc", params={"doc_id": 9999})
    assert one.status_code == 200
    expected = [line for line in whole.splitlines() if json.loads(line)["doc_id"] == 3]
    assert one.text.splitlines() == expected and len(expected) == 1
    assert missing.status_code == 404 and "no document 9999" in missing.json()["detail"]


def cli(*argv: str) -> tuple[int, str, str]:
    """``rayeval`` in this process; (status, stdout, stderr)."""
    from rayeval.api.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.mark.service
def test_rayeval_compare_ids_directories_and_both(
    server: ServerThread, runs: dict[str, dict[str, Any]], answer: dict[str, Any], tmp_path: Path
) -> None:
    a, b, c = runs["a"]["id"], runs["b"]["id"], runs["c"]["id"]
    status, printed, said = cli("compare", a, b, "--url", server.url, "--json")
    assert status == 0, said
    assert json.loads(printed) == answer  # exactly what GET /compare answers
    folders = {}
    for name, evaluation in (("a", a), ("b", b)):
        folders[name] = str(tmp_path / name)
        written = cli("results", evaluation, "--url", server.url, "--output_path", folders[name])
        status, _, said = written
        assert status == 0, said
    status, printed, said = cli("compare", folders["a"], folders["b"], "--json")
    assert status == 0, said
    local = json.loads(printed)
    assert (local["a"], local["b"]) == (folders["a"], folders["b"])
    assert local["metrics"] == answer["metrics"]  # the same files, the same statistics
    status, printed, _ = cli("compare", folders["a"], b, "--url", server.url, "--json")
    assert status == 0 and json.loads(printed)["metrics"] == answer["metrics"]
    status, table, _ = cli("compare", folders["a"], folders["b"])
    assert status == 0 and table.startswith("Paired comparison, B - A (95% intervals; 10,000")
    assert f"  A: {folders['a']} (model {answer['differs']['model'][0]})" in table.splitlines()
    for metric in answer["metrics"]:
        (row,) = [
            line
            for line in table.splitlines()
            if line.startswith(f"| {metric['task']} ")
            and f" {metric['metric']} " in line.split("|")[2]
        ]
        assert (" *" in row) == metric["significant"], row
        assert f"{metric['difference']:+.4f}" in row
    status, _, said = cli("compare", folders["a"], str(tmp_path / "nowhere"))
    assert status == 2 and "does not exist" in said
    status, _, said = cli("compare", a, c, "--url", server.url)
    assert status == 1 and "log_samples" in said  # the server's 422


@pytest.mark.e2e
def test_dashboard_shows_the_paired_comparison(
    server: ServerThread, runs: dict[str, dict[str, Any]], answer: dict[str, Any]
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    a, b = runs["a"]["id"], runs["b"]["id"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.url + "/")
            for evaluation in (a, b):
                box = page.locator(f"#evaluations tr[data-id='{evaluation}'] input.compare")
                box.wait_for(timeout=30_000)
                box.check()
            page.click("#compare-button")
            block = page.locator(f"#paired .paired[data-a='{a}'][data-b='{b}']")
            block.locator("table.paired-table tbody tr").first.wait_for(timeout=30_000)
            _check_rows(block, answer)
            _check_a_flipped_document(page, block, answer, a, b)
            if os.environ.get("RAYEVAL_SCREENSHOT"):  # how docs/comparison.png is made
                page.locator("#compare").screenshot(path=os.environ["RAYEVAL_SCREENSHOT"])
            assert errors == []
        finally:
            browser.close()


def _check_rows(block: Any, answer: dict[str, Any]) -> None:
    """One row per task and metric: difference, intervals and p as the endpoint says."""
    assert block.locator("tbody tr").count() == len(answer["metrics"])
    for metric in answer["metrics"]:
        row = block.locator(
            f"tbody tr[data-task='{metric['task']}'][data-metric='{metric['metric']}']"
            f"[data-filter='{metric['filter']}']"
        )
        difference = row.locator("td.difference").text_content() or ""
        assert difference.startswith(f"{metric['difference']:+.4f}")
        low, high = metric["paired_interval"]
        assert row.locator("td.paired").text_content() == f"[{low:+.4f}, {high:+.4f}]"
        if metric["unpaired_interval"] is not None:
            low, high = metric["unpaired_interval"]
            assert row.locator("td.unpaired").text_content() == f"[{low:+.4f}, {high:+.4f}]"
        p = row.locator("td.p").text_content() or ""
        shown = "< 0.0001" if metric["p_value"] < 0.0001 else f"{metric['p_value']:.4f}"
        assert p.startswith(shown)
        marked = "significant" in (row.get_attribute("class") or "")
        assert marked == metric["significant"] == p.endswith("*"), (metric, p)


def _check_a_flipped_document(
    page: Any, block: Any, answer: dict[str, Any], a: str, b: str
) -> None:
    """Open a metric's flipped documents; a document's link shows its samples in A and B."""
    flipped = next(m for m in answer["metrics"] if m["test"] == "mcnemar" and m["worse"])
    row = block.locator(
        f"tbody tr[data-task='{flipped['task']}'][data-metric='{flipped['metric']}']"
        f"[data-filter='{flipped['filter']}']"
    )
    row.locator("details summary").click()
    links = row.locator("a.doc")
    assert links.count() == len(flipped["better"]) + len(flipped["worse"])
    doc = flipped["worse"][0]
    link = row.locator(f"a.doc[data-doc='{doc}']").first
    assert link.get_attribute("href") == (
        f"/evaluations/{b}/samples/{flipped['task']}?doc_id={doc}"
    )
    link.click()
    page.locator("#sample-view").wait_for(state="visible", timeout=30_000)
    for side in ("a", "b"):
        text = page.locator(f"#sample-{side}").text_content() or ""
        assert f'"doc_id": {doc},' in text
    assert a[:8] in (page.locator("#sample-a-title").text_content() or "")
