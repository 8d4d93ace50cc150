"""The one configuration object: every door derives from it, and each door names its own fields.

No Ray here: these check the declarations themselves (fast tier).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from pydantic import ValidationError

from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.config_fields import (
    OTHER_DOORS,
    RAYEVAL_FLAGS,
    cli_flag,
    config_field_paths,
    config_from_keywords,
    describe_errors,
)
from rayeval.service.vocabulary.lm_eval_options import LM_EVAL_HOST_FIELDS

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {"model_args": {"pretrained": "org/model"}, "tasks": ["demo_mc"]}


def _run_flags() -> dict[str, Any]:
    """``rayeval run``'s flags: option string -> argparse action."""
    import argparse

    from rayeval.api.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices["run"]
    return {flag: action for action in run._actions for flag in action.option_strings}


def test_every_config_field_has_a_cli_flag_with_the_config_default() -> None:
    flags = _run_flags()
    for path in config_field_paths():
        if path in OTHER_DOORS:
            assert all(flag in flags for flag in OTHER_DOORS[path]), path
            continue
        flag = cli_flag(path)
        assert flag in flags, f"config field {'.'.join(path)} has no `rayeval run` flag {flag}"
    for path, flag in RAYEVAL_FLAGS.items():
        default = EvaluationConfig.model_validate(BASE)
        for part in path:
            default = getattr(default, part)
        assert flags[flag].default == default, (flag, flags[flag].default, default)


def test_every_lm_eval_option_is_the_config_s_or_the_host_s() -> None:
    """A new lm-eval option fails here until it is given a home (config or host)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    ours = {path[0] for path in config_field_paths()} | LM_EVAL_HOST_FIELDS
    ours |= {"output_path", "include_path", "config"}  # HostOptions' own fields; YAML input
    missing = {f.name for f in fields(EvaluatorConfig)} - ours
    assert not missing, f"lm-eval options with no place in rayeval: {sorted(missing)}"


def test_rest_body_is_the_config() -> None:
    from rayeval.api.app import create_app
    from rayeval.api.schemas import EvaluationCreate
    from rayeval.api.settings import Settings

    assert EvaluationCreate is EvaluationConfig
    schema = create_app(Settings()).openapi()["components"]["schemas"]
    assert set(schema["EvaluationConfig"]["properties"]) == set(EvaluationConfig.model_fields)
    assert schema["Parallelism"]["properties"]["num_replicas"]["minimum"] == 1


def test_round_trip_and_frozen() -> None:
    config = EvaluationConfig.model_validate(
        {**BASE, "model_args": "pretrained=org/model,dtype=float32", "tasks": "a, b,a"}
    )
    assert config.tasks == ("a", "b") and config.model_args["dtype"] == "float32"
    assert EvaluationConfig.from_json(config.to_json()) == config
    with pytest.raises(ValidationError):
        config.limit = 3  # type: ignore[misc]
    # A row stored by rayeval 0.1 (layout fields flat) still reads.
    legacy = {**config.to_json(), "num_replicas": 2}
    del legacy["parallelism"]
    assert EvaluationConfig.from_json(legacy).parallelism.num_replicas == 2


def test_errors_name_rest_fields_and_cli_flags() -> None:
    bad = {**BASE, "model": "vllm", "parallelism": {"num_replicas": 0}, "timeouts": {"step_s": 0}}
    with pytest.raises(ValidationError) as caught:
        EvaluationConfig.model_validate(bad)
    cli = describe_errors(caught.value, cli_flag)
    assert "--num_replicas: Input should be greater than or equal to 1, got 0" in cli
    assert "--step_timeout:" in cli and "--model: 'vllm' is not supported" in cli
    rest = describe_errors(caught.value, ".".join)
    assert "parallelism.num_replicas:" in rest and "timeouts.step_s:" in rest


def test_refusals_name_fields_in_each_doors_words() -> None:
    """A field named inside a message reads as a body field, a flag or a keyword (issue 38)."""
    import pickle

    from rayeval.actors.errors import ConfigError, LayoutError, RayEvalError
    from rayeval.actors.layout import DeviceKind, ParallelLayout
    from rayeval.service.vocabulary.doors import Door, render, reword

    with pytest.raises(LayoutError) as caught:
        ParallelLayout(3, 2).check_fits({"CPU": 4})
    oversized = caught.value
    assert "Lower --num_replicas / --shard_size" in str(oversized)
    assert render(oversized, Door.CLI) == str(oversized)
    rest = render(oversized, Door.REST)
    assert "6 CPU requested, 4 in the cluster" in rest and "--" not in rest
    assert "Lower parallelism.num_replicas / parallelism.shard_size" in rest
    assert "Lower num_replicas= / shard_size=" in render(oversized, Door.PYTHON)
    revived = pickle.loads(pickle.dumps(oversized))  # as it crosses Ray actors
    assert render(revived, Door.REST) == rest and str(revived) == str(oversized)
    reworded = reword(RayEvalError(oversized.marked_message), Door.PYTHON)
    assert "Lower num_replicas= / shard_size=" in str(reworded)

    with pytest.raises(LayoutError) as caught:
        ParallelLayout(1, 1, device=DeviceKind.CUDA).check_fits({"CPU": 4})
    assert '"device": "cpu"' in render(caught.value, Door.REST)
    assert "device='auto'" in render(caught.value, Door.PYTHON)
    assert "--device cpu" in str(caught.value)

    bad = {**BASE, "model_args": "pretrained=org/model,tp_plan=auto"}
    with pytest.raises(ValidationError) as invalid:
        EvaluationConfig.model_validate(bad)
    cli = describe_errors(invalid.value, cli_flag)
    assert "use --shard_size with --shard_strategy tp (or auto)" in cli
    rest = describe_errors(invalid.value, ".".join, Door.REST)
    assert 'parallelism.shard_size with "parallelism": {"shard_strategy": "tp"}' in rest
    with pytest.raises(ConfigError, match=r"parallelize: .* use shard_size= instead"):
        config_from_keywords("org/model", parallelize=True)


def test_placement_reaches_the_layout_from_every_door() -> None:
    from rayeval.actors.layout import DeviceKind, PlacementPolicy
    from rayeval.api.cli import build_parser

    cpu = DeviceKind.CPU
    body = {**BASE, "parallelism": {"shard_size": 2, "placement": "spread"}}
    config = EvaluationConfig.model_validate(body)
    assert config.layout(cpu).placement is PlacementPolicy.SPREAD
    assert EvaluationConfig.from_json(config.to_json()) == config
    assert config_from_keywords("org/model", placement="pack").layout(cpu).placement == "pack"
    with pytest.raises(ValidationError, match="placement"):
        EvaluationConfig.model_validate({**BASE, "parallelism": {"placement": "scatter"}})
    with pytest.raises(ValidationError, match='under "parallelism"'):
        EvaluationConfig.model_validate({**BASE, "placement": "spread"})
    parser = build_parser()
    args = parser.parse_args(["run", "--tasks", "t", "--placement", "spread"])
    assert args.placement == "spread"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--tasks", "t", "--placement", "scatter"])


def test_python_keywords_split_into_layout_timeouts_and_model_args() -> None:
    from rayeval.actors.errors import ConfigError
    from rayeval.actors.layout import Timeouts

    config = config_from_keywords(
        "org/model", num_replicas=2, step_s=5, timeouts=Timeouts(load_s=9), dtype="float32"
    )
    assert config.parallelism.num_replicas == 2 and config.model_args["dtype"] == "float32"
    assert config.timeouts.load_s == 9 and config.timeouts.step_s == 5
    with pytest.raises(ConfigError, match="shard_size: Input should be greater than or equal"):
        config_from_keywords("org/model", shard_size=-2)
    with pytest.raises(ConfigError, match="parallelize: rayeval shards"):
        config_from_keywords("org/model", parallelize=True)


def test_host_options_take_only_lm_eval_host_fields() -> None:
    from rayeval.actors.errors import ConfigError

    with pytest.raises(ConfigError, match="not lm-eval host options"):
        HostOptions(lm_eval={"limit": 3})


def test_auto_budgets_per_device_and_request_type() -> None:
    """``auto``: CPU ranks score in micro-batches of at most 2048 padded tokens, GPUs in 8192;
    generation keeps 8192 everywhere; ``max_batch_tokens`` and an integer batch size win."""
    from rayeval.actors.layout import DeviceKind
    from rayeval.service.engine.plan.budgets import budget as _budget

    auto = config_from_keywords("org/model")
    assert _budget(auto, score_on=DeviceKind.CPU).max_tokens == 2048
    assert _budget(auto, score_on=DeviceKind.CUDA).max_tokens == 8192
    assert _budget(auto).max_tokens == 8192  # generation
    assert _budget(auto).max_rows == 64
    given = config_from_keywords("org/model", max_batch_tokens=4096)
    assert _budget(given, score_on=DeviceKind.CPU).max_tokens == 4096
    rows = config_from_keywords("org/model", batch_size=16)
    assert _budget(rows, score_on=DeviceKind.CPU).max_rows == 16
    assert _budget(rows, score_on=DeviceKind.CPU).max_tokens == 2**62
