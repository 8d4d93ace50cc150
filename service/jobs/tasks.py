"""Which lm-eval task names the service accepts: the server's include paths plus lm-eval's own.

Scanning the server's ``--include-path`` directories is fast and done when the catalog is built.
lm-eval's built-in index (~15k tasks) takes many seconds to scan, so it is built once per process,
in a child process started in the background (the scan is pure Python and would otherwise hold the
API's GIL), and never per request. A request whose tasks are all found under the include paths
never waits for it. ``python -m service.jobs.tasks`` prints the built-in names as JSON (the child's
job). A glob pattern that matches a group or tag together with other names is refused: lm-eval
would meet the group's tasks twice and stop at run time. No torch here.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from rayeval.actors.errors import ConfigError
from rayeval.service.vocabulary.errors import ServiceNotReadyError
from rayeval.service.vocabulary.nearest import unknown_name

logger = logging.getLogger(__name__)

#: How long the background scan of lm-eval's built-in tasks may take before it counts as failed.
BUILTIN_SCAN_TIMEOUT_S = 900.0


class IndexState(StrEnum):
    """Progress of the background scan of lm-eval's built-in task index."""

    NOT_STARTED = "not_started"
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


class _BuiltinIndex:
    """lm-eval's built-in task names, scanned once per process in a child process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._state = IndexState.NOT_STARTED
        self._names: frozenset[str] = frozenset()
        self._collections: frozenset[str] = frozenset()
        self.unsafe: dict[str, str] = {}
        self._error = ""

    @property
    def state(self) -> IndexState:
        return self._state

    def start(self) -> None:
        """Start the scan unless it already started (idempotent, returns at once)."""
        with self._lock:
            if self._state is not IndexState.NOT_STARTED:
                return
            self._state = IndexState.BUILDING
        threading.Thread(target=self._scan, name="rayeval-task-index", daemon=True).start()

    def collections_if_ready(self) -> tuple[frozenset[str], frozenset[str]]:
        """The built-in names and which of them are groups or tags, if the scan is done (else
        empty: never waits)."""
        if self._state is not IndexState.READY:
            return frozenset(), frozenset()
        return self._names, self._collections

    def names(self, wait_s: float) -> frozenset[str]:
        """The built-in names, waiting at most ``wait_s`` for the scan.

        Raises:
            ServiceNotReadyError: the scan is still running after ``wait_s``, or it failed.
        """
        self.start()
        if not self._done.wait(timeout=wait_s):
            raise ServiceNotReadyError(
                "lm-eval's task index is still being built (once, at server start): retry in a "
                "few seconds, or use tasks from the server's include paths"
            )
        if self._state is IndexState.FAILED:
            raise ServiceNotReadyError(
                f"lm-eval's task index could not be built ({self._error}): check the server log; "
                "only tasks under the server's include paths can be checked meanwhile"
            )
        return self._names

    def _scan(self) -> None:
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "rayeval.service.jobs.tasks"],
                capture_output=True,
                text=True,
                timeout=BUILTIN_SCAN_TIMEOUT_S,
                check=True,
            )
            scanned = json.loads(done.stdout)
            self._names = frozenset(scanned["names"])
            self._collections = frozenset(scanned["collections"])
            self.unsafe = dict(scanned["unsafe"])
            self._state = IndexState.READY
            logger.info(
                "lm-eval task index ready: %d names in %.1fs",
                len(self._names),
                time.monotonic() - started,
            )
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            stderr = getattr(exc, "stderr", None) or ""
            self._error = f"{type(exc).__name__}: {str(exc)[:200]} {stderr[-500:]}".strip()
            self._state = IndexState.FAILED
            logger.error("building lm-eval's task index failed: %s", self._error)
        finally:
            self._done.set()


#: One scan per process: the built-in index depends only on the installed lm-eval.
_BUILTIN = _BuiltinIndex()


class TaskCatalog:
    """Task names an evaluation may use: the include paths' tasks plus lm-eval's built-in ones.

    Args:
        include_paths: The server's task directories (scanned now; fast).
    """

    def __init__(self, include_paths: Sequence[str] = ()) -> None:
        self.include_paths = tuple(str(p) for p in include_paths)
        self._local, self._collections, self._unsafe = _scan_include_paths(self.include_paths)

    @property
    def builtin_state(self) -> IndexState:
        """Where the background scan of lm-eval's built-in index is."""
        return _BUILTIN.state

    def start_builtin_index(self) -> None:
        """Begin scanning lm-eval's built-in index in the background (once per process)."""
        _BUILTIN.start()

    def check(self, names: Sequence[str], wait_s: float, field: str = "tasks") -> None:
        """Refuse names that match no task, group or tag.

        Args:
            names: Task names or glob patterns.
            wait_s: How long to wait for lm-eval's built-in index if a name is not local.
            field: The request field the names come from (named in the error).

        Raises:
            ConfigError: naming every unknown task, with close matches.
            ServiceNotReadyError: the built-in index is needed but not ready within ``wait_s``.
        """
        from lm_eval.utils import pattern_match

        self._refuse_overlapping_patterns(names, field)
        missing = [n for n in names if not pattern_match([n], self._local)]
        if not missing:
            return
        builtin = sorted(_BUILTIN.names(wait_s))
        unknown = [n for n in missing if not pattern_match([n], builtin)]
        if not unknown:
            return
        everything = [*self._local, *builtin]
        hints = [unknown_name(name, everything) for name in unknown]
        where = (
            f" or under the server's include paths {list(self.include_paths)}"
            if (self.include_paths)
            else ""
        )
        raise ConfigError(
            f"{field}: unknown tasks: {'; '.join(hints)}. Use task, group or tag names that "
            f"lm-eval knows (`lm_eval ls tasks`){where}; the server operator adds task "
            "directories with "
            "--include-path"
        )

    def code_tasks(self, names: Sequence[str], wait_s: float) -> dict[str, str]:
        """The names (or the names a pattern matches) whose tasks run model-written code,
        each with how (:data:`CODE_EVAL` or :data:`OTHER_CODE`). Call after :meth:`check`.

        Raises:
            ServiceNotReadyError: the built-in index is needed but not ready within ``wait_s``.
        """
        from lm_eval.utils import pattern_match

        unsafe = dict(self._unsafe)
        if any(not pattern_match([n], self._local) for n in names):
            _BUILTIN.names(wait_s)
            unsafe = {**_BUILTIN.unsafe, **unsafe}
        matched = pattern_match(list(names), sorted(unsafe))
        return {name: unsafe[name] for name in sorted(matched)}

    def _refuse_overlapping_patterns(self, names: Sequence[str], field: str) -> None:
        """Refuse a glob pattern that matches a group or tag together with other names: lm-eval
        would meet the group's tasks twice and stop ("Duplicate task ...: found in both")."""
        from lm_eval.utils import pattern_match

        builtin, builtin_collections = _BUILTIN.collections_if_ready()
        everything = sorted({*self._local, *builtin})
        collections = self._collections | builtin_collections
        for pattern in (n for n in names if any(c in n for c in "*?[")):
            matched = pattern_match([pattern], everything)
            overlapping = sorted(set(matched) & collections)
            if overlapping and len(matched) > 1:
                raise ConfigError(
                    f"{field}: {pattern!r} matches the groups or tags {overlapping[:5]} together "
                    f"with {len(matched) - len(overlapping)} other names, so lm-eval would meet "
                    "a task both alone and in its group and stop ('Duplicate task'): name the "
                    "groups, or the tasks, you want, or a narrower pattern"
                )


def _scan_include_paths(
    include_paths: tuple[str, ...],
) -> tuple[list[str], frozenset[str], dict[str, str]]:
    """Every task, group and tag name under the include paths, which are groups or tags, and
    which run model-written code (:func:`unsafe_names`)."""
    if not include_paths:
        return [], frozenset(), {}
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False, include_path=list(include_paths))
    collections = frozenset([*manager.all_groups, *manager.all_tags])
    return sorted(manager.all_tasks), collections, unsafe_names(manager)


#: How an unsafe task's scoring runs model-written code: through HF evaluate's ``code_eval``
#: (which rayeval runs in its sandbox), or otherwise (cruxeval's own guard, longproc's g++ and
#: ``eval``), which rayeval does not run at all.
CODE_EVAL, OTHER_CODE = "code_eval", "other"


def other_code_refusal(names: Sequence[str]) -> str:
    """Why tasks that run code other than through ``code_eval`` (:data:`OTHER_CODE`) are
    refused: rayeval's sandbox runs code_eval's candidates only."""
    return (
        f"tasks: {sorted(names)} run model-written code outside HF evaluate's code_eval "
        "(cruxeval's own exec guard, longproc's g++ and eval), which rayeval does not sandbox"
    )


def unsafe_names(manager: Any, names: Sequence[str] | None = None) -> dict[str, str]:
    """The task, group and tag names of ``manager`` whose resolved config (its ``include``s
    followed, functions not imported) or any member's sets ``unsafe_code``, each with how it
    runs code (:data:`CODE_EVAL` where every such task loads ``code_eval``, else
    :data:`OTHER_CODE`); only among ``names`` where given."""
    from lm_eval.tasks._index import Kind

    index = manager.task_index
    memo: dict[str, str | None] = {}

    def unsafe(name: str, seen: frozenset[str]) -> str | None:
        if name not in memo:
            entry = index.get(name)
            if entry is None or name in seen:
                return None
            if entry.kind in (Kind.TASK, Kind.PY_TASK):
                memo[name] = _task_code(entry)
            else:
                members = entry.tags if entry.kind == Kind.TAG else _group_members(entry.cfg)
                kinds = {unsafe(m, seen | {name}) for m in members} - {None}
                memo[name] = (OTHER_CODE if OTHER_CODE in kinds else CODE_EVAL) if kinds else None
        return memo[name]

    found = {name: unsafe(name, frozenset()) for name in (index if names is None else names)}
    return {name: kind for name, kind in sorted(found.items()) if kind is not None}


def _task_code(entry: Any) -> str | None:
    """How one task runs model-written code, or None where its config is safe."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if entry.yaml_path is None:
        return None
    try:
        config = load_yaml(entry.yaml_path, resolve_func=False)
    except (OSError, ValueError, yaml.YAMLError):
        config = entry.cfg or {}
    if not config.get("unsafe_code"):
        return None
    folder = Path(entry.yaml_path).parent
    loads_code_eval = any(
        'load("code_eval")' in p.read_text(errors="replace") for p in folder.glob("*.py")
    )
    return CODE_EVAL if loads_code_eval else OTHER_CODE


def _group_members(config: dict[str, Any] | None) -> list[str]:
    """The names a group's ``task`` list refers to (an inline config by its ``task`` name)."""
    members = (config or {}).get("task") or []
    names = []
    for spec in members if isinstance(members, list) else [members]:
        if isinstance(spec, dict):
            spec = spec.get("task") or spec.get("group")
        if isinstance(spec, str):
            names.append(spec)
    return names


def _print_builtin_names() -> None:
    """Scan lm-eval's built-in index and print its names (and which are groups or tags) as JSON
    on stdout: ``{"names": [...], "collections": [...]}``."""
    logging.disable(logging.WARNING)  # lm-eval warns about every odd YAML
    out, sys.stdout = sys.stdout, sys.stderr  # whatever the scan prints must not corrupt the JSON
    from lm_eval.tasks import TaskManager

    manager = TaskManager()
    names = sorted(manager.all_tasks)
    collections = sorted({*manager.all_groups, *manager.all_tags})
    unsafe = unsafe_names(manager)
    sys.stdout = out
    json.dump({"names": names, "collections": collections, "unsafe": unsafe}, sys.stdout)


#: The scan's OS niceness: it is background work, and it runs as a (re)started server begins to
#: answer requests. In issue 41's soak each API restart's scan took about 6 s of CPU (wall 80 s
#: on the shared 2-core machine) beside the server's status reads.
SCAN_NICENESS = 10


if __name__ == "__main__":
    os.nice(SCAN_NICENESS)
    _print_builtin_names()
