"""``rayeval serve``: the REST service (see :mod:`rayeval.api.app`) under uvicorn.

Flags override ``RAYEVAL_*`` environment variables (see :mod:`rayeval.api.settings`); with
``--demo`` the bundled tiny model and tasks are built if missing, served, and one demo evaluation
is submitted once the server is up and followed to its end (:mod:`rayeval.api.cli.demo`). A demo
server keeps the console for the demo's lines and rayeval's warnings, the rest going to a log file
(:mod:`rayeval.api.cli.console`; ``--verbose`` shows everything); a server without ``--demo``
logs everything on standard error, as services are expected to.
"""

from __future__ import annotations

import argparse
import logging
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
        "--verbose",
        action="store_true",
        help="with --demo: show every log line and Ray's worker output on the console (by default "
        "they go to a log file under .rayeval/logs, whose path is printed first)",
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
    from rayeval.api.cli.console import console
    from rayeval.api.cli.settings_flags import overrides
    from rayeval.api.settings import Settings

    given = overrides(args, Settings)
    # The demo narrates its evaluation; rayeval's own lines below a warning would interleave.
    with console(
        "serve", verbose=args.verbose or not args.demo, product_level=logging.WARNING
    ) as shown:
        demo_model = _prepare_demo(args, given, shown.out) if args.demo else None
        settings = _settings(given, shown.err)
        if settings is None:
            return 2
        _serve(settings, args, demo_model, shown)
    return 0


def _serve(settings: Any, args: argparse.Namespace, demo_model: str | None, shown: Any) -> None:
    """uvicorn until interrupted, with the demo's submitter beside it."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from rayeval.api.app import create_app
    from rayeval.api.cli.demo import submit_demo

    logging.getLogger().setLevel(args.log_level.upper())
    if demo_model is not None:
        threading.Thread(
            target=submit_demo,
            args=(settings, demo_model, shown),
            name="rayeval-demo",
            daemon=True,
        ).start()
    # Open SSE streams must not hold a shutdown for long: clients resume with Last-Event-ID.
    # Under the clean console uvicorn's loggers go where every library's go (no config of its).
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        log_config=LOGGING_CONFIG if shown.log_file is None else None,
        timeout_graceful_shutdown=5,
    )


def _prepare_demo(args: argparse.Namespace, overrides: dict[str, Any], out: Any) -> str:
    """Build the demo assets if missing and add them to what the server may use; the model."""
    from pathlib import Path

    from rayeval.service.demo import ensure_demo_assets

    print("rayeval demo: the bundled tiny model and tasks (built once if missing)", file=out)
    assets = ensure_demo_assets(Path(args.demo_dir) if args.demo_dir else None)
    # demo_code runs model-written code: refused (naming the setting) unless the server runs
    # with --allow-code-execution, then in the sandbox.
    tasks = [str(assets.tasks_dir), str(assets.code_tasks_dir)]
    overrides["include_paths"] = [*(args.include_paths or []), *tasks]
    overrides["model_roots"] = [*(args.model_roots or []), str(assets.model_dir)]
    return str(assets.model_dir)


def _settings(overrides: dict[str, Any], err: Any) -> Any:
    """``Settings`` from the flags given and the environment; None (said on ``err``) if
    refused."""
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
        print(f"rayeval serve: error: {problems}", file=err)
        return None
