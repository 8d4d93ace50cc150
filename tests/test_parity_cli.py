"""``rayeval parity``: lm-eval hf at its batch sizes and rayeval at each layout, on the demo model
and tasks, in this process on the session's Ray; its report, verdicts and exit status; and the
refusal of a layout it cannot read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rayeval.api.cli import main

# One tier per test (tests/conftest.py): the runs are e2e, the refusals of bad flags unit.


@pytest.fixture(autouse=True)
def _log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's log file in the test's folder, not the working directory's."""
    monkeypatch.setenv("RAYEVAL_LOG_DIR", str(tmp_path / "logs"))


def _parity(demo: Any, dtype: str, *extra: str) -> list[str]:
    return [
        "parity",
        "--model_args", f"pretrained={demo.model_dir},dtype={dtype}",
        "--include_path", str(demo.tasks_dir),
        "--tasks", "demo_mc,demo_gen_short",
        "--limit", "4", "--num_fewshot", "1", "--gen_kwargs", "max_gen_toks=5", "--device", "cpu",
        *extra,
    ]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_holds_at_one_rank_and_two_shards(
    dtype: str, demo: Any, ray_session: None, tmp_path: Path, capsys: Any
) -> None:
    report = tmp_path / "report" / "parity.json"
    argv = _parity(demo, dtype, "--layouts", "1x1,1x2", "--output_path", str(report))
    status = main(argv)
    captured = capsys.readouterr()
    printed = captured.out
    assert status == 0, printed + captured.err
    lines = printed.splitlines()
    assert lines[0].startswith(f"parity of rayeval with lm-eval hf: {demo.model_dir} ({dtype})")
    assert "tasks demo_mc,demo_gen_short, limit 4, num_fewshot 1" in lines[0] and lines[0].endswith(
        "on cpu"
    )
    assert lines[1].startswith("lm-eval hf at batch sizes 1, 4, 16: spread (logprob ")
    for label in ("1x1", "1x2"):
        (head,) = [line for line in lines if line.startswith(f"layout {label}")]
        assert "distance to the nearest lm-eval hf run (logprob " in head, head
        assert f"  {label}: holds (no further from lm-eval hf than" in printed
    (sharded,) = [line for line in lines if line.startswith("layout 1x2")]
    assert sharded.startswith(("layout 1x2, tp (", "layout 1x2, fsdp (")), sharded
    assert "samples whose is_greedy or generation differs: " in printed
    assert lines[-2] == "parity holds at every layout (1x1, 1x2)"
    assert lines[-1] == f"report: {report}"

    written = json.loads(report.read_text())
    assert written["holds"] is True and written["hf_batch_sizes"] == [1, 4, 16]
    assert [layout["layout"] for layout in written["layouts"]] == ["1x1", "1x2"]
    assert all(layout["holds"] and layout["beyond"] == {} for layout in written["layouts"])
    assert {"logprob", "is_greedy", "generations"} <= set(written["spread"])
    assert written["layouts"][0]["strategy"] is None


@pytest.mark.e2e
def test_a_layout_rayeval_refuses_is_reported_not_raised(
    demo: Any, ray_session: None, capsys: Any
) -> None:
    """A replica of 3 TP ranks cannot split the demo's heads: refused, named, exit status 1."""
    status = main(_parity(demo, "float32", "--layouts", "1x3:tp", "--hf_batch_sizes", "1,4"))
    printed = capsys.readouterr()
    assert status == 1, printed.out
    (refused,) = [line for line in printed.out.splitlines() if line.startswith("layout 1x3:tp")]
    assert refused.startswith("layout 1x3:tp: refused by rayeval: "), refused
    assert "num_attention_heads=4 is not divisible by shard_size 3" in refused
    assert refused.endswith("(here: change 1x3:tp in --layouts, RxG[:STRATEGY], comma-separated: "
                            "R replicas of G ranks each, STRATEGY how a replica of G > 1 ranks "
                            "shards the model (auto, fsdp or tp; default auto), e.g. "
                            "1x1,1x2,2x1,2x2:fsdp)"), refused  # fmt: skip
    assert printed.out.splitlines()[-1] == "parity refused at 1x3:tp (not checked)"
    assert "Traceback" not in printed.err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--layouts", "2by2", "'2by2' is not a layout: give RxG[:STRATEGY], comma-separated"),
        ("--layouts", "1x2:zero", "'1x2:zero' is not a layout: give RxG[:STRATEGY]"),
        ("--layouts", "0x2", "'0x2' has no ranks: R and G are at least 1"),
        ("--hf_batch_sizes", "4", "give at least two batch sizes, e.g. 1,4,16"),
        ("--hf_batch_sizes", "1,x", "give positive integers, comma-separated"),
    ],
)
def test_a_bad_layout_or_batch_size_is_refused_naming_the_syntax(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["parity", "--model_args", "pretrained=/m", "--tasks", "t", "--limit", "2"]
    argv += ["--layouts", "1x1", flag, value]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rayeval parity"), err
    assert f"argument {flag}: " in err and said in err, err


@pytest.mark.unit
def test_parity_without_a_sample_is_refused_naming_limit(capsys: Any) -> None:
    status = main(["parity", "--model_args", "pretrained=/m", "--tasks", "t", "--layouts", "1x1"])
    assert status == 2
    assert "rayeval parity: error: give --limit N (e.g. --limit 20)" in capsys.readouterr().err
