""" "Did you mean": the known names nearest to one that is not known, said the same way by every
door (a task name over REST and on the command line). No torch here."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(name: str, known: Iterable[str], n: int = 3, cutoff: float = 0.75) -> list[str]:
    """Up to ``n`` names of ``known`` close to ``name``, closest first (``difflib``'s ratio of at
    least ``cutoff``)."""
    return difflib.get_close_matches(name, list(known), n=n, cutoff=cutoff)


def unknown_name(name: str, known: Iterable[str]) -> str:
    """``'name'``, with ``(did you mean a, b?)`` when some known names are close to it."""
    close = nearest(name, known)
    return f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
