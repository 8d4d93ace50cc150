"""The evaluation configuration's fields as each door names them: REST paths and CLI flags.

A pydantic error location becomes the dotted REST name (:func:`field_path`) or the ``rayeval run``
flag (:func:`cli_flag`), so an error names the field in the words of whoever made it, and so do
the fields its message names (:mod:`rayeval.service.vocabulary.doors`). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ValidationError

from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import Timeouts
from rayeval.service.vocabulary.config import _GROUPS, EngineConfig, EvaluationConfig
from rayeval.service.vocabulary.doors import RAYEVAL_FLAGS, Door, cli_flag, render

__all__ = [  # the flags' table and cli_flag live in .doors; read here too, as before
    "OTHER_DOORS",
    "RAYEVAL_FLAGS",
    "cli_flag",
    "config_field_paths",
    "config_from_keywords",
    "describe_errors",
    "field_info",
    "field_path",
]

#: Config fields that ``rayeval run`` does not set with a flag of their own name, and their doors:
#: a checkpoint sweep is ``--checkpoints`` (``run``, ``submit``) or a watch (``rayeval watch``,
#: ``submit --watch``).
OTHER_DOORS: dict[tuple[str, ...], tuple[str, ...]] = {("sweep",): ("--checkpoints",)}


def field_path(loc: Sequence[Any]) -> tuple[str, ...]:
    """A pydantic error location as a config field path (list indices and dict keys dropped)."""
    path: list[str] = []
    model: type[BaseModel] | None = EvaluationConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        path.append(part)
        annotation = model.model_fields[part].annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return tuple(path)


def config_field_paths() -> list[tuple[str, ...]]:
    """Every leaf field of :class:`EvaluationConfig`, nested groups expanded."""
    paths: list[tuple[str, ...]] = []
    for name, info in EvaluationConfig.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += [(name, sub) for sub in annotation.model_fields]
        else:
            paths.append((name,))
    return paths


def field_info(path: Sequence[str]) -> Any:
    """Pydantic's ``FieldInfo`` of the field at ``path`` (default, description, bounds)."""
    model: type[BaseModel] = EvaluationConfig
    for part in path[:-1]:
        annotation = model.model_fields[part].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model.model_fields[path[-1]]


def describe_errors(exc: Any, name: Any, door: Door = Door.CLI) -> str:
    """A pydantic ``ValidationError`` as one message, each field named by ``name(path)`` and the
    fields its messages name in ``door``'s words."""
    problems = []
    for error in exc.errors():
        path = field_path(error.get("loc", ()))
        message = render(str(error.get("msg", "")).removeprefix("Value error, "), door)
        where = name(path) if path else "options"
        if error.get("type") == "extra_forbidden":
            problems.append(f"unknown option {'.'.join(map(str, error['loc']))!r}")
        elif error.get("type", "").startswith(("greater", "less")):
            problems.append(f"{where}: {message}, got {error.get('input')!r}")
        else:
            problems.append(f"{where}: {message}")
    return "; ".join(dict.fromkeys(problems))


def config_from_keywords(pretrained: str, **options: Any) -> EngineConfig:
    """The engine configuration of the Python API's keywords (``RayEvalLM(...)``, lm-eval's
    ``model="rayeval"``): :class:`EngineConfig`'s fields, the layout's and the timeouts' fields
    given flat (``num_replicas=2``, ``step_s=60``), and lm-eval HF model args for the rest.

    Raises:
        ConfigError: naming every bad keyword.
    """
    data: dict[str, Any] = {"model_args": {"pretrained": pretrained}}
    flat: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
    for key, value in options.items():
        group = next((g for g, model in _GROUPS.items() if key in model.model_fields), None)
        if key in EngineConfig.model_fields and key != "model_args":
            data[key] = value
        elif group is not None:
            flat[group][key] = value
        else:
            data["model_args"][key] = value
    for group, values in flat.items():  # flat keys refine a group given whole
        if values:
            whole = data.get(group) or {}
            if isinstance(whole, Timeouts):
                whole = asdict(whole)
            elif isinstance(whole, BaseModel):
                whole = whole.model_dump()
            data[group] = {**whole, **values}
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, lambda path: path[-1], Door.PYTHON)) from None
