"""The tests mirror the layers (docs/architecture.md, "Tests"): every test module lives in
the folder of a layer, every test folder is a package (two ``test_x.py`` in different folders
stay two modules), a test imports another test module only from its own folder — what
tests share is in ``tests/helpers`` — and no test bounds a wall-clock time by a bare number
(issue 51: ``tests.helpers.within``, ten times the time measured idle)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from tests.helpers import TESTS

LAYERS = ("architecture", "checks", "cli", "core", "repro")


def python_files(tests: Path) -> list[Path]:
    """The Python files under ``tests`` (the data's generators aside)."""
    files = (p for p in tests.rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(p for p in files if p.relative_to(tests).parts[0] not in ("data", "golden"))


def misplaced(tests: Path) -> list[str]:
    """Test modules outside the layers' folders."""
    return [
        str(p.relative_to(tests))
        for p in python_files(tests)
        if p.name.startswith("test_") and p.relative_to(tests).parts[0] not in LAYERS
    ]


def not_packages(tests: Path) -> list[str]:
    """Folders of Python files without an ``__init__.py``."""
    folders = {p.parent for p in python_files(tests)}
    return sorted(str(f.relative_to(tests.parent)) for f in folders if not (f / "__init__.py").exists())


def cross_imports(tests: Path) -> list[str]:
    """``module -> imported`` for every import of a ``tests.`` module that is neither in
    ``tests.helpers`` nor in the importing module's own folder."""
    found = []
    for path in python_files(tests):
        own = ".".join(path.relative_to(tests.parent).parent.parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tests":
                names = [f"tests.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                shared = name == "tests.helpers" or name.startswith("tests.helpers.")
                if name.startswith("tests.") and not shared and own not in (name, name.rpartition(".")[0]):
                    found.append(f"{path.relative_to(tests.parent)} -> {name}")
    return found


#: Names that hold a measured wall-clock time in the tests.
TIMED = ("took", "seconds", "elapsed", "monotonic", "perf_counter")


def _is_timing(node: ast.expr) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in TIMED) or (isinstance(n, ast.Attribute) and n.attr in TIMED)
        for n in ast.walk(node)
    )


def literal_time_bounds(tests: Path) -> list[str]:
    """``file:line`` of every assert that bounds a measured time by a number literal
    (``assert took < 3``): a bound is ``within(idle_s=…)``, ten times what was measured idle."""
    found = []
    for path in python_files(tests):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Assert):
                continue
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                for (left, right), op in zip(itertools.pairwise(sides), cmp.ops, strict=True):
                    upper = isinstance(op, (ast.Lt, ast.LtE)) and _is_timing(left)
                    if upper and isinstance(right, ast.Constant) and isinstance(right.value, (int, float)):
                        found.append(f"{path.relative_to(tests.parent)}:{node.lineno}")
    return found


def test_every_test_module_is_in_a_layer_folder() -> None:
    assert misplaced(TESTS) == [], f"move these into tests/{{{','.join(LAYERS)}}}/ (docs/architecture.md)"


def test_every_test_folder_is_a_package() -> None:
    assert not_packages(TESTS) == []


def test_tests_share_only_through_helpers() -> None:
    assert cross_imports(TESTS) == []


def test_the_checks_see_a_flat_layout_and_a_cross_import(tmp_path: Path) -> None:
    """The old layout (test files at the top of tests/, one importing another) is refused."""
    tests = tmp_path / "tests"
    (tests / "helpers").mkdir(parents=True)
    (tests / "core" / "hw").mkdir(parents=True)
    for init in ("__init__.py", "helpers/__init__.py", "core/__init__.py"):
        (tests / init).write_text("")
    (tests / "test_nvml.py").write_text("from tests.helpers import NVML\n")
    (tests / "core" / "hw" / "test_machine.py").write_text("from tests.test_nvml import backend\n")
    assert misplaced(tests) == ["test_nvml.py"]
    assert not_packages(tests) == ["tests/core/hw"]
    assert cross_imports(tests) == ["tests/core/hw/test_machine.py -> tests.test_nvml"]


def test_no_wall_clock_bound_is_a_bare_number() -> None:
    assert literal_time_bounds(TESTS) == [], "bound these with tests.helpers.within(idle_s=…)"


def test_the_time_bound_check_sees_a_bare_number_and_passes_within(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "def test():\n"
        "    assert took < 3, took\n"
        "    assert 3 <= time.monotonic() - start < 60\n"
        "    assert took < within(idle_s=0.3) and seconds >= 1\n"
        "    assert len(rows) < 3\n"
    )
    assert literal_time_bounds(tests) == ["tests/test_a.py:2", "tests/test_a.py:3"]
