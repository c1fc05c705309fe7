"""What ``pip install .`` ships: every package folder of the source tree is listed in
pyproject.toml (a package left out installs without error and fails on import — as
``gpudiag.checks.gradcheck`` did), and the bundled examples are package data."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)


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


def test_the_floor_make_test_floor_runs_on_is_pyprojects() -> None:
    """``torch>=X`` / ``torchvision>=Y`` in the dependencies are what ``make test-floor``
    pins: a floor is only claimed for versions the suite has run on (issue 14)."""
    import re

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(
        re.fullmatch(r"(torch|torchvision)>=([\d.]+)", d).groups() for d in deps if re.match(r"torch", d)
    )
    pins = re.search(r"^FLOOR_PINS\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pins, "Makefile: FLOOR_PINS missing"
    pinned = dict(pin.split("==") for pin in pins.group(1).split())
    assert set(pinned) == {"torch", "torchvision"} == set(floors)
    for name, floor in floors.items():
        pin = [int(part) for part in pinned[name].split(".")]
        assert pin == ([int(part) for part in floor.split(".")] + [0, 0])[: len(pin)], (
            f"{name}: floor {floor}, make test-floor pins {pinned[name]}"
        )


def test_installing_gpudiag_keeps_the_torch_this_environment_has(tmp_path: Any) -> None:
    """Issue 52: ``pip install .`` replaced a training environment's torch 2.6 with another
    CUDA build when the floor was 2.11. pip resolves gpudiag into this very environment (the
    floor torch under ``make test-floor``, what a fresh machine resolves under ``make test``)
    and would install gpudiag alone: torch, torchvision and the rest are left as they are."""
    import json
    import subprocess
    import sys

    report = tmp_path / "pip-report.json"
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
    if _builds_wheels_here():  # (else pip fetches setuptools into an isolated build: network)
        argv.append("--no-build-isolation")
    argv += ["--disable-pip-version-check", "--report", str(report), str(ROOT)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    installs = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert installs == ["gpudiag"], installs


def _builds_wheels_here() -> bool:
    """Whether this environment's setuptools can build gpudiag's wheel: 70.1 and newer have
    bdist_wheel built in, older ones need the ``wheel`` package beside them (a plain venv of
    Python 3.11 has setuptools 65 and no ``wheel``)."""
    from importlib import metadata

    try:
        version = tuple(int(p) for p in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    if version >= (70, 1):
        return True
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        return False
    return True
