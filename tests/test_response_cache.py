"""The response cache on a full disk: answers it has no room for are skipped, never the
evaluation (issue 41's chaos soak filled the cache's filesystem and an evaluation failed).

Real SQLite; the one seam is the cache database's page limit (``PRAGMA max_page_count``), which
makes SQLite answer exactly as on a full disk (``SQLITE_FULL``, "database or disk is full"), or,
for opening the cache, a file-size limit (``RLIMIT_FSIZE``) in a child process: SQLite cannot
create its shared-memory index, "disk I/O error", as on a full tmpfs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
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


_OPEN_ON_A_FULL_DISK = """
import logging, resource, signal, sys
from rayeval.service.engine.response_cache import ResponseCache, cache_file, open_cache

logging.basicConfig(level=logging.WARNING, format="%(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, as ENOSPC does
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
prefix = sys.argv[1]
try:
    ResponseCache(cache_file(prefix), "model")
except Exception as error:
    print("raw:", type(error).__name__, error.sqlite_errorname)
print("engine's:", open_cache(prefix, {"pretrained": "m"}))
print("sweep's:", open_cache(prefix, None))
"""


@pytest.mark.unit
def test_a_cache_opened_on_a_full_disk_is_left_out(tmp_path: Path) -> None:
    """The soak filled the disk as a sweep started: opening the cache (SQLite creates its WAL
    index) failed with "disk I/O error" and the sweep failed. The engine's cache and a
    sweep's (which records what was evaluated) both go without it now."""
    prefix = str(tmp_path / "cache")
    cache = ResponseCache(cache_file(prefix), "model")
    cache.put_many([(["a", i], float(i)) for i in range(50)])
    cache.close()  # the last connection: SQLite removes the WAL and its index
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_ON_A_FULL_DISK, prefix],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raw: OperationalError SQLITE_IOERR_SHMSIZE" in done.stdout, done.stdout
    assert "engine's: None" in done.stdout and "sweep's: None" in done.stdout, done.stdout
    assert done.stderr.count("cannot open it (disk I/O error); evaluating without it") == 2
    reopened = ResponseCache(cache_file(prefix), "model")  # room again: nothing was lost
    assert reopened.get_many([["a", 1], ["a", 49]]) == {0: 1.0, 1: 49.0}
    reopened.close()


@pytest.mark.unit
def test_another_torch_transformers_or_lm_eval_version_is_another_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers cached under other versions of the packages that compute them are not served:
    the model's fingerprint names the installed versions (the one seam: the version lookup)."""
    from rayeval.service.engine import response_cache

    args = {"pretrained": "org/model", "dtype": "bfloat16"}
    installed = response_cache.model_fingerprint(args)
    assert response_cache.model_fingerprint(args) == installed
    real = response_cache._version
    for package in ("torch", "transformers", "lm_eval"):

        def other(name: str, changed: str = package) -> str | None:
            return "0.0.1" if name == changed else real(name)

        monkeypatch.setattr(response_cache, "_version", other)
        assert response_cache.model_fingerprint(args) != installed, package
        monkeypatch.undo()


@pytest.mark.unit
def test_another_device_kind_strategy_or_machine_is_another_site(tmp_path: Path) -> None:
    """Answers are keyed by where they were computed: the device kind and the strategy for
    every dtype, the kernels' machine for half precision only; one rank, replicas and FSDP at
    any G (all settled as FSDP) share."""
    import torch

    from rayeval.actors.layout import DeviceKind, ShardStrategy
    from rayeval.service.engine.response_cache import AnswerSite, answer_site, answers_fingerprint

    cpu, cuda = DeviceKind.CPU, DeviceKind.CUDA
    fsdp, tp = ShardStrategy.FSDP, ShardStrategy.TP
    base = AnswerSite(cpu, fsdp, "cpu:AVX2")
    others = [AnswerSite(cuda, fsdp, "cpu:AVX2"), AnswerSite(cpu, tp, "cpu:AVX2")]
    others.append(AnswerSite(cpu, fsdp, "cpu:AVX512"))
    fingerprint = answers_fingerprint("model", base)
    assert answers_fingerprint("model", AnswerSite(cpu, fsdp, "cpu:AVX2")) == fingerprint
    for other in others:
        assert answers_fingerprint("model", other) != fingerprint, other
    assert answers_fingerprint("other-model", base) != fingerprint

    here = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    assert answer_site(cpu, tp, torch.bfloat16) == AnswerSite(cpu, tp, here)
    assert answer_site(cpu, fsdp, torch.float16).kernels == here
    assert answer_site(cpu, fsdp, torch.float32) == AnswerSite(cpu, fsdp)  # no machine
    with pytest.raises(ValueError, match="settled shard strategy"):
        AnswerSite(cpu, ShardStrategy.AUTO)

    path = cache_file(str(tmp_path / "cache"))
    one_rank = ResponseCache(path, "model", base)
    one_rank.put_many([(["score", 1], (-1.5, True))])
    settled: list[AnswerSite] = []
    tensor_parallel = ResponseCache(path, "model", lambda: settled.append(others[1]) or others[1])
    assert settled == []  # settled when the first key is made, not before
    assert tensor_parallel.get_many([["score", 1]]) == {}
    assert tensor_parallel.site == others[1] and len(settled) == 1
    assert ResponseCache(path, "model", base).get_many([["score", 1]]) == {0: (-1.5, True)}
    for cache in (one_rank, tensor_parallel):
        cache.close()


@pytest.mark.service
def test_bf16_answers_of_one_rank_are_not_served_to_tensor_parallelism(
    tmp_path: Path, demo: Any, task_manager: Any, ray_session: None
) -> None:
    """bf16 at 1x1, then 1x2 with tp on the same --use_cache: tensor parallelism computes every
    answer itself (its kernels move a bf16 answer); 1x1 again is served whole from the cache."""
    from rayeval.actors.layout import ShardStrategy
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.vocabulary.events import RequestType
    from tests.helpers import evaluate

    prefix = str(tmp_path / "answers")

    def run(shard_size: int, strategy: str) -> Any:
        with RayEvalLM(
            str(demo.model_dir),
            shard_size=shard_size,
            shard_strategy=strategy,
            dtype="bfloat16",
            use_cache=prefix,
        ) as lm:
            evaluate(lm, task_manager, ["demo_mc"], limit=4, bootstrap_iters=0)
            site = lm.engine._cache.site
            assert site is not None and site.strategy is lm.engine.shard_strategy
            return lm.engine.stats[RequestType.LOGLIKELIHOOD], site

    first, one_rank = run(1, "auto")
    assert first.cached == 0 and first.requests > 0
    assert one_rank.strategy is ShardStrategy.FSDP and one_rank.kernels is not None
    tensor_parallel, tp_site = run(2, "tp")
    assert tp_site.strategy is ShardStrategy.TP
    assert tensor_parallel.cached == 0 and tensor_parallel.requests == first.requests
    again, _ = run(1, "auto")
    assert again.cached == first.requests and again.recomputed == 0
