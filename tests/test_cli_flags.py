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


# ----------------------------------------------------------- one convention, clear refusals
def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What ``rayeval ARGV`` says when argparse refuses it (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        _parse(*argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``rayeval ARGV --help``, its lines joined (help texts wrap anywhere)."""
    with pytest.raises(SystemExit) as exited:
        _parse(*argv, "--help")
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_flag_takes_both_spellings() -> None:
    """lm-eval's underscores and the server's dashes, each accepted where the other is spelt;
    the Ray address as --address or --ray-address in run and serve alike."""
    run = _parse("run", "--model-args", "pretrained=/m", "--tasks", "t", "--num-replicas", "2",
                 "--output-path", "o", "--batch-size", "4", "--ray-address", "auto",
                 "--load-timeout", "5")  # fmt: skip
    assert run.model_args == {"pretrained": "/m"} and run.num_replicas == 2
    assert (run.output_path, run.batch_size, run.address, run.load_timeout) == ("o", "4", "auto", 5)
    assert _parse("run", "--model_args", "pretrained=/m", "--ray_address", "a").address == "a"
    serve = _parse("serve", "--data_dir", "d", "--no_response_cache", "--address", "h:6379",
                   "--include_path", "x", "--stall_timeout=3")  # fmt: skip
    assert (serve.data_dir, serve.response_cache, serve.ray_address) == ("d", False, "h:6379")
    assert serve.include_paths == ["x"] and serve.stall_timeout_s == 3.0
    assert _parse("users", "list", "--database_url", "sqlite://").database_url == "sqlite://"
    submit = _parse("submit", "--model-args", "pretrained=/m", "--tasks", "t",
                    "--watch", "/r", "--poll-interval", "5", "--max-checkpoints", "2")  # fmt: skip
    assert (submit.poll_interval, submit.max_checkpoints) == (5.0, 2)
    assert _parse("results", "x", "--output-path", "o").output_path == "o"
    assert _parse("watch", "d", "--model-args", "pretrained=/m", "--idle-timeout", "1").directory


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["run", "--model_args", "pretrained=/m", "--modle_args", "x"], "rayeval run",
         "--modle_args (did you mean --model_args?)"),
        (["run", "--tasks", "t", "--num_replcas", "2"], "rayeval run",
         "did you mean --num_replicas?"),
        (["status", "--wait"], "rayeval status", "--wait (did you mean --watch?)"),
        (["users", "list", "--data-dirs", "x"], "rayeval users list",
         "did you mean --data-dir?"),
        (["serve", "--include_paths", "x"], "rayeval serve", "did you mean --include-path?"),
    ],
)  # fmt: skip
def test_an_unknown_flag_is_refused_under_its_command_naming_the_nearest(
    argv: list[str], usage: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    said = _refused(capsys, *argv)
    assert said.startswith(f"usage: {usage}"), said
    assert f"{usage}: error: unrecognized arguments: " in said and hint in said


def test_run_help_offers_only_what_run_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    """No mps, no lm-eval example with a refused model, no server-only flag; both spellings and
    the opt-in to oversubscribe said; the three watches told apart."""
    shown = _help(capsys, "run")
    assert "mps" not in shown and "vllm" not in shown and "lm-eval run" not in shown
    assert "--device {auto,cpu,cuda}" in shown and "$ rayeval run --model_args" in shown
    assert "--priority" not in shown and "--preemptible" not in shown
    assert "--oversubscribe" in shown and "either spelling" in shown
    assert "auto (the default, as over REST" in shown  # --batch_size
    submit = _help(capsys, "submit")
    for refused in ("--use_cache", "--include_path", "--wandb_args", "--write_out"):
        assert refused not in submit, refused
    assert "--priority" in submit and "--device {auto,cpu,cuda}" in submit
    assert "rayeval status --watch" in submit  # its --wait
    assert "not `rayeval watch`" in _help(capsys, "status")
    watch = _help(capsys, "watch")
    assert "submit --watch DIR" in watch and "status --watch ID" in watch


@pytest.mark.parametrize(("flag", "value"), [("--priority", "3"), ("--preemptible", "true")])
def test_run_refuses_the_server_s_scheduling_flags_naming_submit(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["run"], ["watch", "dir"]):
        said = _refused(capsys, *command, "--model_args", "pretrained=/m", flag, value)
        assert f"{flag} orders evaluations in a server's queue" in said
        assert f"`rayeval submit ... {flag} {value}`" in said


def test_batch_size_defaults_to_auto_as_over_rest(tmp_path: Path) -> None:
    """One default on every door (the REST body's); a flag or a --config YAML sets another."""
    from rayeval.api.cli.evaluation_flags import config_from_args
    from rayeval.api.cli.remote import submission_body
    from rayeval.service.vocabulary.config import EvaluationConfig

    rest = EvaluationConfig.model_validate({"model_args": "pretrained=/m", "tasks": ["t"]})
    assert rest.batch_size == "auto"
    base = ["--model_args", "pretrained=/m", "--tasks", "t"]
    assert config_from_args(_parse("run", *base))[0].batch_size == rest.batch_size
    assert submission_body(_parse("submit", *base)).batch_size == rest.batch_size
    assert config_from_args(_parse("run", *base, "--batch_size", "4"))[0].batch_size == 4
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("batch_size: 8\n")
    assert config_from_args(_parse("run", *base, "--config", str(yaml_file)))[0].batch_size == 8


def test_confirmed_code_runs_in_the_sandbox_and_outside_it_only_with_a_second_flag() -> None:
    from rayeval.actors.errors import ConfigError
    from rayeval.api.cli.evaluation_flags import config_from_args
    from rayeval.service.vocabulary.config import CodeExecution

    base = ["--model_args", "pretrained=/m", "--tasks", "t"]
    assert config_from_args(_parse("run", *base))[1].code_execution is CodeExecution.OFF
    confirmed = [*base, "--confirm_run_unsafe_code"]
    host = config_from_args(_parse("run", *confirmed))[1]
    assert host.code_execution is CodeExecution.SANDBOX
    unsandboxed = [*confirmed, "--run_unsafe_code_unsandboxed"]
    assert config_from_args(_parse("run", *unsandboxed))[1].code_execution is CodeExecution.HOST
    with pytest.raises(ConfigError, match="needs --confirm_run_unsafe_code"):
        config_from_args(_parse("run", *base, "--run_unsafe_code_unsandboxed"))


# ------------------------------------------------------------ a layout this machine can hold
def _config(**parallelism: Any) -> Any:
    from rayeval.service.vocabulary.config import EvaluationConfig

    device = parallelism.pop("device", "auto")
    return EvaluationConfig.model_validate(
        {"model_args": "pretrained=/m", "tasks": ["t"], "device": device,
         "parallelism": parallelism}
    )  # fmt: skip


def test_a_layout_larger_than_the_machine_is_refused_with_the_server_s_rule() -> None:
    """The rule is ParallelLayout.check_fits, the server's; on a machine it names the cores,
    the fixes, and the opt-in that lifts it for CPU ranks only."""
    from rayeval.actors.errors import LayoutError
    from rayeval.service.engine.dispatch.cluster import check_machine

    two_cores = {"CPU": 2.0}
    check_machine(_config(num_replicas=2), two_cores)
    with pytest.raises(LayoutError) as refused:
        check_machine(_config(num_replicas=8, shard_size=4), two_cores)
    said = str(refused.value)
    assert "layout 8x4 (32 cpu ranks) needs more than this machine has" in said
    assert "32 CPU requested, 2 in this machine" in said
    assert "--num_replicas / --shard_size" in said and "--address" in said
    assert "--oversubscribe" in said
    with pytest.raises(LayoutError, match="4 CPU requested, 2 in this machine"):
        check_machine(_config(num_replicas=2, cpus_per_rank=2), two_cores)
    check_machine(_config(num_replicas=8, shard_size=4), two_cores, oversubscribe=True)


def test_gpu_ranks_on_a_machine_without_enough_gpus_are_refused_naming_the_device() -> None:
    from rayeval.actors.errors import LayoutError
    from rayeval.service.engine.dispatch.cluster import check_machine

    for oversubscribe in (False, True):  # GPUs are never oversubscribed
        with pytest.raises(LayoutError) as refused:
            check_machine(_config(device="cuda"), {"CPU": 8.0}, oversubscribe)
        said = str(refused.value)
        assert "1 GPU requested, 0 in this machine" in said
        assert "This machine has no GPU: run on the CPU with --device cpu" in said
        assert "--device auto" in said and "--num_replicas" not in said
    one_gpu = {"CPU": 8.0, "GPU": 1.0}
    check_machine(_config(), one_gpu)  # auto: the GPU
    with pytest.raises(LayoutError, match="2 GPU requested, 1 in this machine") as refused:
        check_machine(_config(num_replicas=2), one_gpu, oversubscribe=True)
    assert "--oversubscribe" not in str(refused.value)
    check_machine(_config(num_replicas=4, device="cpu"), {"CPU": 4.0, "GPU": 1.0})


def _rayeval_run(tmp_path: Path, *flags: str) -> tuple[int, str, float]:
    """``rayeval run`` in a fresh process (no Ray in it yet): (status, what it said, seconds)."""
    import os
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAYEVAL_LOG_DIR"] = str(tmp_path / "logs")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rayeval.api.cli", "run",
         "--model_args", "pretrained=/nonexistent/model", "--tasks", "demo_mc", *flags],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_rayeval_run_refuses_an_oversized_layout_before_ray_starts(tmp_path: Path) -> None:
    """8 x 64 CPU ranks is more than any machine here has: refused at once, nothing started."""
    status, said, seconds = _rayeval_run(tmp_path, "--num_replicas", "8", "--shard_size", "64")
    assert status == 2, said
    assert "rayeval run: error: layout 8x64 (512 cpu ranks) needs more than this machine" in said
    assert "--oversubscribe" in said and "Traceback" not in said
    assert "embedded Ray" not in said and seconds < 120
    log = next((tmp_path / "logs").glob("run-*.log")).read_text()
    assert "embedded Ray" not in log and "ray.init" not in log


def test_rayeval_run_device_cuda_without_a_gpu_names_the_cpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    status, said, _ = _rayeval_run(tmp_path, "--device", "cuda")
    assert status == 2, said
    assert "1 GPU requested, 0 in this machine" in said and "--device cpu" in said
    assert "embedded Ray" not in said
