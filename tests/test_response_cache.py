"""The response cache on a full disk: answers it has no room for are skipped, never the
evaluation (issue 41's chaos soak filled the cache's filesystem and an evaluation failed).

Real SQLite; the one seam is the cache database's page limit (``PRAGMA max_page_count``), which
makes SQLite answer exactly as on a full disk (``SQLITE_FULL``, "database or disk is full").
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

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
