"""Progress of long work: shown on a terminal only, never in piped output."""

from __future__ import annotations

import io

from gpudiag import progress
from gpudiag.checks.gradcheck import gradcheck
from tests.helpers import models


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_run_is_noted() -> None:
    x, y = models.batch(8)
    seen: list[str] = []
    with progress.listening(seen.append):
        gradcheck(models.mlp, x, y, strategies=("single", "dp", "ddp"))
    assert seen == ["gradcheck: as-is single", "gradcheck: as-is dp", "gradcheck: as-is ddp (2 ranks)"]


def test_progress_is_shown_on_a_terminal_only() -> None:
    screen = Terminal()
    with progress.shown(screen):
        progress.note("gradcheck: as-is dp")
    assert "gradcheck: as-is dp …" in screen.getvalue()
    piped = io.StringIO()
    with progress.shown(piped):
        progress.note("not shown")
    assert piped.getvalue() == ""
    progress.note("nobody is listening: nothing happens")
