"""The doors an evaluation comes in by, and each door's words for a configuration field.

An error names a field once, by its REST path (:func:`rayeval.actors.errors.field`); the door
that answers words it: ``parallelism.num_replicas`` (a REST body's field), ``--num_replicas``
(``rayeval run``'s flag), ``num_replicas=`` (a Python keyword of ``RayEvalLM``). A suggested value
goes with it: ``"device": "cpu"``, ``--device cpu``, ``device='cpu'``. :data:`RAYEVAL_FLAGS` lists
the flags of the fields lm-eval's own parser does not have, from which ``rayeval run`` builds its
options. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from rayeval.actors.errors import RayEvalError, worded

#: ``rayeval run`` flags of the config fields that lm-eval's own parser does not have; every other
#: field has lm-eval's flag of the same name.
RAYEVAL_FLAGS: dict[tuple[str, ...], str] = {
    ("parallelism", "num_replicas"): "--num_replicas",
    ("parallelism", "shard_size"): "--shard_size",
    ("parallelism", "cpus_per_rank"): "--cpus_per_rank",
    ("parallelism", "shard_strategy"): "--shard_strategy",
    ("parallelism", "placement"): "--placement",
    ("parallelism", "shm_collectives"): "--shm_collectives",
    ("max_batch_tokens",): "--max_batch_tokens",
    ("share_prefixes",): "--share_prefixes",
    ("continuous_batching",): "--continuous_batching",
    ("kv_cache_tokens",): "--kv_cache_tokens",
    ("logits_budget_mib",): "--logits_budget_mib",
    ("tokenizer_workers",): "--tokenizer_workers",
    ("timeouts", "placement_s"): "--placement_timeout",
    ("timeouts", "load_s"): "--load_timeout",
    ("timeouts", "step_s"): "--step_timeout",
    ("timeouts", "collective_s"): "--collective_timeout",
    ("timeouts", "control_s"): "--control_timeout",
    ("timeouts", "reuse_s"): "--reuse_timeout",
    ("bootstrap_iters",): "--bootstrap_iters",
    ("scheduling", "priority"): "--priority",
    ("scheduling", "preemptible"): "--preemptible",
    ("tracking",): "--tracking",
}


def cli_flag(path: Sequence[str]) -> str:
    """The ``rayeval run`` flag that sets the config field at ``path``."""
    return RAYEVAL_FLAGS.get(tuple(path)) or f"--{path[0]}"


class Door(StrEnum):
    """Where an evaluation was asked for, so where an error is read."""

    REST = "rest"  # a JSON body (POST /evaluations)
    CLI = "cli"  # rayeval run / submit flags
    PYTHON = "python"  # RayEvalLM(...) keywords, lm-eval's model_args="...,num_replicas=2"


def field_words(path: tuple[str, ...], door: Door, value: str | None = None) -> str:
    """How ``door`` names the field at ``path`` (REST path), with ``value`` (JSON text) if any."""
    if door is Door.REST:
        if value is None:
            return ".".join(path)
        nested = value
        for part in reversed(path[1:]):
            nested = f'{{"{part}": {nested}}}'
        return f'"{path[0]}": {nested}'
    name = cli_flag(path) if door is Door.CLI else path[-1]
    if value is None:
        return name if door is Door.CLI else f"{name}="
    plain: Any = json.loads(value)
    if door is Door.PYTHON:
        return f"{name}={plain!r}"
    return f"{name} {plain if isinstance(plain, str) else value}"


def render(message: str | RayEvalError, door: Door) -> str:
    """An error's message (or a message with field marks) in ``door``'s words."""
    text = message.marked_message if isinstance(message, RayEvalError) else message
    return worded(text, lambda path, value: field_words(path, door, value))


def reword(error: RayEvalError, door: Door) -> RayEvalError:
    """``error`` itself, its message now in ``door``'s words (to re-raise it at that door)."""
    error.args = (render(error, door), *error.args[1:])
    return error
