"""The commands the README and docs show with the bundled examples run as shown from any
folder, not only the repository's root (the examples ship with the package and are found
by name). Runs that train on all 28 pairs of the 8-GPU example are marked slow."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import ROOT, invoke

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


INLINE = re.compile(r"`(gpudiag [^`\n]+)`")


def documented() -> list[str]:
    """Every `gpudiag …` command of a code block or an inline code span that names a
    bundled example (output lines, with their `·`, excluded)."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        lines = [line.split("  #")[0].strip() for block in FENCE.findall(text) for line in block.splitlines()]
        for line in [*lines, *INLINE.findall(text)]:
            if line.startswith("gpudiag ") and "examples/" in line and "·" not in line:
                found.append(line)
    return sorted(set(found))


def _slow(command: str) -> bool:
    return "nancheck" in command and "--pairs" not in command


COMMANDS = [pytest.param(c, marks=[pytest.mark.slow] if _slow(c) else []) for c in documented()]


def test_the_docs_show_commands_with_the_examples() -> None:
    assert len(COMMANDS) >= 4


@pytest.mark.parametrize("command", COMMANDS)
def test_a_documented_command_runs_from_any_folder(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(shlex.split(command)[1:])
    assert result.exit_code in (0, 1), result.output  # 1: the example injects a fault
    assert "internal error" not in result.output and "does not exist" not in result.output
