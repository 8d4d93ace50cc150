"""The ``rayeval`` parser's class: both spellings of every flag, and "did you mean" for a flag
that no spelling names.

rayeval's commands come from two traditions: ``run``, ``submit``, ``watch`` and ``results`` take
lm-eval's flags, spelt with underscores (``--model_args``, ``--output_path``), and ``serve`` and
``users`` take the server's settings, spelt with dashes (``--data-dir``, ``--include-path``).
Every command accepts both spellings of each of its flags (``--model-args``, ``--data_dir``), and
the Ray address under either name (``--address``, ``--ray-address``); the help shows one. A flag
that matches nothing is refused under its own command's usage, naming the nearest flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rayeval.service.vocabulary.nearest import nearest

#: Flags that name the same thing in different commands: ``run``'s ``--address`` is ``serve``'s
#: ``--ray-address``.
SYNONYMS = {"--address": "--ray-address", "--ray-address": "--address"}
#: Said in every command's help.
SPELLINGS_NOTE = (
    "Every flag takes either spelling: --model_args or --model-args, --data-dir or --data_dir."
)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags take both spellings and whose unknown flags get a
    suggestion (its subcommands' parsers are of this class too)."""

    def _parse_optional(self, arg_string: str) -> Any:
        return super()._parse_optional(self._spelling(arg_string))

    def _spelling(self, arg_string: str) -> str:
        """``arg_string`` with its flag spelt as this parser spells it (unchanged if unknown)."""
        if not arg_string.startswith("--") or arg_string == "--":
            return arg_string
        flag, eq, value = arg_string.partition("=")
        known = self._option_string_actions
        if flag in known:
            return arg_string
        spellings = [flag, _swapped(flag)]
        synonyms = [SYNONYMS[name] for name in spellings if name in SYNONYMS]
        for other in [*spellings, *synonyms, *map(_swapped, synonyms)]:
            if other in known:
                return other + eq + value
        return arg_string

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but an unrecognized argument is refused by the (sub)command that was
        given it, under that command's usage, with the nearest flag it has."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = chosen_parser(self, parsed)
            command.error(unrecognized(command, extras))
        return parsed


def _swapped(flag: str) -> str:
    """``--model_args`` for ``--model-args`` and the reverse (``--a_b-c``: both swapped)."""
    if not flag.startswith("--"):
        return ""
    body = flag[2:]
    if "_" in body:
        return "--" + body.replace("_", "-")
    if "-" in body:
        return "--" + body.replace("-", "_")
    return ""


def _canonical(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def leaves(parser: argparse.ArgumentParser) -> list[Any]:
    """The parsers of every command without subcommands under ``parser`` (``users add`` ...)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += leaves(sub)
    return found or [parser]


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The innermost parser of the (sub)commands ``args`` chose (``parser`` if none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


def nearest_flag(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The flag of ``parser`` nearest to ``flag`` (either spelling), or None when none is near."""
    flags = {
        _canonical(option): option
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--")
    }
    wanted = _canonical(flag.partition("=")[0])
    close = nearest(wanted, flags, n=1, cutoff=0.6)
    return flags[close[0]] if close else None


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message, with the nearest flag of each unknown one."""
    hints = []
    for extra in extras:
        near = nearest_flag(parser, extra) if extra.startswith("-") else None
        hints.append(f"{extra} (did you mean {near}?)" if near else extra)
    return "unrecognized arguments: " + " ".join(hints)
