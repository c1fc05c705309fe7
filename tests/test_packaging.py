"""What ``pip install .`` ships: every package folder of the source tree is listed in
pyproject.toml (a package left out installs without error and fails on import — as
``gpudiag.checks.gradcheck`` did), and the bundled examples are package data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
ROOT = Path(__file__).resolve().parents[1]


def setuptools_table() -> Any:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed() -> None:
    setuptools = setuptools_table()
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert found == listed, f"not listed: {sorted(found - listed)}; listed, absent: {sorted(listed - found)}"


def test_bundled_examples_are_package_data() -> None:
    data = setuptools_table()["package-data"]["gpudiag"]
    for example in (ROOT / "diag" / "examples").iterdir():
        assert any(example.match(pattern) for pattern in data), example.name
