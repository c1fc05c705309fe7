"""Live processes as /proc lists them, for tests that check nothing was left behind."""

from __future__ import annotations

import os
from pathlib import Path

#: Fields of /proc/<pid>/stat after the command name: 1 the parent's pid, 3 the session id.
PARENT, SESSION = 1, 3


def live_processes(field: int, value: int) -> list[int]:
    """Pids of the processes whose /proc stat ``field`` is ``value`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def children() -> list[int]:
    """This process's live children."""
    return live_processes(PARENT, os.getpid())


def session_processes(sid: int) -> list[int]:
    """Every process still alive in session ``sid``."""
    return live_processes(SESSION, sid)
