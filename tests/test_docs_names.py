"""Every name of the project that docs/architecture.md gives exists in the code.

The page names modules (``model_shell.check_adapters``), classes and their methods
(``Engine.swap_adapter``), constants (``pipeline.SCORE_PART``) and files (``fsdp_loading.py``) in
backquotes. Each dotted name is resolved by importing the product: its head is a product module
(by its last part or parts) or a product class, and every further part an attribute. A name whose
head is not the project's (``lm_eval.simple_evaluate``, ``nn.Linear``, a state-dict key) must start
with one of :data:`OTHERS`; a file name must be a file of the repository.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
LAYERS = ("actors", "service", "api")
SOURCES = (*LAYERS, "tests", "benchmarks", "deploy")
#: File names: a ``.py`` must be the repository's; the others are a checkpoint's
#: (``config.json``, ``trainer_state.json``) or a task's.
FILE_SUFFIXES = ("py", "json", "md", "yaml", "jsonl", "toml", "mako")
#: Heads of names that belong to other projects, are state-dict keys or a REST body's field paths
#: (``parallelism.num_replicas``), left unresolved.
OTHERS = {
    "parallelism",
    "model_args",
    "lm_eval",
    "ray",
    "gc",
    "nn",
    "DTensor",
    "FSDPModule",
    "PeftModel",
    "PreTrainedModel",
    "PretrainedConfig",
    "EvaluatorConfig",
    "ALL_PARALLEL_STYLES",
    "base_model",
}


def _modules() -> dict[str, str]:
    """Every product module's dotted name (``rayeval.service.engine.plan.model_shell``) by each
    of its suffixes (``model_shell``, ``plan.model_shell``, ...)."""
    by_suffix: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            for start in range(len(parts)):
                suffix = ".".join(parts[start:])
                by_suffix.setdefault(suffix, set()).add("rayeval." + ".".join(parts))
    return {suffix: min(names) for suffix, names in by_suffix.items()}


def _classes(modules: dict[str, str]) -> dict[str, str]:
    """Every product class's module, by the class's name (read from the source: importing every
    module would run the migrations' environment)."""
    classes: dict[str, str] = {}
    for name in sorted(set(modules.values())):
        relative = name.removeprefix("rayeval.").replace(".", "/")
        path = REPO / f"{relative}.py"
        path = path if path.exists() else REPO / relative / "__init__.py"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, name)
    return classes


def _resolves(name: str, modules: dict[str, str], classes: dict[str, str]) -> bool:
    parts = name.removeprefix("rayeval.").split(".")
    for cut in range(len(parts), 0, -1):  # the longest head that is a product module
        head = ".".join(parts[:cut])
        if head in modules:
            found: Any = importlib.import_module(modules[head])
            rest = parts[cut:]
            break
    else:
        if parts[0] not in classes:
            return False
        found, rest = getattr(importlib.import_module(classes[parts[0]]), parts[0]), parts[1:]
    for part in rest:
        if not hasattr(found, part):
            return _annotated(found, part)
        found = getattr(found, part)
    return True


def _annotated(owner: Any, part: str) -> bool:
    """A dataclass or pydantic field, or an attribute set in ``__init__`` (not on the class)."""
    if not inspect.isclass(owner):
        return False
    if part in getattr(owner, "__annotations__", {}) or part in getattr(owner, "model_fields", {}):
        return True
    init = getattr(owner, "__init__", None)
    try:
        source = inspect.getsource(init) if init is not None else ""
    except (OSError, TypeError):
        return False
    return f"self.{part} " in source or f"self.{part}:" in source


def test_every_name_the_architecture_page_gives_exists() -> None:
    text = PAGE.read_text()
    modules = _modules()
    classes = _classes(modules)
    missing = []
    for name in sorted(set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", text))):
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES:
            if parts[-1] == "py" and not any(
                any((REPO / folder).rglob(f"{parts[-2]}.py")) for folder in SOURCES
            ):
                missing.append(name)
        elif parts[0] not in OTHERS and not _resolves(name, modules, classes):
            missing.append(name)
    assert missing == [], f"docs/architecture.md names what the code does not have: {missing}"
