"""The import direction of the product, read from its source (every import, those inside
functions included; only ``if TYPE_CHECKING:`` blocks, which never run, are left out):

* ``api -> service -> actors``: nothing in ``actors/`` imports ``service`` or ``api``, nothing in
  ``service/`` imports ``api``;
* ``api`` never imports torch (the API process and the CLI start without it);
* only ``api`` speaks HTTP (a web framework, a server or an HTTP client);
* no import cycle between product modules, not even one held apart by an import inside a
  function;
* the product and ``deploy/`` (what an operator runs) import nothing from ``tests/``.

Complexity is ruff's (C901, PLR0912, PLR0915 in ``make lint``), not a line count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("api", "service", "actors")  # each may import only those after it
HTTP = {"fastapi", "starlette", "uvicorn", "httpx", "requests", "aiohttp", "urllib.request"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "rayeval." + ".".join(parts)


def _product() -> dict[str, Path]:
    return {_module_name(path): path for folder in LAYERS for path in (REPO / folder).rglob("*.py")}


def _imports(node: ast.AST) -> Iterator[str]:
    """Every module name an import statement in ``node`` names (``from a import b`` gives ``a``
    and ``a.b``), outside ``if TYPE_CHECKING:`` blocks."""
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        for child in node.orelse:
            yield from _imports(child)
        return
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
        yield node.module
        yield from (f"{node.module}.{alias.name}" for alias in node.names)
    for child in ast.iter_child_nodes(node):
        yield from _imports(child)


def _graph() -> dict[str, set[str]]:
    return {name: set(_imports(ast.parse(path.read_text()))) for name, path in _product().items()}


def test_imports_go_from_api_to_service_to_actors() -> None:
    wrong = []
    for name, imported in _graph().items():
        layer = name.split(".")[1]
        below = LAYERS[LAYERS.index(layer) :]
        for target in imported:
            parts = target.split(".")
            if parts[0] == "rayeval" and len(parts) > 1 and parts[1] not in below:
                wrong.append(f"{name} imports {target}")
    assert wrong == [], wrong


def test_api_never_imports_torch_and_only_api_speaks_http() -> None:
    wrong = []
    for name, imported in _graph().items():
        roots = {target.split(".")[0] for target in imported}
        if name.startswith("rayeval.api") and roots & {"torch", "transformers"}:
            wrong.append(f"{name} imports {sorted(roots & {'torch', 'transformers'})}")
        http = {t for t in imported if t.split(".")[0] in HTTP or t.startswith("urllib.request")}
        if not name.startswith("rayeval.api") and http:
            wrong.append(f"{name} speaks HTTP ({sorted(http)})")
    assert wrong == [], wrong


def test_nothing_shipped_imports_the_tests() -> None:
    shipped = [*_product().values(), *(REPO / "deploy").rglob("*.py")]
    wrong = [
        f"{path.relative_to(REPO)} imports {target}"
        for path in shipped
        for target in _imports(ast.parse(path.read_text()))
        if target == "tests" or target.startswith("tests.")
    ]
    assert wrong == [], wrong


def test_no_import_cycle_between_product_modules() -> None:
    graph = _graph()
    edges = {
        name: {t for t in imported if t in graph and t != name} for name, imported in graph.items()
    }
    cycles = _cycles(edges)
    assert cycles == [], cycles


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_checks_see_a_cycle_and_a_wrong_direction(tmp_path: Path) -> None:
    # The checks above pass on the tree; here they fail where they must.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rayeval.api import app\n"
        "def f():\n    from rayeval.service.vocabulary.config import X\n"
    )
    assert set(_imports(ast.parse(source))) == {
        "typing",
        "typing.TYPE_CHECKING",
        "rayeval.service.vocabulary.config",
        "rayeval.service.vocabulary.config.X",
    }
