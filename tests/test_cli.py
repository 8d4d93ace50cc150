"""``rayeval run``: lm-eval's flags, lm-eval's output files, clear errors for bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rayeval.api.cli import main
from tests.helpers import assert_same_results, demo_cli_args, read_outputs, run_lm_eval_cli

pytestmark = pytest.mark.e2e


def test_run_writes_what_lm_eval_writes(
    demo: Any, ray_session: None, tmp_path: Path, capsys: Any
) -> None:
    common = demo_cli_args(demo)
    run_lm_eval_cli(["run", *common, "--device", "cpu", "--batch_size", "4",
                      "--output_path", str(tmp_path / "ref")])  # fmt: skip
    status = main(["run", *common, "--batch_size", "auto", "--num_replicas", "2",
                   "--output_path", str(tmp_path / "ours")])  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "|demo_mc" in printed and "exact_match" in printed and "layout: 2x1" in printed
    # Where the files went, on the console (lm-eval says it only in the log file).
    said = {line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("results: ")}
    (results_file,) = said
    assert Path(results_file).is_file() and Path(results_file).is_relative_to(tmp_path / "ours")
    samples = [line for line in printed.splitlines() if line.startswith("samples: ")]
    assert len(samples) == 2 and all(Path(line[9:]).is_file() for line in samples)

    ref_name, ref_results, ref_samples = read_outputs(tmp_path / "ref")
    our_name, our_results, our_samples = read_outputs(tmp_path / "ours")
    assert our_name == ref_name == str(demo.model_dir).replace("/", "__")
    assert set(our_results) == set(ref_results)
    assert our_results["config"]["model"] == "hf"
    assert our_results["n-shot"] == {"demo_gen_short": 2, "demo_mc": 2}
    for key in ("configs", "versions", "n-shot", "higher_is_better", "n-samples"):
        assert our_results[key] == ref_results[key], key
    assert set(our_samples) == {"demo_gen_short", "demo_mc"}
    assert set(our_samples["demo_mc"][0]) == set(ref_samples["demo_mc"][0])
    assert_same_results(
        {"results": ref_results["results"], "samples": ref_samples},
        {"results": our_results["results"], "samples": our_samples},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "vllm"],
            "--model: 'vllm' is not supported: rayeval runs lm-eval's Hugging Face",
        ),
        (["--tasks", "no_such_task"], "Tasks not found: no_such_task"),
        (["--num_replicas", "0"], "--num_replicas: Input should be greater than or equal to 1"),
        (["--step_timeout", "-1"], "--step_timeout: Input should be greater than 0, got -1.0"),
        (
            ["--model_args", "pretrained=/nonexistent/model"],
            "no such folder: '/nonexistent/model' (pretrained=/nonexistent/model)",
        ),
        (["--model_args", "pretrained=MODEL,parallelize=True"], "parallelize: rayeval shards"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: list[str], message: str, demo: Any, ray_session: None, capsys: Any
) -> None:
    base = {
        "--model": "hf",
        "--model_args": f"pretrained={demo.model_dir}",
        "--include_path": str(demo.tasks_dir),
        "--tasks": "demo_mc",
    }
    given = dict(zip(args[::2], args[1::2], strict=True))
    if "--model_args" in given:
        given["--model_args"] = given["--model_args"].replace("MODEL", str(demo.model_dir))
    argv = ["run"] + [x for pair in (base | given).items() for x in pair]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_use_cache_never_serves_one_model_s_answers_to_another(
    demo: Any, ray_session: None, tmp_path: Path, capsys: Any
) -> None:
    """Two models on one --use_cache path each get their own results; a rerun computes nothing."""
    from rayeval.service.demo import build_tiny_model

    other = build_tiny_model(tmp_path / "other", arch="gpt2", seed=1, train_steps=20)
    cache = str(tmp_path / "cache" / "run")

    def args_for(model_dir: Any) -> list[str]:
        args = demo_cli_args(demo)
        args[args.index("--model_args") + 1] = f"pretrained={model_dir},dtype=float32"
        return args

    def run(model_dir: Any, out: str) -> tuple[dict[str, Any], dict[str, Any], str]:
        argv = ["run", *args_for(model_dir), "--use_cache", cache]
        status = main([*argv, "--output_path", str(tmp_path / out)])
        assert status == 0
        _, results, samples = read_outputs(tmp_path / out)
        return results, samples, capsys.readouterr().out

    first, first_samples, _ = run(demo.model_dir, "a1")
    second, second_samples, printed = run(other, "b1")
    assert "(0 answered from the cache)" in printed, "the other model got cached answers"
    run_lm_eval_cli(["run", *args_for(other), "--device", "cpu", "--batch_size", "4",
                     "--output_path", str(tmp_path / "ref")])  # fmt: skip
    _, reference, reference_samples = read_outputs(tmp_path / "ref")
    assert_same_results(
        {"results": reference["results"], "samples": reference_samples},
        {"results": second["results"], "samples": second_samples},
    )
    assert first["results"] != second["results"]

    again, again_samples, printed = run(demo.model_dir, "a2")
    assert "0 requests computed in 0 micro-batches" in printed, printed
    # Evaluated to the end before with these settings: the cache answers all, no rank starts.
    assert "ranks: none started (every answer came from the response cache)" in printed, printed
    assert_same_results(
        {"results": first["results"], "samples": first_samples},
        {"results": again["results"], "samples": again_samples},
        exact=True,
    )
