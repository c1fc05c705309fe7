"""docs/architecture.md is checked: every module it names exists, every module of the
package is named (in the trees of its code blocks), and every sub-package is in its table."""

from __future__ import annotations

import re

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "architecture.md"
FOLDERS = ("diag", "checks", "repro")
#: A tree line: indentation, then a module (``name.py``) or a folder (``name/``), then text.
ENTRY = re.compile(r"^( *)([A-Za-z0-9_]+(?:/[A-Za-z0-9_]+)*(?:\.py|/))(?:\s|$)")


def named_in_trees(text: str) -> set[str]:
    """The paths the page's code blocks name, folders followed down by indentation
    (``diag/`` then ``  hw/`` then ``    nvml.py`` is ``diag/hw/nvml.py``)."""
    named = set()
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        stack: list[tuple[int, str]] = []
        for line in block.splitlines():
            match = ENTRY.match(line)
            if not match:
                continue
            indent, name = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = "".join(folder for _, folder in stack) + name
            if name.endswith("/"):
                stack.append((indent, name))
            named.add(path)
    return named


def modules() -> set[str]:
    return {
        str(path.relative_to(ROOT))
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_the_parser_follows_folders_by_indentation() -> None:
    text = "```\ndiag/\n  hw/\n    nvml.py   NVML\n  errors.py  errors\nrepro/sweep/\n  run.py\n```\n"
    assert named_in_trees(text) == {
        *("diag/", "diag/hw/", "diag/hw/nvml.py", "diag/errors.py"),
        *("repro/sweep/", "repro/sweep/run.py"),
    }


def test_every_module_the_page_names_exists() -> None:
    named = named_in_trees(PAGE.read_text())
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_named_on_the_page() -> None:
    named = named_in_trees(PAGE.read_text())
    unnamed = sorted(m for m in modules() if m not in named and not m.endswith("/__init__.py"))
    assert unnamed == [], f"modules docs/architecture.md does not name: {unnamed}"


def test_every_sub_package_is_in_the_table() -> None:
    text = PAGE.read_text()
    inits = [init for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")]
    packages = {str(init.parent.relative_to(ROOT)) for init in inits}
    rows = set(re.findall(r"^\| `[a-z_.]+` \| `([a-z_/]+)/` \|", text, re.M))
    assert sorted(packages - rows) == [], "sub-packages missing from the table of docs/architecture.md"


#: The most lines a source module may have (issue 32: a module that outgrows it has more
#: than one job — split it into collaborators).
MAX_LINES = 500


def test_no_source_module_is_over_the_line_limit() -> None:
    long = {m: n for m in sorted(modules()) if (n := len((ROOT / m).read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
