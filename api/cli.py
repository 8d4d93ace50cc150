"""The ``rayeval`` command line.

``rayeval run`` takes lm-eval's own ``run`` flags — its parser is reused, so every flag means what
it means in ``lm_eval`` — plus the layout and Ray options. It is also the entrypoint for
``ray job submit``: inside a Ray job, ``RAY_ADDRESS`` is set and the job's cluster is used.
``rayeval serve`` runs the REST service (see ``rayeval.api.app``); ``rayeval submit`` takes
``run``'s flags and sends the evaluation to a server instead, and ``rayeval status/results/cancel``
follow it there (:mod:`rayeval.api.client`), with progress bars.
Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import enum
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    """The ``rayeval`` parser: ``run`` with lm-eval's flags plus the layout, and ``serve``."""
    from lm_eval._cli.run import Run

    parser = argparse.ArgumentParser(
        prog="rayeval",
        description="Distributed lm-evaluation-harness on Ray, with FSDP2-sharded models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = Run.create(subparsers)._parser
    run.prog = "rayeval run"
    run.usage = (
        "rayeval run --model hf --model_args pretrained=PATH_OR_ID --tasks TASKS "
        "[--num_replicas R] [--shard_size G] [lm-eval options]"
    )
    _add_config_flags(run.add_argument_group("rayeval layout, batching and timeouts"))
    run.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)",
    )
    _add_serve_parser(subparsers)
    _add_client_parsers(subparsers)
    return parser


class _Renamed:
    """Hands lm-eval's ``Run`` a subparsers object that names its parser ``name``."""

    def __init__(self, subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> None:
        self._subparsers = subparsers
        self._name = name
        self._kwargs = kwargs

    def add_parser(self, _name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._subparsers.add_parser(
            self._name, **{**kwargs, **self._kwargs}
        )
        return parser


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument(
        "--url",
        default=os.environ.get("RAYEVAL_URL", "http://127.0.0.1:8000"),
        help="the rayeval server (default: $RAYEVAL_URL, else http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="the server's API token (default: $RAYEVAL_API_TOKEN; prefer the variable: command "
        "lines are visible to other users)",
    )


def _add_client_parsers(subparsers: argparse._SubParsersAction) -> None:
    """``submit``, ``status``, ``results`` and ``cancel``: the REST service from the shell."""
    from lm_eval._cli.run import Run

    submit = Run.create(
        _Renamed(
            subparsers,
            "submit",
            help="send an evaluation to a rayeval server (rayeval run's flags)",
            description="Submit an evaluation to a rayeval server: the flags of `rayeval run` "
            "(task directories and models are the server's). With --wait, follow it with "
            "progress bars, print lm-eval's table, and write lm-eval's files to --output_path.",
            usage="rayeval submit --model_args pretrained=SERVER_PATH_OR_ID --tasks TASKS "
            "[--num_replicas R] [--shard_size G] [--wait] [--url URL] [lm-eval options]",
            epilog=None,
        )  # type: ignore[arg-type]
    )._parser
    submit.prog = "rayeval submit"
    _add_config_flags(submit.add_argument_group("rayeval layout, batching and timeouts"))
    remote = submit.add_argument_group("the server")
    _add_server_flags(remote)  # type: ignore[arg-type]
    remote.add_argument(
        "--wait", action="store_true", help="follow the evaluation until it ends (progress bars)"
    )
    status = subparsers.add_parser(
        "status", help="list evaluations on a server, or show one (--watch: progress bars)"
    )
    status.add_argument("id", nargs="?", help="an evaluation id (none: list the newest)")
    status.add_argument("--watch", action="store_true", help="follow it until it ends")
    _add_server_flags(status)
    results = subparsers.add_parser(
        "results", help="print a finished evaluation's results, or write lm-eval's files"
    )
    results.add_argument("id", help="the evaluation id")
    results.add_argument(
        "--output_path",
        default=None,
        help="write lm-eval's results file (and samples files) under this directory",
    )
    results.add_argument("--json", action="store_true", help="print the results JSON itself")
    _add_server_flags(results)
    cancel = subparsers.add_parser("cancel", help="cancel an evaluation on a server")
    cancel.add_argument("id", help="the evaluation id")
    _add_server_flags(cancel)


def _add_config_flags(group: argparse._ArgumentGroup) -> None:
    """rayeval's own ``run`` flags, one per config field lm-eval has no flag for: name, type,
    default and help all come from :class:`rayeval.service.config.EvaluationConfig`."""

    from rayeval.service.config import RAYEVAL_FLAGS, field_info

    for path, flag in RAYEVAL_FLAGS.items():
        info = field_info(path)
        default = info.get_default(call_default_factory=True)
        choices = None
        kind: Callable[[str], Any]
        if isinstance(info.annotation, type) and issubclass(info.annotation, enum.Enum):
            kind = str
            choices = [member.value for member in info.annotation]
            default = default.value
        else:
            kind = (
                _parse_bool
                if isinstance(default, bool)
                else float
                if path[0] == "timeouts"
                else int
            )
        group.add_argument(
            flag,
            dest=_dest(path),
            type=kind,
            default=default,
            choices=choices,
            metavar="{" + ",".join(choices) + "}"
            if choices
            else "BOOL"
            if kind is _parse_bool
            else "S"
            if kind is float
            else "N",
            help=info.description
            if "default" in info.description
            else f"{info.description.rstrip('.')} (default {default}).",
        )


def _parse_bool(text: str) -> bool:
    """A boolean flag's value: true/false (also 1/0, yes/no)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _dest(path: Sequence[str]) -> str:
    """The namespace attribute of a rayeval flag: its name (``num_replicas``, ...)."""
    from rayeval.service.config import RAYEVAL_FLAGS

    return RAYEVAL_FLAGS[tuple(path)].removeprefix("--")


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """``rayeval serve``: flags override ``RAYEVAL_*`` environment variables (see api.settings)."""
    serve = subparsers.add_parser(
        "serve",
        help="run the REST service (POST /evaluations, dashboard at /)",
        description="Run the rayeval REST service. Every flag can also be set by an environment "
        "variable RAYEVAL_<NAME> (e.g. RAYEVAL_API_TOKEN); flags win.",
    )
    serve.add_argument(
        "--host", help="address to listen on (default 127.0.0.1; others need --api-token)"
    )
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument(
        "--data-dir",
        dest="data_dir",
        metavar="DIR",
        help="where the SQLite database lives (default ./rayeval-data)",
    )
    serve.add_argument(
        "--database-url",
        dest="database_url",
        metavar="URL",
        help="any SQLAlchemy URL instead of the SQLite file under --data-dir",
    )
    serve.add_argument(
        "--include-path",
        dest="include_paths",
        action="append",
        metavar="DIR",
        help="directory of lm-eval task YAMLs that evaluations may use (repeatable)",
    )
    serve.add_argument(
        "--model-root",
        dest="model_roots",
        action="append",
        metavar="DIR",
        help="directory under which requests may name local models and tokenizers (repeatable; "
        "none: hub ids only)",
    )
    serve.add_argument(
        "--allow-remote-code",
        dest="allow_remote_code",
        action="store_true",
        default=None,
        help="let requests set trust_remote_code (runs model repositories' Python on the "
        "cluster as this server's user)",
    )
    serve.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="HOST",
        help="Host header accepted without an API token besides loopback names (repeatable)",
    )
    serve.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        type=float,
        metavar="S",
        help="fail an evaluation that makes no progress for this long (default 1800)",
    )
    serve.add_argument(
        "--warm-replicas",
        dest="warm_replicas",
        type=int,
        metavar="N",
        help="keep up to N runners loaded after their evaluation succeeds, for the next "
        "evaluation of the same model and layout (default 0)",
    )
    serve.add_argument(
        "--api-token",
        dest="api_token",
        metavar="TOKEN",
        help="bearer token every endpoint but /healthz requires (prefer RAYEVAL_API_TOKEN: "
        "command lines are visible to other users)",
    )
    serve.add_argument(
        "--ray-address",
        dest="ray_address",
        metavar="ADDRESS",
        help="existing Ray cluster (default: $RAY_ADDRESS, else an embedded local Ray)",
    )
    serve.add_argument(
        "--num-cpus",
        dest="num_cpus",
        type=int,
        metavar="N",
        help="logical CPUs of the embedded Ray (default: the machine's cores)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--demo",
        action="store_true",
        help="build the bundled tiny model and demo tasks if missing, serve them, and submit a "
        "demo evaluation once the server is up (what `make run` does)",
    )
    serve.add_argument(
        "--demo-dir",
        dest="demo_dir",
        metavar="DIR",
        help="where --demo builds its assets (default: $RAYEVAL_DEMO_DIR or .rayeval/demo)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rayeval`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "run":
        return _run(args)
    if args.command == "serve":
        return _serve(args)
    if args.command in ("submit", "status", "results", "cancel"):
        from rayeval.api import remote

        return remote.main(args, _config_from_args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rayeval.api.settings import Settings

    flags = (
        "host",
        "port",
        "data_dir",
        "database_url",
        "include_paths",
        "model_roots",
        "allow_remote_code",
        "allowed_hosts",
        "stall_timeout_s",
        "warm_replicas",
        "api_token",
        "ray_address",
        "num_cpus",
    )
    overrides = {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}
    demo_model = None
    if args.demo:
        from pathlib import Path

        from rayeval.service.demo import ensure_demo_assets

        assets = ensure_demo_assets(Path(args.demo_dir) if args.demo_dir else None)
        demo_model = str(assets.model_dir)
        overrides["include_paths"] = [*(args.include_paths or []), str(assets.tasks_dir)]
        overrides["model_roots"] = [*(args.model_roots or []), str(assets.model_dir)]
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        print(f"rayeval serve: error: {problems}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(args.log_level.upper())

    import uvicorn

    from rayeval.api.app import create_app

    if demo_model is not None:
        threading.Thread(
            target=_submit_demo, args=(settings, demo_model), name="rayeval-demo", daemon=True
        ).start()
    # Open SSE streams must not hold a shutdown for long: clients resume with Last-Event-ID.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def _submit_demo(settings: Any, model_dir: str, ready_timeout_s: float = 300.0) -> None:
    """Once the server answers, submit the bundled demo evaluation and say where to look."""
    import time

    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base = f"http://{host}:{settings.port}"
    token = settings.api_token.get_secret_value() if settings.api_token else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        print(
            f"rayeval serve --demo: the server did not answer at {base} within "
            f"{ready_timeout_s:g}s; the demo evaluation was not submitted",
            file=sys.stderr,
        )
        return
    body = {
        "model": "hf",
        "model_args": {"pretrained": model_dir, "dtype": "float32"},
        "tasks": ["demo"],
        "batch_size": "auto",
        "log_samples": True,
        "parallelism": {"num_replicas": 2, "shard_size": 1},
    }
    response = httpx.post(f"{base}/evaluations", json=body, headers=headers, timeout=120)
    if response.status_code != 202:
        print(
            f"rayeval serve --demo: submitting failed ({response.status_code}): {response.text}",
            file=sys.stderr,
        )
        return
    evaluation = response.json()["id"]
    auth = ' -H "Authorization: Bearer $RAYEVAL_API_TOKEN"' if token else ""
    print(
        f"\nrayeval demo: evaluation {evaluation} submitted (bundled tiny model, tasks: demo, "
        f"layout 2x1).\n"
        f"  dashboard:   {base}/\n"
        f"  status:      curl{auth} {base}/evaluations/{evaluation}\n"
        f"  live events: curl -N{auth} {base}/evaluations/{evaluation}/events\n"
        f"  results:     curl{auth} {base}/evaluations/{evaluation}/results\n"
        f"  API docs:    {base}/docs\n"
        "Stop the server with Ctrl-C.\n",
        flush=True,
    )


def _run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lm-eval's bootstrap would fork a pool from this Ray driver's threads; single-process gives
    # the same numbers (see service.jobs.manager).
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    from lm_eval.utils import make_table

    from rayeval.actors.errors import RayEvalError
    from rayeval.service.engine.runner import run_evaluation

    try:
        config, host = _config_from_args(args)
        output = run_evaluation(config, host)
    except (RayEvalError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rayeval run: error: {exc}", file=sys.stderr)
        return 2

    if output is None:
        return 0
    results = output.results
    if host.lm_eval.get("show_config"):  # as `lm_eval run --show_config`: the whole results JSON
        import json

        from lm_eval.utils import handle_non_serializable

        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    batch_sizes = ",".join(map(str, results["config"].get("batch_sizes", [])))
    layout = config.parallelism
    print(
        f"{config.model} ({config.model_args}), gen_kwargs: ({config.gen_kwargs}), "
        f"limit: {config.limit}, num_fewshot: {config.num_fewshot}, "
        f"batch_size: {config.batch_size}{f' ({batch_sizes})' if batch_sizes else ''}, "
        f"layout: {layout.num_replicas}x{layout.shard_size}"
        + (f" ({layout.placement})" if layout.placement != "auto" else "")
    )
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    for phase, stats in output.stats.items():
        print(
            f"{phase}: {stats['requests']} requests computed in {stats['micro_batches']} "
            f"micro-batches ({stats['cached']} answered from the cache), "
            f"{stats['tokens_per_s']:,.0f} tokens/s, "
            f"real-token fraction {stats['real_token_fraction']:.3f}, replica utilisation "
            + ", ".join(f"r{r}={u:.0%}" for r, u in stats["replica_utilisation"].items())
        )
    if output.ranks:
        print(
            "ranks: "
            + "; ".join(
                f"r{rank['replica']}.s{rank['shard_rank']} on {rank['ip']} "
                f"(node {rank['node_id'][:8]}, pid {rank['pid']})"
                for rank in output.ranks
            )
        )
    return 0


def _config_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """The evaluation's config and the host options from ``rayeval run``'s flags.

    lm-eval's flags are read exactly as ``lm_eval run`` reads them (its precedence: flags over
    ``--config`` YAML over its defaults, then its own validation); rayeval's flags come from the
    config's fields. Errors name the flag.

    Raises:
        ConfigError: naming each bad flag.
    """
    from dataclasses import asdict

    from lm_eval.config.evaluate_config import EvaluatorConfig
    from pydantic import ValidationError

    from rayeval.actors.errors import ConfigError
    from rayeval.service.config import (
        LM_EVAL_HOST_FIELDS,
        RAYEVAL_FLAGS,
        EvaluationConfig,
        HostOptions,
        cli_flag,
        describe_errors,
    )

    ours = {path: getattr(args, _dest(path)) for path in RAYEVAL_FLAGS}
    rayeval_only = {_dest(path) for path in RAYEVAL_FLAGS} | {"address"}
    given = {k: v for k, v in vars(args).items() if k not in rayeval_only}
    given["device"] = given.get("device") or "auto"  # lm-eval would default to cuda
    # lm-eval's own precedence, as its EvaluatorConfig.from_cli applies it.
    values = asdict(EvaluatorConfig())
    if given.get("config"):
        values.update(EvaluatorConfig.load_yaml_config(given["config"]))
    values.update(
        {k: v for k, v in given.items() if (v or v == 0) and k not in ("command", "func")}
    )
    values.pop("config", None)
    metadata = dict(values["metadata"] or {})  # before lm-eval merges model_args into it
    cfg = EvaluatorConfig(**values)._configure()

    data: dict[str, Any] = {
        name: getattr(cfg, name)
        for name in EvaluationConfig.model_fields
        if hasattr(cfg, name) and name not in ("metadata", "parallelism", "timeouts")
    }
    data["metadata"] = metadata
    for path, value in ours.items():
        target = data
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    try:
        config = EvaluationConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, cli_flag)) from None
    host = HostOptions(
        output_path=cfg.output_path,
        include_paths=tuple(_as_list(cfg.include_path)),
        address=args.address,
        lm_eval={name: getattr(cfg, name) for name in LM_EVAL_HOST_FIELDS},
    )
    return config, host


def _as_list(value: Any) -> list[str]:
    if not value:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]


if __name__ == "__main__":
    sys.exit(main())
