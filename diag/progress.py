"""Progress of long work, on standard error and only on a terminal.

Checks say what they start with :func:`note` (``"gradcheck: ddp (as-is)"``); nothing is
shown unless a front end asked for it with :func:`shown` — the CLI does, for commands
that train. A spinner line (rich's ``status``) is redrawn in place on a terminal; piped
or in a library call, :func:`note` does nothing, so scripts and golden files never see it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

_show: Callable[[str], None] | None = None


def note(text: str) -> None:
    """Say what starts now (one short line), if anyone is showing progress."""
    if _show is not None:
        _show(text)


@contextlib.contextmanager
def listening(show: Callable[[str], None]) -> Iterator[None]:
    """Call ``show(text)`` for every :func:`note` while the block runs."""
    global _show
    previous, _show = _show, show
    try:
        yield
    finally:
        _show = previous


@contextlib.contextmanager
def shown(stream: TextIO | None = None) -> Iterator[None]:
    """Show :func:`note` lines on ``stream`` (standard error) while the block runs, when it
    is a terminal: one line redrawn in place, gone when the block ends."""
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        yield
        return
    from rich.console import Console

    status = Console(file=stream, highlight=False).status("starting …")
    with status, listening(lambda text: status.update(f"{text} …")):
        yield
