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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve``: one flag per ``Settings`` field, plus ``--log-level`` and ``--demo``."""
    from rayeval.api.cli.settings_flags import add_settings_flags
    from rayeval.api.settings import Settings

    serve = subparsers.add_parser(
        "serve",
        help="run the REST service (POST /evaluations, dashboard at /)",
        description="Run the rayeval REST service. Every server flag can also be set by the "
        "environment variable its help names (lists as JSON, e.g. "
        "RAYEVAL_INCLUDE_PATHS='[\"/srv/tasks\"]'); flags win.",
    )
    add_settings_flags(serve.add_argument_group("the server (rayeval.api.settings)"), Settings)
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
    from rayeval.api.cli.settings_flags import overrides
    from rayeval.api.settings import Settings

    given = overrides(args, Settings)
    demo_model = _prepare_demo(args, given) if args.demo else None
    settings = _settings(given)
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
