"""lm-eval's own trackers through ``rayeval run``: a team's ``lm_eval`` scripts keep working.

One ``rayeval run`` with every tracker flag that needs no network: W&B in offline mode
(``--wandb_args mode=offline``), the Hub tracker writing to a local path (``--hf_hub_log_args
output_path=...`` and no ``--output_path``, so, as lm-eval requires, no ``--log_samples``),
``--write_out``, ``--show_config`` and ``--use_cache``; each flag's effect is its own test.
Through the REST service these are the server's, not a request's: a body naming one is refused
with the reason (last test).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rayeval.api.cli import main
from tests.helpers import read_outputs

TASKS = "demo_gen_short,demo_mc"


@pytest.fixture(scope="module")
def tracked_run(
    demo: Any, ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    import contextlib
    import io

    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'rayeval[wandb]'")
    root = tmp_path_factory.mktemp("trackers")
    argv = [
        "run", "--model", "hf",
        "--model_args", f"pretrained={demo.model_dir},dtype=float32",
        "--include_path", str(demo.tasks_dir), "--tasks", TASKS,
        "--limit", "3", "--gen_kwargs", "max_gen_toks=4",
        "--wandb_args", f"project=rayeval-test,mode=offline,dir={root}",
        "--hf_hub_log_args", f"output_path={root / 'hub'},details_repo_name=rayeval-details",
        "--write_out", "--show_config", "--use_cache", str(root / "cache" / "answers"),
    ]  # fmt: skip
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    lm_eval_logger = logging.getLogger("lm_eval")
    previous = lm_eval_logger.level
    lm_eval_logger.addHandler(handler)
    lm_eval_logger.setLevel(logging.INFO)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    finally:
        lm_eval_logger.removeHandler(handler)
        lm_eval_logger.setLevel(previous)
    return {
        "status": status,
        "root": root,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "log": "\n".join(record.getMessage() for record in records),
    }


@pytest.mark.e2e
def test_run_succeeds(tracked_run: dict[str, Any]) -> None:
    assert tracked_run["status"] == 0, tracked_run["stderr"][-2000:]


@pytest.mark.e2e
def test_hf_hub_log_args_output_path_gets_lm_eval_files(
    tracked_run: dict[str, Any], demo: Any
) -> None:
    model_name, results, samples = read_outputs(tracked_run["root"] / "hub")
    assert model_name == str(demo.model_dir).replace("/", "__")
    assert set(results["results"]) == {"demo_gen_short", "demo_mc"}
    assert samples == {}  # lm-eval writes samples only with --log_samples, which needs
    # --output_path (then the files go there, as with lm_eval)
    assert results["n-samples"]["demo_mc"]["effective"] == 3
    assert results["config"]["model"] == "hf"


@pytest.mark.e2e
def test_wandb_offline_run_logs_the_metrics(tracked_run: dict[str, Any]) -> None:
    (run_file,) = (tracked_run["root"] / "wandb").glob("offline-run-*/run-*.wandb")
    summary = {
        key: value
        for kind, key, value in wandb_records(run_file)
        if kind == "summary" and key.startswith("demo_mc/")
    }
    _, results, _ = read_outputs(tracked_run["root"] / "hub")
    metrics = results["results"]["demo_mc"]
    assert summary["demo_mc/acc"] == pytest.approx(metrics["acc,none"])
    assert summary["demo_mc/acc_stderr"] == pytest.approx(metrics["acc_stderr,none"])
    kinds = {kind for kind, _, _ in wandb_records(run_file)}
    assert {"history", "summary", "config", "exit"} <= kinds, "a finished run, as wandb sync reads"


def wandb_records(path: Path) -> list[tuple[str, str, Any]]:
    """(record kind, key, value) of an offline run file: LevelDB-log blocks of wandb's protobuf
    records (what ``wandb sync`` uploads), read without the network."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    block, pos, pending, raw_records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            raw_records.append(chunk)
        elif kind in (2, 3):  # first / middle fragment
            pending += chunk
        elif kind == 4:  # last fragment
            raw_records.append(pending + chunk)
            pending = b""
    found: list[tuple[str, str, Any]] = []
    for raw in raw_records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind_name = record.WhichOneof("record_type") or ""
        items: Any = ()
        if kind_name == "summary":
            items = record.summary.update
        elif kind_name == "history":
            items = record.history.item
        found.append((kind_name, "", None))
        for item in items:
            key = item.key or "/".join(item.nested_key)
            found.append((kind_name, key, json.loads(item.value_json)))
    return found


@pytest.mark.e2e
def test_write_out_prints_the_first_prompt(tracked_run: dict[str, Any]) -> None:
    log = tracked_run["log"]
    assert "context prompt (starting on next line)" in log
    assert "Task: " in log and "demo_mc" in log


@pytest.mark.e2e
def test_show_config_prints_the_results_json(tracked_run: dict[str, Any]) -> None:
    printed = tracked_run["stdout"]
    start = printed.index("{\n")
    shown, _ = json.JSONDecoder().raw_decode(printed[start:])
    assert set(shown["configs"]) == {"demo_gen_short", "demo_mc"}
    assert shown["configs"]["demo_mc"]["output_type"] == "multiple_choice"
    assert "|demo_mc" in printed[start:]  # the table follows, as with lm_eval


@pytest.mark.e2e
def test_use_cache_is_rayeval_s_durable_cache(tracked_run: dict[str, Any]) -> None:
    cache = tracked_run["root"] / "cache" / "answers_rayeval.sqlite"
    assert cache.is_file() and cache.stat().st_size > 0
    assert "(0 answered from the cache)" in tracked_run["stdout"]


@pytest.mark.unit
def test_service_refuses_tracker_options_in_a_request(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from rayeval.service.vocabulary.config import EvaluationConfig

    for option in ("wandb_args", "hf_hub_log_args", "write_out", "show_config", "use_cache"):
        with pytest.raises(ValidationError) as error:
            EvaluationConfig.model_validate(
                {"model_args": {"pretrained": "m"}, "tasks": ["t"], option: {"x": 1}}
            )
        assert "not settable by a request" in str(error.value) or "results" in str(error.value)
