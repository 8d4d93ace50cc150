"""The response cache on a full disk: answers it has no room for are skipped, never the
evaluation (issue 41's chaos soak filled the cache's filesystem and an evaluation failed).

Real SQLite; the one seam is the cache database's page limit (``PRAGMA max_page_count``), which
makes SQLite answer exactly as on a full disk (``SQLITE_FULL``, "database or disk is full").
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from rayeval.service.engine.response_cache import ResponseCache, cache_file, open_cache


@pytest.mark.unit
def test_a_full_cache_skips_answers_and_keeps_what_it_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ResponseCache(cache_file(str(tmp_path / "cache")), "model")
    cache.put_many([(["kept", i], [float(i), True]) for i in range(4)])
    pages = cache._db.execute("PRAGMA page_count").fetchone()[0]
    cache._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on

    store = cache.storer([(["big", i], 0, (i,)) for i in range(200)])
    with caplog.at_level(logging.WARNING):
        store(0, ["x" * 1000] * 200)  # raised sqlite3.OperationalError before
        cache.mark_evaluated("model", "settings")
    assert cache.unstored == 200 and cache.stored == 4
    assert "not storing answers" in caplog.text and "disk is full" in caplog.text
    kept = cache.get_many([["kept", i] for i in range(4)])
    assert kept == {i: (float(i), True) for i in range(4)}
    assert cache.get_many([["big", 0]]) == {}

    cache._db.execute("PRAGMA max_page_count = 1073741823")  # room again: it stores again
    cache.put_many([(["big", 0], "x")])
    assert cache.get_many([["big", 0]]) == {0: "x"} and cache.stored == 5
    cache.close()


@pytest.mark.unit
def test_other_database_errors_still_raise(tmp_path: Path) -> None:
    cache = ResponseCache(cache_file(str(tmp_path / "cache")), "model")
    cache._db.execute("DROP TABLE answers")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        cache.put_many([(["a"], 1.0)])
    assert open_cache(None, {}) is None
    cache.close()


@pytest.mark.unit
def test_answers_stored_again_are_counted_as_computed_twice(tmp_path: Path) -> None:
    cache = ResponseCache(cache_file(str(tmp_path / "cache")), "model")
    cache.put_many([(["a", i], float(i)) for i in range(3)])
    cache.put_many([(["a", i], float(i)) for i in range(2, 6)])  # ["a", 2] a second time
    assert (cache.stored, cache.rewritten) == (7, 1)
    cache.close()


@pytest.mark.service
def test_an_evaluation_that_misses_the_cache_counts_what_it_computed_twice(
    tmp_path: Path, demo: Any, task_manager: Any, ray_session: None, monkeypatch: Any
) -> None:
    """A rerun on the cache computes nothing; a rerun whose look-up misses (the one seam)
    computes every request again, and its figures say so (the chaos soak's check)."""
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.vocabulary.events import RequestType
    from tests.helpers import evaluate

    prefix = str(tmp_path / "answers")

    def run() -> Any:
        with RayEvalLM(str(demo.model_dir), dtype="float32", use_cache=prefix) as lm:
            evaluate(lm, task_manager, ["demo_mc"], limit=4, bootstrap_iters=0)
            return lm.engine.stats[RequestType.LOGLIKELIHOOD]

    first = run()
    assert first.cached == 0 and first.recomputed == 0 and first.requests > 0
    again = run()
    assert again.cached == first.requests and again.recomputed == 0
    monkeypatch.setattr(ResponseCache, "get_many", lambda self, requests: {})
    missed = run()
    assert missed.cached == 0 and missed.recomputed == first.requests
    assert missed.report()["recomputed"] == first.requests
