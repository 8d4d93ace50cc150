"""The installed distribution: the three folders under one ``rayeval`` namespace, none left out."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_installs_under_rayeval() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    assert set(folders) == {"rayeval.actors", "rayeval.api", "rayeval.service"}
    found = {
        ".".join(["rayeval", *init.parent.relative_to(REPO).parts])
        for folder in folders.values()
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == found


def test_the_license_is_an_spdx_expression() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
