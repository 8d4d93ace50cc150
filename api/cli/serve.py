"""``rayeval serve``: the REST service (see :mod:`rayeval.api.app`) under uvicorn.

Flags override ``RAYEVAL_*`` environment variables (see :mod:`rayeval.api.settings`); with
``--demo`` the bundled tiny model and tasks are built if missing, served, and one demo evaluation
is submitted once the server is up (:mod:`rayeval.api.cli.demo`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import Any

#: The flags whose values override the environment (each named as its ``Settings`` field).
_SETTINGS_FLAGS = (
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve``: the server's settings as flags, plus ``--log-level`` and ``--demo``."""
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
    _add_cli_only_flags(serve)


def _add_cli_only_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of the command itself, not of the server's ``Settings``."""
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


def command(args: argparse.Namespace) -> int:
    """Serve until interrupted.

    Args:
        args: ``rayeval serve``'s parsed command line.

    Returns:
        The exit status: 0, or 2 when the settings are refused (the message names the fix).
    """
    overrides = {
        flag: getattr(args, flag) for flag in _SETTINGS_FLAGS if getattr(args, flag) is not None
    }
    demo_model = _prepare_demo(args, overrides) if args.demo else None
    settings = _settings(overrides)
    if settings is None:
        return 2
    logging.getLogger().setLevel(args.log_level.upper())

    import uvicorn

    from rayeval.api.app import create_app
    from rayeval.api.cli.demo import submit_demo

    if demo_model is not None:
        threading.Thread(
            target=submit_demo, args=(settings, demo_model), name="rayeval-demo", daemon=True
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


def _prepare_demo(args: argparse.Namespace, overrides: dict[str, Any]) -> str:
    """Build the demo assets if missing and add them to what the server may use; the model."""
    from pathlib import Path

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets(Path(args.demo_dir) if args.demo_dir else None)
    overrides["include_paths"] = [*(args.include_paths or []), str(assets.tasks_dir)]
    overrides["model_roots"] = [*(args.model_roots or []), str(assets.model_dir)]
    return str(assets.model_dir)


def _settings(overrides: dict[str, Any]) -> Any:
    """``Settings`` from the flags given and the environment; None (said on stderr) if refused."""
    from pydantic import ValidationError

    from rayeval.api.settings import Settings

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        print(f"rayeval serve: error: {problems}", file=sys.stderr)
        return None
