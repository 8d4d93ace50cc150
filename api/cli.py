"""The ``rayeval`` command line.

``rayeval run`` takes lm-eval's own ``run`` flags — its parser is reused, so every flag means what
it means in ``lm_eval`` — plus the layout and Ray options. It is also the entrypoint for
``ray job submit``: inside a Ray job, ``RAY_ADDRESS`` is set and the job's cluster is used.
``rayeval serve`` runs the REST service (see ``api.app``).
Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

#: Our flags on top of lm-eval's; they are removed before lm-eval's config sees the namespace.
_ENGINE_FLAGS = (
    "num_replicas",
    "shard_size",
    "address",
    "max_batch_tokens",
    "cpus_per_rank",
    "placement_timeout",
    "load_timeout",
    "step_timeout",
    "collective_timeout",
    "bootstrap_iters",
)


def build_parser() -> argparse.ArgumentParser:
    """The ``rayeval`` parser: ``run`` with lm-eval's flags plus the layout."""
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
    group = run.add_argument_group("rayeval layout and cluster")
    group.add_argument(
        "--num_replicas",
        type=int,
        default=1,
        metavar="R",
        help="data-parallel replicas of the model (default 1)",
    )
    group.add_argument(
        "--shard_size",
        type=int,
        default=1,
        metavar="G",
        help="ranks (GPUs) per replica; the model is FSDP2-sharded over them (default 1)",
    )
    group.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)",
    )
    group.add_argument(
        "--max_batch_tokens",
        type=int,
        default=None,
        help="padded tokens per micro-batch with --batch_size auto (default 8192)",
    )
    group.add_argument(
        "--cpus_per_rank",
        type=int,
        default=1,
        metavar="N",
        help="CPU slots per rank; on CPU-only clusters also torch's threads per rank (default 1)",
    )
    group.add_argument(
        "--placement_timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds to wait for the cluster to provide the layout's resources",
    )
    group.add_argument(
        "--load_timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds for every rank to load the model",
    )
    group.add_argument(
        "--step_timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds one batch may take on one replica before the run fails",
    )
    group.add_argument(
        "--collective_timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one collective may take inside a replica",
    )
    # lm-eval's simple_evaluate takes this, its 0.4.13 CLI has no flag for it.
    run.add_argument(
        "--bootstrap_iters",
        type=int,
        default=100000,
        metavar="N",
        help="bootstrap iterations for metric stderrs (0 skips them; lm-eval's default 100000)",
    )
    _add_serve_parser(subparsers)
    return parser


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
    return 2


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from api.settings import Settings

    flags = (
        "host",
        "port",
        "data_dir",
        "database_url",
        "include_paths",
        "api_token",
        "ray_address",
        "num_cpus",
    )
    overrides = {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}
    demo_model = None
    if args.demo:
        from pathlib import Path

        from service.demo import ensure_demo_assets

        assets = ensure_demo_assets(Path(args.demo_dir) if args.demo_dir else None)
        demo_model = str(assets.model_dir)
        overrides["include_paths"] = [*(args.include_paths or []), str(assets.tasks_dir)]
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

    from api.app import create_app

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
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import make_table

    from actors.errors import RayEvalError
    from actors.group import Timeouts
    from service.runner import EngineOptions, run_evaluation

    # lm-eval's config defaults the device to cuda; rayeval picks it from the cluster instead.
    args.device = args.device or "auto"
    engine_args = {flag: getattr(args, flag) for flag in _ENGINE_FLAGS}
    for flag in _ENGINE_FLAGS:
        delattr(args, flag)
    try:
        engine = EngineOptions(
            num_replicas=engine_args["num_replicas"],
            shard_size=engine_args["shard_size"],
            address=engine_args["address"],
            max_batch_tokens=engine_args["max_batch_tokens"],
            cpus_per_rank=engine_args["cpus_per_rank"],
            timeouts=Timeouts(
                placement_s=engine_args["placement_timeout"],
                load_s=engine_args["load_timeout"],
                step_s=engine_args["step_timeout"],
                collective_s=engine_args["collective_timeout"],
            ),
        )
        cfg = EvaluatorConfig.from_cli(args)
        output = run_evaluation(cfg, engine, bootstrap_iters=engine_args["bootstrap_iters"])
    except (RayEvalError, ValueError, FileNotFoundError) as exc:
        print(f"rayeval run: error: {exc}", file=sys.stderr)
        return 2
    if output is None:
        return 0
    results = output.results
    batch_sizes = ",".join(map(str, results["config"].get("batch_sizes", [])))
    print(
        f"{cfg.model} ({cfg.model_args}), gen_kwargs: ({cfg.gen_kwargs}), limit: {cfg.limit}, "
        f"num_fewshot: {cfg.num_fewshot}, batch_size: {cfg.batch_size}"
        f"{f' ({batch_sizes})' if batch_sizes else ''}, layout: "
        f"{engine.num_replicas}x{engine.shard_size}"
    )
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    for phase, stats in output.stats.items():
        print(
            f"{phase}: {stats['requests']} requests in {stats['micro_batches']} micro-batches, "
            f"{stats['tokens_per_s']:,.0f} tokens/s, "
            f"real-token fraction {stats['real_token_fraction']:.3f}, replica utilisation "
            + ", ".join(f"r{r}={u:.0%}" for r, u in stats["replica_utilisation"].items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
