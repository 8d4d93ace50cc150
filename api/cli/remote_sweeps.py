"""Checkpoint sweeps and watches through the REST service: ``rayeval submit --checkpoints`` or
``--watch``, and ``rayeval results ID`` for one.

The paths are the server's: it expands the globs under its model roots when it accepts the
evaluation. ``rayeval results`` prints the sweep's table (a row per metric, a column per step) and,
with ``--output_path``, writes what ``rayeval run --checkpoints`` writes locally: each
checkpoint's lm-eval files under ``OUT/<label>/<model>/`` and ``OUT/sweep.json``, so ``rayeval
results OUT`` reads it back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError
from rayeval.api.client import RayEvalClient

#: ``submit`` flags of a sweep (not lm-eval's, not the evaluation config's own flags).
SWEEP_FLAGS = ("checkpoints", "watch", "poll_interval", "max_checkpoints", "idle_timeout")


def add_remote_sweep_flags(group: Any) -> None:
    """``--checkpoints``, ``--watch`` and a watch's polling and stopping flags."""
    group.add_argument(
        "--checkpoints",
        default=None,
        metavar="A,B,C|GLOB",
        help="a checkpoint sweep on the server: its checkpoint directories (DCP, safetensors "
        "or LoRA adapters over pretrained=) "
        "under its model roots, comma-separated, or a glob such as /models/run/step-* (expanded "
        "by the server, sorted by step); --model_args pretrained= names the config and tokenizer",
    )
    group.add_argument(
        "--watch",
        default=None,
        metavar="DIR",
        help="watch a training run's checkpoint folder on the server: evaluate each complete "
        "checkpoint that is or appears there, until cancelled, --max_checkpoints or "
        "--idle_timeout",
    )
    group.add_argument(
        "--poll_interval",
        type=float,
        default=30.0,
        metavar="S",
        help="with --watch: seconds between two looks at DIR (default 30)",
    )
    group.add_argument(
        "--max_checkpoints",
        type=int,
        default=None,
        metavar="N",
        help="with --watch: end after evaluating N checkpoints",
    )
    group.add_argument(
        "--idle_timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --watch: end after S seconds without a new checkpoint",
    )


def with_sweep(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with the sweep ``args`` name (unchanged if they name none).

    Raises:
        ConfigError: both ``--checkpoints`` and ``--watch``, or a bad watch setting.
    """
    from pydantic import ValidationError

    from rayeval.service.vocabulary.config_groups import SweepSpec

    given = vars(args)
    if given.get("checkpoints") and given.get("watch"):
        raise ConfigError("--checkpoints and --watch: give one (a list, or a folder to watch)")
    if given.get("checkpoints"):
        items = [item.strip() for item in str(given["checkpoints"]).split(",") if item.strip()]
        data: dict[str, Any] = {"checkpoints": items}
    elif given.get("watch"):
        data = {
            "watch": given["watch"],
            "poll_s": given.get("poll_interval", 30.0),
            "max_checkpoints": given.get("max_checkpoints"),
            "timeout_s": given.get("idle_timeout"),
        }
    else:
        return config
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"the sweep's flags: {problems}") from None
    return config.model_copy(update={"sweep": spec})


def sweep_results(
    client: RayEvalClient, evaluation_id: str, output_path: str | None, as_json: bool
) -> int:
    """Print a sweep's table (or its JSON) and write its files under ``output_path``.

    Returns:
        0; 1 when a checkpoint was refused or failed.
    """
    summary = client.sweep(evaluation_id)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(client.sweep_table(evaluation_id), end="")
    if output_path:
        print(f"wrote {write_sweep_files(client, summary, Path(output_path))}")
    bad = [c for c in summary["checkpoints"] if c["status"] in ("refused", "failed")]
    return 1 if bad else 0


def write_sweep_files(client: RayEvalClient, summary: dict[str, Any], out: Path) -> Path:
    """Each checkpoint's lm-eval files under ``out/<label>/<model>/`` and ``out/sweep.json``, as
    ``rayeval run --checkpoints`` writes them; returns the summary file."""
    from rayeval.service.result_files import write_lm_eval_files

    records = []
    for record in summary["checkpoints"]:
        links = record.pop("links", None)
        if links is not None:
            samples = {task: client.text(url) for task, url in links["samples"].items()}
            text = client.text(links["results"])
            results_file = write_lm_eval_files(out / record["label"], text, samples)
            record["results_file"] = str(results_file.relative_to(out))
        records.append(record)
    path = out / "sweep.json"
    path.write_text(json.dumps({**summary, "checkpoints": records}, indent=2), encoding="utf-8")
    return path
