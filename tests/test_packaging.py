"""The installed distribution: the three folders under one ``rayeval`` namespace, none left out.

Every folder with an ``__init__.py`` is a package; so is every folder of data files (the
dashboard's static files, the demo's data, the migrations' versions), declared with its files in
``package-data`` (setuptools installs a folder only as a package, and warns of one it finds
otherwise)."""

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
    data = set(setuptools["package-data"]) - found
    for name in data:  # a folder of data files, each declared file pattern matching some
        folder = REPO / Path(*name.split(".")[1:])
        patterns = setuptools["package-data"][name]
        assert folder.is_dir() and all(any(folder.glob(p)) for p in patterns), name
    assert set(setuptools["packages"]) == found | data


def test_the_license_is_an_spdx_expression() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
