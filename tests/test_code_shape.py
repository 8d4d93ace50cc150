"""The shape issue 25 asked for, kept: no product module over 450 lines, no function over 60.

A declarative table is module-level data, not a long function; a long module is split by job
(docs/architecture.md says where things go). Ruff's complexity rules (pyproject.toml) keep
branching in check; these two limits are lines, which ruff does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("actors", "api", "service")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(path for folder in PRODUCT for path in (REPO / folder).rglob("*.py"))


def test_no_product_module_is_over_450_lines() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for path in _modules()
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by job: {long}"


def test_no_product_function_is_over_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert long == {}, f"split these into named steps: {long}"
