"""``rayeval serve``'s flags, generated from the fields of :class:`rayeval.api.settings.Settings`.

One flag per field, as ``rayeval run``'s own flags come from the evaluation's configuration: the
flag's type, help text, default shown and environment variable all come from the field, and its
value (when given) lands under the field's name. A flag is spelt ``--`` + the field's name with
``-`` for ``_`` and without a seconds suffix ``_s`` (``stall_timeout_s``: ``--stall-timeout``);
a field spelt otherwise says so beside itself, in ``json_schema_extra={"flag": ...}`` (list
fields take one item per flag, repeated, so their flags are singular: ``--include-path``), where
``"metavar"`` may name its value too.

A flag not given stays None, so the environment variable (``RAYEVAL_<FIELD>``) or the field's
default decides; a flag given wins over both.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

#: Field types a flag's text converts to (a secret, a path: the text as given).
_SCALARS: dict[Any, Callable[[str], Any]] = {
    str: str,
    int: int,
    float: float,
    Path: str,
    SecretStr: str,
}


def add_settings_flags(
    parser: argparse._ActionsContainer,
    settings: type[BaseModel],
    only: Collection[str] | None = None,
) -> None:
    """Add one flag per field of ``settings`` to ``parser`` (``dest``: the field's name).

    Args:
        parser: ``rayeval serve``'s parser (or an argument group of it).
        settings: The settings class (:class:`rayeval.api.settings.Settings`).
        only: These fields only (``rayeval users``: where the database is); None: all.

    Raises:
        TypeError: naming a field whose type has no flag form (give it one of the types
            in ``_SCALARS``, bool, a list of those, an Enum or a Literal).
    """
    prefix = str(settings.model_config.get("env_prefix", ""))
    for name, field in settings.model_fields.items():
        if only is not None and name not in only:
            continue
        parser.add_argument(
            flag_of(name, field),
            dest=name,
            default=None,
            help=_help(field, f"{prefix}{name}".upper()),
            **_kind(name, field),
        )


def flag_of(name: str, field: FieldInfo) -> str:
    """The flag that sets the field ``name``: its ``json_schema_extra["flag"]``, else derived."""
    given = _extra(field).get("flag")
    return str(given) if given else "--" + name.removesuffix("_s").replace("_", "-")


def overrides(args: argparse.Namespace, settings: type[BaseModel]) -> dict[str, Any]:
    """The fields the command line set: field name -> value, for flags given only.

    Args:
        args: The parsed command line (from a parser :func:`add_settings_flags` filled).
        settings: The settings class.

    Returns:
        Keyword arguments for ``settings(...)``; what is absent the environment decides.
    """
    return {
        name: getattr(args, name)
        for name in settings.model_fields
        if getattr(args, name, None) is not None
    }


def default_text(field: FieldInfo) -> str:
    """How a field's default reads in its flag's help (``none`` for None or an empty list)."""
    default = field.get_default(call_default_factory=True)
    if default is None or default == []:
        return "none"
    return str(default.value if isinstance(default, enum.Enum) else default)


def _help(field: FieldInfo, env: str) -> str:
    """The field's description, its default (unless the description says it) and its variable;
    ``%`` escaped for argparse."""
    description = (field.description or "").rstrip(".")
    repeat = "repeatable; " if _list_item(field.annotation) is not None else ""
    default = "" if "default" in description else f"default: {default_text(field)}; "
    return f"{description} ({repeat}{default}env {env}).".replace("%", "%%")


def _kind(name: str, field: FieldInfo) -> dict[str, Any]:
    """``add_argument``'s action, type, choices and metavar for the field's type."""
    annotation = _without_none(field.annotation)
    metavar = _extra(field).get("metavar")
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    item = _list_item(annotation)
    if item is not None:
        return {"action": "append", **_scalar(name, item, metavar, flag_of(name, field))}
    return _scalar(name, annotation, metavar, flag_of(name, field))


def _scalar(name: str, kind: Any, metavar: Any, flag: str) -> dict[str, Any]:
    """``type``/``choices``/``metavar`` for one value of type ``kind``."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return {"type": str, "choices": [str(member.value) for member in kind]}
    if typing.get_origin(kind) is typing.Literal:
        return {"type": str, "choices": [str(value) for value in typing.get_args(kind)]}
    if kind not in _SCALARS:
        raise TypeError(
            f"Settings.{name}: type {kind!r} has no `rayeval serve` flag form; use one of "
            f"{sorted(t.__name__ for t in _SCALARS)}, bool, a list of those, an Enum or a Literal"
        )
    default_metavar = {int: "N", float: "S"}.get(kind, flag.rsplit("-", 1)[-1].upper())
    return {"type": _SCALARS[kind], "metavar": metavar or default_metavar}


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None`` (a flag either gives a value or is absent)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _list_item(annotation: Any) -> Any:
    """The item type of ``list[X]`` (``X | None`` allowed around it), else None."""
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) in (list, tuple, set, frozenset):
        (item, *_) = typing.get_args(annotation) or (str,)
        return item
    return None


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}
