"""The ``rayeval`` parsers: ``serve``'s flags come from ``api.settings.Settings`` (one per field,
named, typed and explained by the field, a new field included; a flag given wins over
``RAYEVAL_*``, a flag not given leaves the environment in charge), and ``submit``'s flags become
the body of ``POST /evaluations``.

No Ray, no server: these parse command lines and build ``Settings`` (fast tier).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from rayeval.api.cli import build_parser
from rayeval.api.cli.settings_flags import add_settings_flags, flag_of, overrides
from rayeval.api.settings import Settings

pytestmark = pytest.mark.unit

#: The spellings `rayeval serve` has always had, and the field each sets.
EXISTING = {
    "--host": "host",
    "--port": "port",
    "--data-dir": "data_dir",
    "--database-url": "database_url",
    "--include-path": "include_paths",
    "--model-root": "model_roots",
    "--allow-remote-code": "allow_remote_code",
    "--allowed-host": "allowed_hosts",
    "--stall-timeout": "stall_timeout_s",
    "--warm-replicas": "warm_replicas",
    "--api-token": "api_token",
    "--ray-address": "ray_address",
    "--num-cpus": "num_cpus",
}


def _serve() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Flag -> argparse action."""
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _check_flags(parser: argparse.ArgumentParser, settings: type[Any]) -> None:
    """Every field of ``settings`` has a flag: dest the field's name, None unless given, help the
    field's description, its default and its environment variable."""
    actions = _actions(parser)
    for name, field in settings.model_fields.items():
        flag = flag_of(name, field)
        assert flag in actions, f"Settings.{name} has no `rayeval serve` flag {flag}"
        action = actions[flag]
        assert action.dest == name and action.default is None, (flag, action)
        description = field.description.rstrip(".")
        assert action.help is not None and description in action.help, (flag, action.help)
        if "default" not in description:
            default = field.get_default(call_default_factory=True)
            shown = "none" if default in (None, []) else str(default)
            assert f"default: {shown};" in action.help, (flag, action.help)
        assert f"env RAYEVAL_{name.upper()})" in action.help, (flag, action.help)


def test_every_settings_field_has_a_serve_flag_with_its_help_and_default() -> None:
    _check_flags(_serve(), Settings)
    assert {"--log-level", "--demo", "--demo-dir"} <= set(_actions(_serve()))


def test_existing_spellings_and_dests_stay() -> None:
    actions = _actions(_serve())
    for flag, field in EXISTING.items():
        assert actions[flag].dest == field, flag
    args = build_parser().parse_args(
        ["serve", "--include-path", "a", "--include-path", "b", "--model-root", "m",
         "--allowed-host", "h", "--allow-remote-code", "--stall-timeout", "2.5",
         "--warm-replicas", "3", "--port", "0", "--num-cpus", "4"]
    )  # fmt: skip
    assert args.include_paths == ["a", "b"] and args.model_roots == ["m"]
    assert args.allowed_hosts == ["h"] and args.allow_remote_code is True
    assert args.stall_timeout_s == 2.5 and args.warm_replicas == 3 and args.port == 0
    assert args.num_cpus == 4 and args.host is None and args.response_cache is None
    assert build_parser().parse_args(["serve", "--no-response-cache"]).response_cache is False


def test_flags_override_the_environment_and_absent_flags_leave_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "env").mkdir()
    (tmp_path / "flag").mkdir()
    monkeypatch.setenv("RAYEVAL_PORT", "9001")
    monkeypatch.setenv("RAYEVAL_STALL_TIMEOUT_S", "5")
    monkeypatch.setenv("RAYEVAL_ALLOW_HUB_MODELS", "false")
    monkeypatch.setenv("RAYEVAL_INCLUDE_PATHS", f'["{tmp_path / "env"}"]')
    args = build_parser().parse_args(
        ["serve", "--port", "9002", "--include-path", str(tmp_path / "flag")]
    )
    settings = Settings(**overrides(args, Settings))
    assert settings.port == 9002 and settings.include_paths == [str(tmp_path / "flag")]
    assert settings.stall_timeout_s == 5.0 and settings.allow_hub_models is False
    assert settings.host == "127.0.0.1" and settings.warm_replicas == 0
    again = Settings(**overrides(build_parser().parse_args(["serve"]), Settings))
    assert again.port == 9001 and again.include_paths == [str(tmp_path / "env")]


def test_a_new_settings_field_gets_a_flag() -> None:
    class Grown(Settings):
        queue_limit: int = Field(8, description="Evaluations kept waiting at most.")
        drain_timeout_s: float = Field(9.5, description="Bound on draining at shutdown.")
        motd: str | None = Field(None, description="Said on the dashboard.")
        strict: bool = Field(False, description="Refuse what is merely unusual.")
        mirrors: list[str] = Field(
            default_factory=list,
            description="Hub mirrors.",
            json_schema_extra={"flag": "--mirror", "metavar": "URL"},
        )

    parser = argparse.ArgumentParser()
    add_settings_flags(parser, Grown)
    _check_flags(parser, Grown)
    args = parser.parse_args(
        ["--queue-limit", "3", "--drain-timeout", "1", "--motd", "hi", "--strict",
         "--mirror", "a", "--mirror", "b"]
    )  # fmt: skip
    assert overrides(args, Grown) == {
        "queue_limit": 3, "drain_timeout_s": 1.0, "motd": "hi", "strict": True,
        "mirrors": ["a", "b"],
    }  # fmt: skip

    class Odd(Settings):
        weights: dict[str, int] = Field(default_factory=dict, description="Per-user weights.")

    with pytest.raises(TypeError, match=r"Settings.weights: .* has no `rayeval serve` flag form"):
        add_settings_flags(argparse.ArgumentParser(), Odd)


@pytest.mark.parametrize("output_path", [None, "out"])
def test_submit_flags_become_the_request_body(output_path: str | None) -> None:
    """`rayeval submit` reads `rayeval run`'s flags; --log_samples needs no --output_path there
    (the server keeps the samples), and the body is what POST /evaluations takes."""
    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args as _config_from_args
    from rayeval.api.cli.remote import submission_body
    from rayeval.service.vocabulary.config import EvaluationConfig

    argv = ["submit", "--model_args", "pretrained=/models/m,dtype=float32",
            "--tasks", "demo_mc,demo_cloze", "--log_samples", "--num_replicas", "3",
            "--limit", "5", "--gen_kwargs", "max_gen_toks=7"]  # fmt: skip
    if output_path:
        argv += ["--output_path", output_path]
    config = submission_body(build_parser().parse_args(argv), _config_from_args)
    assert EvaluationConfig.model_validate(config.to_json()) == config
    assert config.log_samples and config.limit == 5 and config.tasks == ("demo_mc", "demo_cloze")
    assert config.parallelism.num_replicas == 3 and config.gen_kwargs == {"max_gen_toks": 7}
    assert config.model_args == {"pretrained": "/models/m", "dtype": "float32"}


def test_submit_names_a_sweep_or_a_watch() -> None:
    """`rayeval submit --checkpoints A,GLOB` and `--watch DIR --poll_interval S ...` become the
    body's ``sweep`` (paths as given: the server expands and checks them); both at once, or a
    bad watch setting, are refused naming the flags."""
    from rayeval.actors.errors import ConfigError
    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args as _config_from_args
    from rayeval.api.cli.remote import submission_body

    base = ["submit", "--model_args", "pretrained=/models/m", "--tasks", "demo_mc"]

    def body(*flags: str) -> Any:
        return submission_body(build_parser().parse_args([*base, *flags]), _config_from_args)

    assert body().sweep is None
    sweep = body("--checkpoints", "/models/run/step-100, /models/run/step-2*").sweep
    assert sweep.kind == "sweep"
    assert sweep.checkpoints == ("/models/run/step-100", "/models/run/step-2*")
    watch = body("--watch", "/models/run", "--poll_interval", "5", "--max_checkpoints", "3").sweep
    assert (watch.kind, watch.watch, watch.poll_s, watch.max_checkpoints) == (
        "watch",
        "/models/run",
        5.0,
        3,
    )
    with pytest.raises(ConfigError, match="--checkpoints and --watch"):
        body("--checkpoints", "/a", "--watch", "/b")
    with pytest.raises(ConfigError, match="poll_s"):
        body("--watch", "/b", "--poll_interval", "0")
